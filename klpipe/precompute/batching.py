"""Token-budget batching: pure index arithmetic, no torch.

Rows are sorted by length inside a bounded window (one chunk of the input), cut into batches whose
padded size fits a token budget, and their results are put back in input order by the caller.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def plan_batches(lengths: Sequence[int], max_tokens: int, batch_cost: int | None = None) -> list[np.ndarray]:
    """Group row indices so each batch's padded size (rows × longest row) fits `max_tokens`.

    Rows are sorted longest first, so an out-of-memory error shows up in the first batch, not
    after an hour, and rows of similar length share a batch. The cut points are then chosen by
    dynamic programming to minimise padded tokens plus `batch_cost` per batch: the cost, in
    tokens, of one more forward pass (default max_tokens / 16). Greedy filling would put a
    long row and many short ones together and pay for the short ones' padding. A row longer
    than the whole budget still gets a batch of its own rather than being dropped.
    """
    if max_tokens < 1:
        raise ValueError("max_tokens must be positive")
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    if n == 0:
        return []
    if batch_cost is None:
        batch_cost = max_tokens // 16
    # Stable sort, so equal lengths keep input order and the plan is deterministic.
    order = np.argsort(-lengths, kind="stable")
    padded_len = np.maximum(lengths[order], 1)  # (n,) descending: a batch's first row is its longest

    # best[j]: least cost of batching the first j sorted rows; cut[j]: where the last batch starts.
    best = np.zeros(n + 1, dtype=np.float64)
    cut = np.zeros(n + 1, dtype=np.int64)
    for j in range(1, n + 1):
        starts = np.arange(j)  # the last batch is sorted rows [start, j)
        rows = j - starts
        padded = rows * padded_len[:j]
        cost = best[:j] + padded + batch_cost
        cost[(padded > max_tokens) & (rows > 1)] = np.inf  # over budget, unless a lone row
        cut[j] = int(np.argmin(cost))
        best[j] = cost[cut[j]]

    batches = []
    j = n
    while j > 0:
        batches.append(order[cut[j]:j])
        j = cut[j]
    return batches[::-1]


def padding_efficiency(lengths: Sequence[int], batches: list[np.ndarray]) -> tuple[int, int]:
    """(real tokens, padded tokens) that `batches` (row indices into `lengths`) would process."""
    lengths = np.asarray(lengths, dtype=np.int64)
    real = int(sum(int(lengths[b].sum()) for b in batches))
    padded = int(sum(len(b) * int(lengths[b].max()) for b in batches if len(b)))
    return real, padded
