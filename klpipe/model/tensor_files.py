"""Tensors read from safetensors files with positioned reads into memory the process owns; a decoder layer's in one
read past the page cache, into a buffer kept for the run.

The streamed model (weight_store.py) reads each decoder layer once per group of rows; nothing is mapped, the format
is checked as it is read, and a tensor lies at its file offset modulo 64 as in a memory map, so that a streamed run
keeps the in-memory run's bits. docs/precompute.md, "How a streamed model runs", says why each is so.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
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
        self._direct: dict[int, int | None] = {}  # each file's descriptor -> one opened O_DIRECT, None: refused
        self.entries: dict[str, Entry] = {}
        self.direct_reads = 0  # layers read past the page cache (the tests and the benchmark read it)
        try:
            for path in paths:
                fd = os.open(path, os.O_RDONLY)
                self._fds.append(fd)
                self.entries.update(_header(path, fd))
                direct = self._direct[fd] = _open_direct(path)
                if direct is not None:
                    self._fds.append(direct)
        except BaseException:
            self.close()
            raise

    def read(self, name: str, into: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor `name`, read now into `into` (uint8, its size in bytes) or a buffer of its own."""
        entry = self.entries[name]
        buffer = _placed(entry.nbytes, entry.offset, entry.dtype.itemsize) if into is None else into  # (bytes,)
        _read_into(entry.fd, buffer.numpy().data, entry.offset, "a tensor's end")
        return buffer.view(entry.dtype).reshape(entry.shape)

    def read_rows(self, name: str, rows: list[int]) -> torch.Tensor:
        """Rows `rows` (ascending, distinct) of the 2-D tensor `name`, read now: (len(rows), width) in its dtype. Each
        run of consecutive rows is one positioned read; a row outside the tensor is an IndexError, as indexing it."""
        entry = self.entries[name]
        count, width = entry.shape
        if rows and not 0 <= rows[0] <= rows[-1] < count:
            raise IndexError(f"{name}: row {rows[0] if rows[0] < 0 else rows[-1]} of a table of {count}")
        row_bytes = width * entry.dtype.itemsize
        # (rows x row bytes,), where the file's map would put the first row: a block of whole rows lies as the weight's
        out = _placed(len(rows) * row_bytes, entry.offset + (rows[0] if rows else 0) * row_bytes, entry.dtype.itemsize)
        view = out.numpy().data
        start = 0
        while start < len(rows):
            end = start + 1
            while end < len(rows) and rows[end] == rows[end - 1] + 1:
                end += 1
            _read_into(entry.fd, view[start * row_bytes:end * row_bytes], entry.offset + rows[start] * row_bytes,
                       f"{name}'s rows")
            start = end
        return out.view(entry.dtype).reshape(len(rows), width)  # (rows, width)

    def read_together(self, names: Iterable[str], buffers: Buffers) -> dict[str, torch.Tensor]:
        """The tensors `names`, read now into one of `buffers`'s buffers: in one direct read where they lie
        together, else one by one through the page cache, side by side (each where a map of the file puts it:
        _place)."""
        entries = {name: self.entries[name] for name in names}
        together = self._read_direct(entries, buffers) if entries else None
        if together is not None:
            return together
        starts, end = {}, 0
        for name, entry in entries.items():
            starts[name] = end = _place(end, entry.offset, entry.dtype.itemsize)
            end += entry.nbytes
        block = buffers.take(end)  # at a multiple of ALIGN
        return {name: self.read(name, block[start:start + entries[name].nbytes]) for name, start in starts.items()}

    def _read_direct(self, entries: dict[str, Entry], buffers: Buffers) -> dict[str, torch.Tensor] | None:
        """`entries` read in one O_DIRECT read of the block-aligned span around them; None where that cannot be:
        another file, O_DIRECT refused, the tensors scattered (under 90% of their span), an offset unfit for its
        dtype's view."""
        fds = {entry.fd for entry in entries.values()}
        direct = self._direct.get(next(iter(fds))) if len(fds) == 1 else None
        if direct is None:
            return None
        begin = min(entry.offset for entry in entries.values())
        end = max(entry.offset + entry.nbytes for entry in entries.values())
        if (sum(entry.nbytes for entry in entries.values()) < 0.9 * (end - begin)
                or any(entry.offset % entry.dtype.itemsize for entry in entries.values())):
            return None
        first = begin // BLOCK * BLOCK
        block = buffers.take(-(-end // BLOCK) * BLOCK - first, align=BLOCK)
        view, done = block.numpy().data, 0
        try:
            while done < end - first:  # the last block may run past the file's end: the read stops there
                count = os.preadv(direct, [view[done:]], first + done)
                if count <= 0:
                    raise ModelError(f"a safetensors file ended {end - first - done} bytes short of a tensor's end")
                done += count
        except OSError:  # the file system took the descriptor but not the read (EINVAL): the page cache from now on
            fd = next(iter(fds))
            self._direct[fd] = None
            return None
        self.direct_reads += 1
        return {name: block[entry.offset - first:entry.offset - first + entry.nbytes].view(entry.dtype)
                .reshape(entry.shape) for name, entry in entries.items()}

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def _read_into(fd: int, view: memoryview, offset: int, what: str) -> None:
    """`view` filled from `fd` at `offset` by positioned reads (a read may return less than asked); a file that ends
    first is refused, naming `what` it was read for."""
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done:]], offset + done)
        if count <= 0:
            raise ModelError(f"a safetensors file ended {len(view) - done} bytes short of {what}")
        done += count


ALIGN = 64  # bytes: torch's CPU allocator aligns every tensor so (its vector kernels assume no less)


def _place(at: int, offset: int, itemsize: int) -> int:
    """The first position from `at` in a buffer aligned to ALIGN where a tensor at file offset `offset` lies as a
    memory map of the file would put it (the same address modulo ALIGN): where from_pretrained's tensors lie, read
    from a map, and the layers' (read past the page cache, each at its file offset). A matrix-vector product's rounding
    depends on where its matrix lies (measured: Gemma 4's per-layer projection over one position gave results
    3e-7 apart at 0 and 8 modulo 64), so every tensor read lies where the model in memory has it. An offset that does
    not suit its dtype gets the next multiple of ALIGN."""
    if offset % itemsize:
        return -(-at // ALIGN) * ALIGN
    return at + (offset - at) % ALIGN


def _placed(nbytes: int, offset: int, itemsize: int) -> torch.Tensor:
    """`nbytes` of fresh memory (uint8) at the address _place says for file offset `offset`."""
    fresh = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = _place(fresh.data_ptr(), offset, itemsize) - fresh.data_ptr()  # the address itself as the position
    return fresh[skip:skip + nbytes]
BLOCK = 4096  # what O_DIRECT asks offsets, lengths and buffers to be multiples of (the largest logical block)


def _open_direct(path: Path) -> int | None:
    """`path` opened for O_DIRECT reads, or None where the system or the file system has none (tmpfs, macOS)."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        return None
    try:
        return os.open(path, os.O_RDONLY | flag)
    except OSError:
        return None


class Buffers:
    """Up to `count` buffers kept to read layers into, each taken again only once nothing else references it;
    `pinned`: page-locked (a GPU's staging, copied from at full bandwidth: torch's pinned allocator, which caches
    them)."""

    def __init__(self, count: int = 2, pinned: bool = False):
        self.count = count
        self.pinned = pinned
        self._kept: list[torch.Tensor] = []
        self.reused = 0  # reads into a kept buffer (the tests and the benchmark read it)

    def take(self, nbytes: int, align: int = ALIGN) -> torch.Tensor:
        """`nbytes` of memory (uint8, starting at a multiple of `align`) nothing else references: a kept buffer where
        one is free, else new memory (kept, where fewer than `count` are)."""
        for i, kept in enumerate(self._kept):
            if _references(kept) == 1:  # the kept tensor's own: nothing else sees its memory
                skip = -kept.data_ptr() % align
                if kept.numel() >= skip + nbytes:
                    self.reused += 1
                    return kept[skip:skip + nbytes]
                self._kept.pop(i)  # too small for this layer: a larger one in its place
                break
        try:
            fresh = torch.empty(nbytes + BLOCK, dtype=torch.uint8, pin_memory=self.pinned)  # room to align to a block
        except RuntimeError:  # no page-locked memory to be had (a container's locked-memory limit): pageable, slower
            self.pinned = False
            fresh = torch.empty(nbytes + BLOCK, dtype=torch.uint8)
        if len(self._kept) < self.count and _references(fresh) is not None:
            self._kept.append(fresh)
        skip = -fresh.data_ptr() % align
        return fresh[skip:skip + nbytes]  # a view: the kept tensor is never handed out, its count is the pool's alone


def _references(tensor: torch.Tensor) -> int | None:
    """How many tensors share `tensor`'s storage (torch's own count), or None where this torch does not say."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else count(tensor.untyped_storage()._cdata) - 1  # less untyped_storage()'s own


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
