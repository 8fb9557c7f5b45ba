"""A chunk of tokenized rows in, reference logprobs out: which rows share a prompt, and how they are batched.

GRPO samples every prompt G times, and agent prompts are often longer than the responses, so most
of what a per-row forward pass computes is the same prompt again. Rows of a chunk whose prompt
token ids are identical are grouped; each group's prompt runs once (a prefill) and its responses
continue from that KV cache (`ReferenceModel.score_shared`). Rows whose prompt appears once in the
chunk gain nothing from that and take the per-row path (`ReferenceModel.score_batch`), except on
models whose prefill skips layers for all but the last prompt position (Gemma 4's KV-shared
layers), where the prefill path is cheaper for every row.

Both paths give the same logprobs up to float rounding, and the plan depends only on the chunk's
rows, so a resumed or sharded run reproduces an uninterrupted one bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from klpipe.precompute.batching import (
    group_by_prompt,
    padding_efficiency,
    plan_batches,
    plan_shared,
)


@dataclass
class ForwardStats:
    """What the model was fed, summed over chunks."""

    fed_tokens: int = 0  # tokens fed to the model, padding excluded
    padded_tokens: int = 0  # tokens fed to the model, padding included
    prompt_tokens: int = 0  # prompt tokens of every row, as a per-row pass would feed them
    prompt_tokens_reused: int = 0  # of those, not recomputed: a shared prompt's second, third, ... row
    shared_rows: int = 0  # rows that continued a shared prompt

    @property
    def padding_efficiency(self) -> float:
        return self.fed_tokens / self.padded_tokens if self.padded_tokens else 1.0


def chunk_logprobs(model, chunk, max_tokens: int, temperature: float, sharing: str, stats: ForwardStats,
                   check_stop: Callable[[], None] = lambda: None) -> list[np.ndarray]:
    """Reference logprobs of every row of a tokenized chunk, in the chunk's row order.

    `check_stop` runs after every forward pass, so a preempted run abandons the chunk quickly.
    """
    prompt_len = chunk.prompt_lengths()
    response_len = chunk.response_lengths()
    stats.prompt_tokens += int(prompt_len.sum())
    results: list[np.ndarray | None] = [None] * chunk.num_rows
    group_of_row, first_row = group_by_prompt(chunk.prompt_ids, chunk.prompt_offsets)
    if sharing == "off":
        shared = np.zeros(chunk.num_rows, dtype=bool)
    elif sharing == "on":
        shared = np.ones(chunk.num_rows, dtype=bool)
    elif model.prefill_skips_layers:  # auto: even a prompt seen once is cheaper through the prefill
        shared = np.ones(chunk.num_rows, dtype=bool)
    else:  # auto: a prompt seen once gains nothing from a prefill of its own
        shared = np.bincount(group_of_row)[group_of_row] > 1

    alone = np.flatnonzero(~shared)
    fed = np.maximum(prompt_len[alone] + response_len[alone] - 1, 0)  # the last token is never fed
    batches = plan_batches(fed, max_tokens)
    for batch in batches:
        rows = alone[batch]
        for i, values in zip(rows, model.score_batch([chunk.row(i) for i in rows], temperature)):
            results[i] = values
        check_stop()  # a preempted run abandons this chunk; finished chunks are already on disk
    _count(stats, fed, batches)

    if shared.any():
        rows = np.flatnonzero(shared)
        groups, group_of_shared = np.unique(group_of_row[rows], return_inverse=True)
        prompts = [chunk.row(i)[0] for i in first_row[groups]]  # (groups,) one prompt each
        prompt_lengths = np.array([len(p) for p in prompts], dtype=np.int64)
        for batch in plan_shared(prompt_lengths, response_len[rows], group_of_shared, max_tokens):
            # score_shared indexes prompts and rows within the batch.
            local = np.empty(len(prompts), dtype=np.int64)
            local[batch.groups] = np.arange(len(batch.groups))
            where = np.empty(len(rows), dtype=np.int64)
            where[batch.rows] = np.arange(len(batch.rows))
            responses = [chunk.row(i)[1] for i in rows[batch.rows]]
            logprobs = model.score_shared([prompts[g] for g in batch.groups], responses,
                                          local[group_of_shared[batch.rows]], [where[p] for p in batch.passes],
                                          temperature)
            for i, values in zip(rows[batch.rows], logprobs):
                results[i] = values
            # A prefill of left-padded prompts, then passes of right-padded fed response tokens.
            _count(stats, prompt_lengths, [batch.groups])
            _count(stats, np.maximum(response_len[rows] - 1, 0), batch.passes)
            check_stop()
        # Every row after the first of its group continued the prompt instead of recomputing it.
        counts = np.bincount(group_of_shared)
        stats.prompt_tokens_reused += int(((counts - 1) * prompt_lengths).sum())
        stats.shared_rows += len(rows)
    return results


def _count(stats: ForwardStats, lengths: np.ndarray, batches: list[np.ndarray]) -> None:
    """Add what `batches` (indices into `lengths`) fed the model, padding excluded and included."""
    real, padded = padding_efficiency(lengths, batches)
    stats.fed_tokens += real
    stats.padded_tokens += padded
