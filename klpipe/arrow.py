"""Zero-copy numpy ↔ Arrow for primitive arrays, without pyarrow's lazy pandas import.

`Array.to_numpy()` and `pa.array(ndarray)` import pandas (when it is installed) to check for
pandas types: about 170 ms on every `klpipe score` start for nothing. These two helpers go
through the raw buffers instead.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa


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


def from_numpy(values: np.ndarray) -> pa.Array:
    """A non-null Arrow array over a 1-d numeric numpy array's memory (copied only if not contiguous)."""
    values = np.ascontiguousarray(values)
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(values)])
