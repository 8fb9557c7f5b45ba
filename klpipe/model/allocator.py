"""What the C allocator holds beyond what the tensors hold: glibc's malloc, told to give memory back.

A streamed model lives near its memory budget (layer_major.py), so what the process holds must be what it
computes. glibc's malloc keeps two kinds of memory the tensors have let go of:

    arenas      each thread that allocates gets an arena of its own (up to 8 per core), and what it frees stays
                there (passes in threads of their own: +200 MiB of RSS on a 2.5 GiB Llama streamed over 8 passes
                of 512 tokens); a group's passes are greenlets on one thread, the layer reader the one other
    retention   freed blocks inside an arena are kept for reuse, and the threshold above which a block is
                mapped on its own (and unmapped when freed) rises to the largest block freed, so a freed
                layer's 16 MiB matrices stay held (another 180 MiB there)

`one_arena` makes every later thread share the main arena (the reader and the passes rarely allocate at once),
`trim` hands the arenas' free pages back to the kernel (malloc_trim: the kernel then counts them free, which a
memory cgroup's limit is measured against). Elsewhere (musl, macOS) both do nothing: their allocators keep no
per-thread arenas of this kind.

Trimming has a price: every page handed back is faulted in and zeroed again by the next allocation that reuses
it. Trimmed after each pass's turn, a 2.5 GiB Llama streamed under 850 MiB spent 36.5 s of system time (10.0M
page faults) against 4.8 s in memory, and scored at 76% of the in-memory speed; never trimmed, 12.4 s and 84%,
but its resident set peaked at 932 MiB, over the budget. So `trim(above=...)` trims only once the process holds more
than the run allows (its own resident memory: process_memory.own): the free pages are kept for reuse
while there is room, and given back when there is not.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

from klpipe import process_memory

M_ARENA_MAX = -8  # glibc's malloc.h


@functools.cache
def _glibc():
    """glibc's libc, or None elsewhere."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") else None  # glibc alone has it


def one_arena() -> None:
    """Every thread made from now on allocates from the arenas that exist (the main one): nothing per thread."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(M_ARENA_MAX, 1)


def trim(above: int | None = None) -> bool:
    """The free pages of every arena given back to the kernel; with `above`, only once this process's own resident
    memory (process_memory.own: what it allocated, which a trim can lower) is over `above` bytes. Whether it trimmed."""
    libc = _glibc()
    if libc is None or (above is not None and process_memory.own() <= above):
        return False
    libc.malloc_trim(0)
    return True
