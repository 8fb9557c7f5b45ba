"""Token-budget batching: pure index arithmetic, no torch.

Rows are sorted by length inside a bounded window (one chunk of the input), cut into batches whose
padded size fits a token budget, and their results are put back in input order by the caller.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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
    sizes = np.asarray(lengths, dtype=np.int64)
    n = len(sizes)
    if n == 0:
        return []
    if batch_cost is None:
        batch_cost = max_tokens // 16
    # Stable sort, so equal lengths keep input order and the plan is deterministic.
    order = np.argsort(-sizes, kind="stable")
    padded_len = np.maximum(sizes[order], 1)  # (n,) descending: a batch's first row is its longest

    def last_batch(j: int) -> np.ndarray:  # the cost of sorted rows [start, j) as one batch, every start
        rows = j - np.arange(j)
        padded = rows * padded_len[:j]
        return within_budget(padded + batch_cost, padded, rows, max_tokens)

    return cheapest_cut(order, last_batch)[1]


def cheapest_cut(order: np.ndarray, last_batch: Callable[[int], np.ndarray]) -> tuple[float, list[np.ndarray]]:
    """(least total cost, batches): `order` cut into consecutive batches, by dynamic programming.

    `last_batch(j)` gives, for every start s < j, the cost of order[s:j] as one batch (inf where
    it may not be one). Equivalent to trying every cut, in O(n²) instead of O(2ⁿ).
    """
    n = len(order)
    best = np.zeros(n + 1, dtype=np.float64)  # best[j]: least cost of the first j items
    cut = np.zeros(n + 1, dtype=np.int64)  # cut[j]: where their last batch starts
    for j in range(1, n + 1):
        cost = best[:j] + last_batch(j)
        cut[j] = int(np.argmin(cost))
        best[j] = cost[cut[j]]
    batches: list[np.ndarray] = []
    j = n
    while j > 0:
        batches.append(order[cut[j]:j])
        j = cut[j]
    return float(best[n]), batches[::-1]


def within_budget(cost: np.ndarray, memory: np.ndarray, rows: np.ndarray, max_tokens: int) -> np.ndarray:
    """`cost`, made inf where a batch of more than one row needs more than `max_tokens` (a lone row always runs)."""
    return np.where((memory > max_tokens) & (rows > 1), np.inf, cost)


def padding_efficiency(lengths: Sequence[int], batches: list[np.ndarray]) -> tuple[int, int]:
    """(real tokens, padded tokens) that `batches` (row indices into `lengths`) would process."""
    sizes = np.asarray(lengths, dtype=np.int64)
    real = int(sum(int(sizes[b].sum()) for b in batches))
    padded = int(sum(len(b) * int(sizes[b].max()) for b in batches if len(b)))
    return real, padded


def pack_batches(lengths: Sequence[int], max_tokens: int) -> list[np.ndarray]:
    """Group row indices so each batch's rows, laid end to end without pads (model/attention/packing.py), fit
    `max_tokens`.

    Rows are taken longest first, as plan_batches takes them, and a batch closes when the next row would pass
    the budget; a row longer than the budget runs alone."""
    sizes = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-sizes, kind="stable")
    batches: list[np.ndarray] = []
    current: list[int] = []
    total = 0
    for index in order.tolist():
        length = max(int(sizes[index]), 1)
        if current and total + length > max_tokens:
            batches.append(np.array(current, dtype=np.int64))
            current, total = [], 0
        current.append(index)
        total += length
    if current:
        batches.append(np.array(current, dtype=np.int64))
    return batches
