"""A tree pass's context in parts, in the order the cascade merges them (cascade.py): which rows attend over which
path nodes, up to where. Pure bookkeeping over the tree's paths; context_cache.py builds each layer's parts from it."""

from __future__ import annotations

import numpy as np


def context_parts(ancestors: list[list[int]], cached: np.ndarray | None = None,
                  ends: np.ndarray | None = None) -> list[tuple[slice, list[int], int | None]]:
    """The pass's context in parts, in the order the cascade merges them: (a slice of batch rows, path nodes
    that every one of those rows attends over, up to position `stop`; None: in full).

    First, for each stretch of consecutive runs (`by_parent`) whose paths open with the same node, the
    nodes they all open with: one product for all their rows. An agent pass's rows share a long system
    prompt but few parents, and the kernel runs one large product much faster than a product per run
    (benchmarks/prefix_attention.py). Then, per run, the rest of its path, up to its context's end.

    `cached`: each row's context length, where a row may continue less than its whole path (the right layout feeds
    the end of a short node's context again); shared nodes must then end within every row's context."""
    runs = by_parent(ancestors, cached)
    parts: list[tuple[slice, list[int], int | None]] = []
    tails: list[tuple[slice, list[int], int | None]] = []
    start = 0
    while start < len(runs):
        stop = start + 1  # runs[start:stop]: adjacent rows, every path opening with the same node
        while (stop < len(runs) and runs[stop][1][0] == runs[start][1][0]
               and runs[stop][0].start == runs[stop - 1][0].stop):
            stop += 1
        shared = 0
        if stop - start > 1:
            paths = [path for _, path, _ in runs[start:stop]]
            limit = None
            if cached is not None:  # every run's length is then an int (by_parent)
                assert ends is not None, "context lengths (`cached`) come with each node's end (`ends`)"
                limit = (ends, min(length for _, _, length in runs[start:stop] if length is not None))
            shared = _shared_nodes(paths, limit)
            if shared:
                end = None if limit is None else int(limit[0][paths[0][shared - 1]])
                parts.append((slice(runs[start][0].start, runs[stop - 1][0].stop), paths[0][:shared], end))
        tails += [(rows, path[shared:], length) for rows, path, length in runs[start:stop] if len(path) > shared]
        start = stop
    return parts + tails


def _shared_nodes(paths: list[list[int]], limit: tuple[np.ndarray, int] | None) -> int:
    """How many nodes every path opens with; with `limit` (each node's end, the least context length of the rows),
    only as many as end within every row's context."""
    shared = 0
    while (all(len(path) > shared and path[shared] == paths[0][shared] for path in paths)
           and (limit is None or int(limit[0][paths[0][shared]]) <= limit[1])):
        shared += 1
    return shared


def by_parent(ancestors: list[list[int]],
              cached: np.ndarray | None = None) -> list[tuple[slice, list[int], int | None]]:
    """The pass's rows with context in runs of one parent and one context length: (a slice of batch rows, their
    path from the root, the context's length; None where `cached` is not given: the whole path). Runs, not groups:
    a slice of the batch is a view, so the cascade reads and merges a run where it lies. A row whose context holds
    no position (the right layout feeds all of it again) has none."""
    runs: list[tuple[slice, list[int], int | None]] = []
    for row, path in enumerate(ancestors):
        length = None if cached is None else int(cached[row])
        if not path or length == 0:
            continue
        if runs and runs[-1][0].stop == row and runs[-1][1][-1] == path[-1] and runs[-1][2] == length:
            runs[-1] = (slice(runs[-1][0].start, row + 1), runs[-1][1], length)
        else:
            runs.append((slice(row, row + 1), path, length))
    return runs
