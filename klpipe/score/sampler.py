"""The sampler-against-trainer section of a scoring run: mismatch.py's figures, corrections.py's sweep and
diagnosis.py's codes, fed from the row stream, per controller step and for the whole run.

Runs when a cache holds the sampler's logprobs (sampler_logprobs) beside the trainer's (policy_logprobs).
Each record batch is measured once, vectorised (`measure`); its rows then go to the step they belong to
(`add_rows`), and a closed step's sums join the run's. Without a step column the whole batch goes to the
run at once and there are no per-step figures.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from klpipe.arrow import from_numpy, list_array, list_values
from klpipe.mask import kept_offsets
from klpipe.score.corrections import CorrectionSums
from klpipe.score.diagnosis import DiagnosisSums, screen
from klpipe.score.input import Logprobs
from klpipe.score.kl import Estimator
from klpipe.score.mismatch import POSITION_EDGES, MismatchSums, RowMismatch, TokenMismatch, dot, per_row

# Columns the scored file gains with a sampler column.
MISMATCH_KL = "mismatch_kl"  # mean −ℓ over the row's usable sampled tokens
LOG_PPL_DIFF = "log_ppl_diff"  # log(training ppl) − log(rollout ppl) of the row
SEQUENCE_WEIGHT = "sequence_weight"  # exp(clip(Σℓ, ±20))
GEOMETRIC_WEIGHT = "geometric_weight"  # exp(mean ℓ)
LOG_RATIO_PER_TOKEN = "log_ratio_per_token"  # with --per-token: ℓ_t, null where not counted
ROW_COLUMNS = (MISMATCH_KL, LOG_PPL_DIFF, SEQUENCE_WEIGHT, GEOMETRIC_WEIGHT)
COLUMNS = ROW_COLUMNS + (LOG_RATIO_PER_TOKEN,)

WEIGHTING = {
    "rollout_corr/kl": "token", "rollout_corr/k3_kl": "token", "rollout_corr/chi2_token": "token",
    "rollout_corr/training_ppl": "row", "rollout_corr/rollout_ppl": "row", "rollout_corr/log_ppl_diff": "row",
    "rollout_corr/ppl_ratio": "row", "rollout_corr/chi2_seq": "row", "mismatch/kl_trainer": "token",
    "mismatch/kl_sampler": "token", "mismatch/kl_importance_corrected": "token", "mismatch/ess_token_is": "token",
    "mismatch/ess_sequence_is": "row", "mismatch/ess_geometric": "row", "mismatch/log_ratio_*": "token",
    "mismatch/abs_log_ratio_*": "token",
}  # fmt: skip


def output_fields(per_token: bool) -> list[pa.Field]:
    fields = [pa.field(name, pa.float64()) for name in ROW_COLUMNS]
    if per_token:
        fields.append(pa.field(LOG_RATIO_PER_TOKEN, pa.list_(pa.float64())))
    return fields


def positions(logprobs: Logprobs) -> tuple[np.ndarray, np.ndarray | None]:
    """(scored tokens,) each: the bucket of the token's index in its response (mismatch.POSITION_EDGES, int8), and
    the tokens since the last mask-0 token of its row (int64, −1 when none comes before it; None without a mask)."""
    keep, offsets = logprobs.keep, logprobs.offsets
    if keep is not None:
        assert logprobs.response_offsets is not None  # read with the mask
        offsets = logprobs.response_offsets
    lengths = np.diff(offsets)
    # A row's tokens fill the buckets in order, so each (row, bucket) is one run: its length is how much of
    # [edge_b, edge_b+1) the row reaches. One np.repeat writes every token's bucket, with no per-token arithmetic.
    edges = np.array((0, *POSITION_EDGES, np.iinfo(np.int64).max))
    runs = np.clip(np.minimum(lengths[:, None], edges[None, 1:]) - edges[None, :-1], 0, None)  # (rows, buckets)
    bucket = np.repeat(np.tile(np.arange(len(POSITION_EDGES) + 1, dtype=np.int8), len(lengths)), runs.ravel())
    if keep is None:
        return bucket, None
    index = np.arange(int(offsets[-1]), dtype=np.int64)
    # The last mask-0 index at or before each token, within its row: a running maximum seeded with
    # start − 1 at each row's start, which no earlier row's index can exceed.
    last_zero = np.where(keep, -1, index)
    starts = offsets[:-1][lengths > 0]
    last_zero[starts] = np.maximum(last_zero[starts], starts - 1)
    np.maximum.accumulate(last_zero, out=last_zero)
    row_start = np.repeat(offsets[:-1], lengths)
    after = np.where(last_zero >= row_start, index - last_zero - 1, -1)
    return bucket[keep], after[keep]


def group_keys(batch: pa.RecordBatch, names: list[str]) -> np.ndarray | None:
    """(rows,) uint64 hash of each row's prompt (the first of `names` the batch has: token ids or text); None
    when it has none. Rows of one step with the same key are a GRPO group."""
    for name in names:
        if name not in batch.schema.names:
            continue
        array = batch.column(name)
        if isinstance(array, pa.ChunkedArray):
            array = array.combine_chunks()
        kind = array.type
        if (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and pa.types.is_integer(kind.value_type):
            values, offsets = list_values(array.fill_null([]) if array.null_count else array)
            return _polynomial_hash(values.astype(np.uint64), offsets)
        if pa.types.is_string(kind) or pa.types.is_large_string(kind):
            array = array.fill_null("") if array.null_count else array
            wide = np.int64 if pa.types.is_large_string(kind) else np.int32
            offsets = np.frombuffer(array.buffers()[1], wide, len(array) + 1, array.offset * np.dtype(wide).itemsize)
            data = array.buffers()[2]
            raw = np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8)
            start, end = int(offsets[0]), int(offsets[-1])
            return _polynomial_hash(raw[start:end].astype(np.uint64), offsets.astype(np.int64) - start)
    return None


def _polynomial_hash(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Σ_j (v_j + 1)·P^j mod 2⁶⁴ per row, with the length mixed in: equal prompts, equal keys."""
    lengths = np.diff(offsets)
    longest = int(lengths.max()) if len(lengths) else 0
    powers = np.cumprod(np.full(max(longest, 1), 1_000_003, np.uint64), dtype=np.uint64)  # wraps mod 2⁶⁴
    position = np.arange(len(values), dtype=np.int64) - np.repeat(offsets[:-1], lengths)
    terms = (values + np.uint64(1)) * powers[position]
    keys = np.zeros(len(lengths), np.uint64)
    nonempty = lengths > 0
    if len(terms):
        keys[nonempty] = np.add.reduceat(terms, offsets[:-1][nonempty])
    mixed: np.ndarray = keys ^ (lengths.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    return mixed


class SamplerRun:
    """The mismatch sums of one scoring run."""

    def __init__(self, estimator: Estimator, has_steps: bool):
        # The mismatch's KL figures compare the two sides' sampled tokens; the exact KL has no sampler's side
        # (it is the trainer's distribution against the reference's), so under `full` they are k1's.
        self.estimator: Estimator = "k1" if estimator == "full" else estimator
        self.has_steps = has_steps
        self.run = MismatchSums()
        self.corrections = CorrectionSums()
        self.diagnosis = DiagnosisSums()
        self.step: MismatchSums | None = None
        self.step_corrections: CorrectionSums | None = None
        self._batch: tuple[TokenMismatch, RowMismatch, np.ndarray | None] | None = None

    def measure(self, logprobs: Logprobs, row_name: Callable[[int], str],
                keys: np.ndarray | None) -> tuple[RowMismatch, np.ndarray]:
        """Measure a record batch: its per-row values, and (scored tokens,) bool where ℓ is counted."""
        trainer, sampler, rows_ok = _sampled(logprobs)
        found = screen(trainer, sampler, logprobs.offsets, rows_ok)
        self.diagnosis.add_screen(found, logprobs.offsets, row_name)
        usable = found.usable
        position_bucket, after_tool = positions(logprobs)
        everything = bool(usable.all())

        def pick(values: np.ndarray) -> np.ndarray:
            return values if everything else values[usable]

        tokens = TokenMismatch(
            trainer=pick(trainer), sampler=pick(sampler), ref=pick(logprobs.ref),
            offsets=logprobs.offsets if everything else kept_offsets(usable, logprobs.offsets),
            position_bucket=pick(position_bucket), after_tool=None if after_tool is None else pick(after_tool),
        )  # fmt: skip
        rows = per_row(tokens)
        self.diagnosis.add_tokens(tokens, dot(rows.mean_trainer, rows.tokens))
        if self.has_steps:
            self._batch = (tokens, rows, keys)
        else:
            self.corrections.add(tokens, rows, keys, *self.run.add(tokens, rows, self.estimator))
        return rows, usable

    def open_step(self) -> None:
        self.step, self.step_corrections = MismatchSums(), CorrectionSums()

    def _open(self) -> tuple[MismatchSums, CorrectionSums]:
        assert self.step is not None and self.step_corrections is not None, "no step is open"
        return self.step, self.step_corrections

    def add_rows(self, start: int, stop: int) -> None:
        """Rows start..stop of the batch last measured belong to the open step."""
        assert self._batch is not None, "no batch measured"
        tokens, rows, keys = self._batch
        step, step_corrections = self._open()
        part = tokens.rows(start, stop)
        part_rows = rows.rows(start, stop)
        sums = step.add(part, part_rows, self.estimator)
        step_corrections.add(part, part_rows, None if keys is None else keys[start:stop], *sums)

    def close_step(self) -> dict[str, Any]:
        """The closed step's figures; its sums join the run's (groups are a step's rows with one prompt)."""
        step, step_corrections = self._open()
        figures = step.figures()
        step_corrections.close_groups()
        self.run.merge(step)
        self.corrections.merge(step_corrections)
        self.step = self.step_corrections = None
        return figures

    def section(self, sampler_name: str, trainer_name: str, kl_from: str, computed_by: str | None) -> dict[str, Any]:
        """The report's `mismatch` section."""
        findings = self.diagnosis.findings(sampler_name, self.run.histogram)
        return {
            "sampler_logprobs": sampler_name,
            "trainer_logprobs": trainer_name,
            "trainer_computed_by": computed_by,
            "kl_from": kl_from,
            "counted": "sampled (mask-1) tokens whose sampler logprob is usable; token-weighted figures average "
                       "over those tokens, row-weighted ones over the rows that hold at least one",
            "weighting": WEIGHTING,
            "run": self.run.figures(),
            "breakdowns": self.run.breakdown_tables(),
            "corrections": self.corrections.table(self.run),
            "groups": self.corrections.groups,  # GRPO groups: rows of one step with one prompt (None: no prompt)
            "mismatch/diagnosis": [f["code"] for f in findings],
            "findings": findings,
            "excluded": {"nonfinite_tokens": self.diagnosis.nonfinite, "placeholder_tokens": self.diagnosis.placeholder,
                         "rows_of_another_length": self.diagnosis.length_rows},
        }


def row_columns(rows: RowMismatch, per_token: bool, logprobs: Logprobs, usable: np.ndarray) -> list[pa.Array]:
    """The scored file's per-row mismatch columns (null for a row without a usable token), and with
    `per_token` ℓ_t aligned with the response (null where not counted)."""
    has = rows.has_tokens
    columns = [from_numpy(values, has) for values in
               (rows.mismatch_kl, rows.log_ppl_diff, rows.sequence_weight, rows.geometric_weight)]
    if per_token:
        trainer, sampler, _ = _sampled(logprobs)
        ratio = (trainer - sampler).astype(np.float64)
        valid = usable
        keep = logprobs.keep
        if keep is None:
            columns.append(list_array(logprobs.offsets, np.where(valid, ratio, 0.0), valid=valid))
        else:
            assert logprobs.response_offsets is not None  # read with the mask
            values = np.zeros(len(keep))
            full_valid = np.zeros(len(keep), bool)
            values[keep] = np.where(valid, ratio, 0.0)
            full_valid[keep] = valid
            columns.append(list_array(logprobs.response_offsets, values, valid=full_valid))
    return columns


def _sampled(logprobs: Logprobs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(trainer, sampler, sampler_rows_ok): what a batch read with a sampler_logprobs column holds."""
    trainer, sampler, rows_ok = logprobs.trainer, logprobs.sampler, logprobs.sampler_rows_ok
    assert trainer is not None and sampler is not None and rows_ok is not None, "no sampler_logprobs column"
    return trainer, sampler, rows_ok

