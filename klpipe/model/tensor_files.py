"""Tensors read from safetensors files with plain reads, one at a time, into memory the process owns.

The streamed model (weight_store.py) reads each decoder layer once per group of rows. Mapping the files
(`safe_open`) would leave every page read mapped into the process until the kernel reclaims it: its resident set
then counts the whole model (a 2.5 GiB model streamed under a 900 MiB budget reported a peak of 3.4 GiB), and
each 4 KiB page costs a fault. A positioned read (`os.preadv`) of a tensor's byte range straight into the tensor's
own buffer costs one copy, lets the kernel read ahead, and leaves nothing mapped: what the process holds is what
it computes with.

The format (safetensors' own: an 8-byte little-endian header length, a JSON header of each tensor's dtype, shape
and byte range, then the bytes) is checked as it is read: every range inside the file and the size its dtype and
shape say, nothing else run or trusted from the file.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from klpipe.errors import ModelError

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
MAX_HEADER = 100 << 20  # safetensors' own limit on its JSON header


@dataclass(frozen=True)
class Entry:
    """Where one tensor lies: its file (an open descriptor), byte offset and length, dtype and shape."""

    fd: int
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class TensorFiles:
    """The tensors of some safetensors files, by name; `read(name)` reads one."""

    def __init__(self, paths: list[Path]):
        self._fds: list[int] = []
        self.entries: dict[str, Entry] = {}
        try:
            for path in paths:
                fd = os.open(path, os.O_RDONLY)
                self._fds.append(fd)
                self.entries.update(_header(path, fd))
        except BaseException:
            self.close()
            raise

    def read(self, name: str) -> torch.Tensor:
        """The tensor `name`, read now into a buffer of its own."""
        entry = self.entries[name]
        buffer = torch.empty(entry.nbytes, dtype=torch.uint8)  # (bytes,)
        view = memoryview(buffer.numpy())
        done = 0
        while done < entry.nbytes:
            count = os.preadv(entry.fd, [view[done:]], entry.offset + done)
            if count <= 0:
                raise ModelError(f"a safetensors file ended {entry.nbytes - done} bytes short of a tensor's end")
            done += count
        return buffer.view(entry.dtype).reshape(entry.shape)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def _header(path: Path, fd: int) -> dict[str, Entry]:
    """Each tensor's Entry, from the file's header, every range checked against the file."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    length = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 0 < length <= min(MAX_HEADER, size - 8):
        raise ModelError(f"{path}: not a safetensors file (its header length is {length})")
    try:
        header = json.loads(os.pread(fd, length, 8))
    except ValueError as exc:
        raise ModelError(f"{path}: not a safetensors file ({exc})") from None
    start = 8 + length
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(n) for n in info["shape"])
            begin, end = (int(n) for n in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ModelError(f"{path}: tensor {name!r} has a dtype, shape or range klpipe cannot read "
                             f"({str(info)[:80]})") from None
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if not 0 <= begin <= end <= size - start or end - begin != nbytes:
            raise ModelError(f"{path}: tensor {name!r}'s bytes ({begin}..{end}) do not match its shape {shape} "
                             f"or lie outside the file")
        entries[name] = Entry(fd, start + begin, nbytes, dtype, shape)
    return entries
