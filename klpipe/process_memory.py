"""What this process holds in memory now, as the kernel counts it (/proc/self/statm; about 10 µs a read).

Two counts, for two questions:

    resident    every page it holds, its libraries' code included: what the budget compares with the memory
                the run may use, since a memory cgroup charges those pages too (precompute/budget.py)
    own         the resident set less the pages shared with files (the kernel's RssAnon): what the process
                itself allocated, and so what handing memory back can lower (model/allocator.py)

Both are 0 where the kernel does not say (not Linux). Torch-free: the budget is decided before torch loads.
"""

from __future__ import annotations

import os


def _statm() -> tuple[int, int] | None:
    """(resident, shared) in bytes, or None where /proc does not say."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            fields = statm.read().split()
        page = os.sysconf("SC_PAGE_SIZE")
        return int(fields[1]) * page, int(fields[2]) * page
    except (OSError, ValueError, IndexError):
        return None


def resident() -> int:
    """This process's resident set, in bytes."""
    counts = _statm()
    return counts[0] if counts is not None else 0


def own() -> int:
    """This process's own resident memory, in bytes: the resident set less the pages it shares with the files they
    were read from (its libraries' code: a cgroup charges them once, to whoever read them first, and may drop them)."""
    counts = _statm()
    return counts[0] - counts[1] if counts is not None else 0
