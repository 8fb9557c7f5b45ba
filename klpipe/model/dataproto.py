"""verl's `DataProto.save_to_disk` files (and the `skip.rollout` dump, `gen_batch.dp`), read without running their code.

`save_to_disk` pickles the DataProto whole. Its state (verl 0.9.1, `DataProto.__getstate__`) is a triple:
`torch.save` bytes of the batch (a consolidated TensorDict: one byte storage and the leaves' dtype, shape and
offsets), `non_tensor_batch` (numpy arrays, object arrays for strings and dicts) and `meta_info`. Unpickling
it with pickle (as `load_from_disk` does) runs whatever the file names; here each pickle admits only the exact
classes and functions a DataProto holds, the batch's rebuilt from its storage by klpipe, and anything else is
refused in one line naming it. torch reads the inner `torch.save` archive (its storages) for the restricted
unpickler, so this lives under model/.
"""

from __future__ import annotations

import collections
import io
import json
import pickle
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from numpy._core import multiarray

from klpipe.errors import InputError

CONVERT = ("python -c \"import sys, pyarrow as pa, pyarrow.parquet as pq; from verl import DataProto; "
           "d = DataProto.load_from_disk(sys.argv[1]); pq.write_table(pa.table({**{k: v.tolist() for k, v in "
           "d.batch.items()}, **{k: v.tolist() for k, v in d.non_tensor_batch.items()}}), sys.argv[1] + '.parquet')\" "
           "FILE")


class _DataProto:
    """Stands in for verl.protocol.DataProto: keeps the state its __getstate__ wrote."""

    def __setstate__(self, state):
        self.state = state


def _rebuild_consolidated(metadata: dict, storage: torch.Tensor) -> dict:
    """tensordict's `_rebuild_tensordict_files_consolidated`, for flat batches: each leaf a view of the storage."""
    metadata = dict(metadata)
    leaves, non_tensors = metadata.pop("leaves"), metadata.pop("non_tensors", {})
    for key in ("cls", "cls_metadata", "size"):
        metadata.pop(key, None)
    if metadata or non_tensors:  # nested TensorDicts or non-tensor data: not what verl's batch holds
        raise _Refused(f"a nested or non-tensor entry ({next(iter(metadata or non_tensors))!r}) in the batch")
    batch = {}
    for key, leaf in leaves.items():
        dtype_name, shape, start, stop, pad = leaf[:5]
        if len(leaf) > 5 or str(key).startswith("<NJT"):
            raise _Refused(f"a nested tensor ({key!r}) in the batch")
        dtype = getattr(torch, str(dtype_name).removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise _Refused(f"a leaf of dtype {dtype_name!r}")
        value = storage[start:stop].view(dtype)
        numel = int(np.prod(shape)) if len(shape) else 1
        batch[key] = value[:numel].view(tuple(shape)) if pad else value.view(tuple(shape))
    return batch


class _Refused(Exception):
    """What the file holds that klpipe does not load."""


# The exact globals each pickle may name; anything else is refused, never imported.
_OUTER = {
    ("verl.protocol", "DataProto"): _DataProto,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("numpy._core.multiarray", "_reconstruct"): multiarray._reconstruct,
    ("numpy.core.multiarray", "_reconstruct"): multiarray._reconstruct,
    ("numpy._core.multiarray", "scalar"): multiarray.scalar,  # a numpy scalar inside an object array
    ("numpy.core.multiarray", "scalar"): multiarray.scalar,
    ("collections", "OrderedDict"): collections.OrderedDict,
}
_INNER = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("tensordict._reductions", "_rebuild_tensordict_files_consolidated"): _rebuild_consolidated,
}


def _restricted(allowed: dict):
    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            try:
                return allowed[(module, name)]
            except KeyError:
                raise _Refused(f"{module}.{name}") from None
    return Unpickler


class _InnerPickle:
    """A pickle module for torch.load whose Unpickler admits only a consolidated TensorDict's globals."""

    Unpickler = _restricted(_INNER)
    load = pickle.load
    __name__ = "klpipe_restricted_pickle"


def read_dataproto(path: object, local: Path) -> pa.Table:
    """The DataProto in `local` (named `path` in messages) as one Arrow table: a column per batch key and per
    non-tensor key, one row per sample; meta_info is left out."""
    try:
        with open(local, "rb") as file:
            proto = _restricted(_OUTER)(file).load()
        if not isinstance(proto, _DataProto) or not isinstance(getattr(proto, "state", None), tuple) \
                or len(proto.state) != 3:
            raise _Refused(f"a {type(proto).__name__}, not verl's DataProto")
        packed, non_tensors, _meta_info = proto.state
        batch = {}
        if packed is not None:
            if not isinstance(packed, bytes):
                raise _Refused("a batch serialized another way (VERL_DATAPROTO_SERIALIZATION_METHOD=numpy)")
            batch = torch.load(io.BytesIO(packed), pickle_module=_InnerPickle, weights_only=False,
                               map_location="cpu")
            if not isinstance(batch, dict):
                raise _Refused(f"a batch of type {type(batch).__name__}")
    except _Refused as what:
        raise InputError(f"{path}: a pickle holding {what}, which klpipe does not load (unpickling runs code "
                         f"from the file); klpipe reads verl's DataProto.save_to_disk files; convert this one "
                         f"with verl: {CONVERT}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, RuntimeError, OSError) as exc:
        said = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(f"{path}: not a readable DataProto pickle ({said})") from None
    columns = {key: _tensor_column(value) for key, value in batch.items()}
    for key, value in (non_tensors or {}).items():
        columns[key] = _non_tensor_column(value)
    lengths = {len(column) for column in columns.values()}
    if len(lengths) != 1:
        raise InputError(f"{path}: the DataProto's keys hold different numbers of rows ({sorted(lengths)})")
    return pa.table(columns)


def _tensor_column(value: torch.Tensor) -> pa.Array:
    """A (rows, ...) tensor as a column of its rows, in its own dtype (float32 stays float32)."""
    array = value.numpy()
    if array.ndim == 1:
        return pa.array(array)
    if array.ndim == 2:
        return pa.array(list(array))
    return pa.array(array.tolist())  # position_ids of a vision model: (rows, 3, width)


def _non_tensor_column(value) -> pa.Array:
    """A non_tensor_batch entry as a column: typed where Arrow can type it, else each value's JSON text."""
    values = value.tolist() if isinstance(value, np.ndarray) else list(value)
    try:
        return pa.array(values)
    except (pa.ArrowException, TypeError, ValueError):
        return pa.array([None if v is None else json.dumps(v, default=str) for v in values], pa.string())
