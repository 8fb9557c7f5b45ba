"""glibc's malloc told to give memory back (klpipe/model/allocator.py): only once the process holds more than it
may, and what it holds read as the kernel counts it."""

import pytest
import torch

from klpipe.model import allocator


def anonymous() -> int:
    """The kernel's own count of this process's anonymous memory (RssAnon), in bytes."""
    status = open("/proc/self/status").read()
    return int(status.split("RssAnon:")[1].split()[0]) << 10


@pytest.mark.skipif(allocator._glibc() is None, reason="malloc_trim is glibc's; elsewhere trim does nothing")
def test_freed_memory_goes_back_only_above_the_allowance():
    allocator.one_arena()
    # Freed blocks of 1 MiB, under malloc's mmap threshold once raised: they stay in the arena when freed.
    held = [torch.ones(1 << 18) for _ in range(4)]
    big = torch.ones(64 << 18)  # 64 MiB: raises the threshold, so what follows stays in the heap
    del big
    blocks = [torch.ones(1 << 18) for _ in range(200)]  # 200 MiB in the arena
    del blocks
    kept = anonymous()
    assert abs(allocator.resident() - kept) < 8 << 20  # statm's resident less shared: the kernel's RssAnon
    assert not allocator.trim(above=kept + (256 << 20))  # under the allowance: nothing handed back
    assert anonymous() > kept - (16 << 20)
    assert allocator.trim(above=kept - (64 << 20))  # over it: the free pages go back
    assert anonymous() < kept - (150 << 20), f"{kept >> 20} MiB before the trim, {anonymous() >> 20} after"
    del held
