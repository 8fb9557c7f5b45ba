"""Token-budget batching: pure index arithmetic, no torch.

Rows are sorted by length inside a bounded window (one chunk of the input), cut into batches whose
padded size fits a token budget, and their results are put back in input order by the caller.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

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


# -- prefix sharing --------------------------------------------------------------------------------


def group_by_prompt(prompt_ids: np.ndarray, prompt_offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(group of each row, first row of each group): rows whose prompt token ids are identical share a group.

    Groups are numbered in order of first appearance, so the grouping of a chunk never depends on
    anything but its rows. Exact comparison of the ids, not a hash: a collision would silently give
    a row another prompt's logprobs.
    """
    group_of_row = np.empty(len(prompt_offsets) - 1, dtype=np.int64)
    first_rows: list[int] = []
    seen: dict[bytes, int] = {}
    for row in range(len(group_of_row)):
        key = prompt_ids[prompt_offsets[row]:prompt_offsets[row + 1]].tobytes()
        group = seen.setdefault(key, len(first_rows))
        if group == len(first_rows):
            first_rows.append(row)
        group_of_row[row] = group
    return group_of_row, np.asarray(first_rows, dtype=np.int64)


@dataclass
class SharedBatch:
    """Prompts prefilled once, together, and the response passes that continue them.

    `rows` are every row of those prompts' groups; `passes` hold the rows that feed response tokens
    (two or more response tokens: the first is predicted by the prompt's last position, and the last
    is only ever a target), each pass one forward against the prompts' KV cache.
    """

    groups: np.ndarray  # (n,) group indices, longest prompt first
    rows: np.ndarray  # every row of those groups
    passes: list[np.ndarray] = field(default_factory=list)  # row indices, one array per forward pass


# A response pass charges one budget token for every this many prompt positions a row attends to.
# Those positions are held as keys and values, gathered one layer at a time, while a fed token
# carries every activation of a layer: for GQA models a held position costs far less memory (about
# 1/13 for the benchmark Llama, 1/20 to 1/40 for Gemma 4 E2B, 1/23 for Llama 3 8B), so 1/8 is a
# conservative price. Charging them in full made passes of 2-3 rows and cost ~5-10% on CPU.
HELD_POSITIONS_PER_TOKEN = 8


def plan_shared(prompt_lengths: Sequence[int], response_lengths: Sequence[int], group_of_row: np.ndarray,
                max_tokens: int) -> list[SharedBatch]:
    """Cut groups of rows that share a prompt into prefill batches and response passes.

    A prefill batch is the prompts of several groups, left-padded to the longest: `plan_batches` over
    prompt lengths, so its padded size fits `max_tokens` (a prompt longer than that runs alone).
    Its rows' responses then run in passes against that KV cache, sorted by length and cut by the
    same dynamic programme: a pass of b rows costs b × (longest fed response + longest prompt /
    HELD_POSITIONS_PER_TOKEN), the tokens it feeds plus the prompt positions its rows attend to.
    """
    prompt_lengths = np.asarray(prompt_lengths, dtype=np.int64)  # (groups,)
    fed = np.maximum(np.asarray(response_lengths, dtype=np.int64) - 1, 0)  # (rows,) response tokens fed
    rows_of_group = _rows_by_group(group_of_row, len(prompt_lengths))
    batches = []
    for groups in plan_batches(prompt_lengths, max_tokens):
        rows = np.sort(np.concatenate([rows_of_group[g] for g in groups]))
        feeding = rows[fed[rows] > 0]
        # Every row's keys and values are padded to the batch's longest prompt.
        held = -(-int(prompt_lengths[groups].max()) // HELD_POSITIONS_PER_TOKEN)
        passes = [feeding[p] for p in plan_batches(held + fed[feeding], max_tokens)]
        batches.append(SharedBatch(groups=groups, rows=rows, passes=passes))
    return batches


def _rows_by_group(group_of_row: np.ndarray, groups: int) -> list[np.ndarray]:
    order = np.argsort(group_of_row, kind="stable")
    bounds = np.searchsorted(group_of_row[order], np.arange(groups + 1))
    return [order[bounds[g]:bounds[g + 1]] for g in range(groups)]
