"""numpy ↔ Arrow without pandas, and the list-column plumbing both stages share.

`Array.to_numpy()` and `pa.array(ndarray)` import pandas (when it is installed) to check for
pandas types: about 170 ms on every `klpipe score` start for nothing. `numpy_view` and
`from_numpy` go through the raw buffers instead.

A list column (token ids, logprobs) is a flat values array plus row offsets: `list_values` takes
one apart, `list_array` builds one, and `first_null_in_lists` finds the row holding a null value.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def numpy_view(array: pa.Array) -> np.ndarray:
    """A read-only numpy view of a numeric array, honouring slices. Slots that are null hold junk,
    so nulls must be rejected first."""
    kind = array.type
    if pa.types.is_floating(kind):
        code = "f"
    elif pa.types.is_signed_integer(kind):
        code = "i"
    elif pa.types.is_unsigned_integer(kind):
        code = "u"
    else:
        raise TypeError(f"numpy_view needs a numeric array, got {kind}")
    dtype = np.dtype(f"<{code}{kind.bit_width // 8}")
    data = array.buffers()[1]
    if data is None:  # an empty array may have no data buffer at all
        return np.empty(0, dtype=dtype)
    return np.frombuffer(data, dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize)


def numpy_valid(array: pa.Array) -> np.ndarray:
    """(len,) bool: True where `array` holds a value, False where it is null."""
    bitmap = array.buffers()[0]
    if bitmap is None:
        return np.ones(len(array), dtype=bool)
    bits = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8), bitorder="little")
    return bits[array.offset:array.offset + len(array)].astype(bool)


def from_numpy(values: np.ndarray, valid: np.ndarray | None = None) -> pa.Array:
    """An Arrow array over a 1-d numeric numpy array's memory (copied only if not contiguous); null where
    the bool array `valid` is False, non-null everywhere when it is None."""
    values = np.ascontiguousarray(values)
    bitmap = None
    if valid is not None and not valid.all():
        bitmap = pa.py_buffer(np.packbits(valid, bitorder="little"))  # Arrow's validity bits, LSB first
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [bitmap, pa.py_buffer(values)])


def is_list_type(kind: pa.DataType) -> bool:
    """list<…> or large_list<…>: both hold a row's tokens."""
    return pa.types.is_list(kind) or pa.types.is_large_list(kind)


def offsets_from_lengths(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """Zero-based row offsets (rows + 1,) int64 for rows of these lengths."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def list_array(offsets: np.ndarray, values: np.ndarray, valid: np.ndarray | None = None) -> pa.ListArray:
    """A list<values' type> array from zero-based row offsets (rows + 1,) and flat values (tokens,), a value
    null where `valid` (tokens,) is False."""
    return pa.ListArray.from_arrays(from_numpy(offsets.astype(np.int32, copy=False)), from_numpy(values, valid))


def list_values(array: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """The flat values (tokens,) and zero-based row offsets (rows + 1,) of a list array.

    A sliced array's offsets point into its parent's full values buffer, so both are cut down to
    the slice. Nulls must be rejected before this: null lists' offsets and null values carry junk.
    """
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    offsets = numpy_view(array.offsets)  # (rows + 1,)
    start, end = int(offsets[0]), int(offsets[-1])
    values = numpy_view(array.values.slice(start, end - start))  # (tokens,)
    return values, offsets - start


def first_null(array: pa.Array | pa.ChunkedArray) -> int | None:
    """The index of the first null slot, or None when there is none."""
    if not array.null_count:
        return None
    return pc.indices_nonzero(array.is_null())[0].as_py()


def first_null_in_lists(array: pa.Array) -> int | None:
    """The row of a list array whose list holds the first null value, or None (null lists must be rejected first)."""
    offsets = numpy_view(array.offsets)  # (rows + 1,), into the parent's values when sliced
    token = first_null(array.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0])))
    if token is None:
        return None
    return int(np.searchsorted(offsets - offsets[0], token, side="right") - 1)


def without_nones(value):
    """`value` with the None-valued keys of its dicts removed, at every depth: what Arrow's struct columns add."""
    if isinstance(value, dict):
        return {k: without_nones(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nones(v) for v in value]
    return value
