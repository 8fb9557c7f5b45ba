"""glibc's malloc told to give memory back (klpipe/model/allocator.py): only once the process holds more than it
may (its own resident memory: tests/test_process_memory.py holds that to the kernel's RssAnon)."""

from pathlib import Path

import pytest
import torch

from klpipe.model import allocator


def anonymous() -> int:
    """The kernel's own count of this process's anonymous memory (RssAnon), in bytes."""
    status = Path("/proc/self/status").read_text()
    return int(status.split("RssAnon:")[1].split()[0]) << 10


@pytest.mark.skipif(allocator._glibc() is None, reason="malloc_trim is glibc's; elsewhere trim does nothing")
def test_freed_memory_goes_back_only_above_the_allowance():
    # 64 KiB blocks (under malloc's mmap threshold: from the heap), every other one freed: each freed block lies
    # between two held ones, so free() keeps it in the arena (nothing to coalesce, nothing at the heap's top).
    pairs = [(torch.ones(1 << 14), torch.ones(1 << 14)) for _ in range(3200)]  # 2 x 200 MiB
    held = [keep for _, keep in pairs]
    del pairs
    kept = anonymous()
    assert not allocator.trim(above=kept + (256 << 20))  # under the allowance: nothing handed back
    assert anonymous() > kept - (16 << 20)
    assert allocator.trim(above=kept - (64 << 20))  # over it: the free pages go back
    assert anonymous() < kept - (150 << 20), f"{kept >> 20} MiB before the trim, {anonymous() >> 20} after"
    assert all(block[0] == 1 for block in held[::400])  # what is held is untouched
