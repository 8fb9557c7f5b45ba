"""Per-step metrics for dashboards: TensorBoard event files (`--tensorboard`) and JSON Lines (`--metrics-jsonl`).

One record per controller batch, written after the scored output is committed, from what the run
already holds: the report's per-step entries, or per-row arrays when each row is its own batch.
Only imported when one of the two options is given, so a plain `klpipe score` never loads
tensorboardX.

Reruns: the event file's name is fixed by the run's first step, so rerunning the same continuation
(a crash before the state file was saved) replaces the file instead of adding a second copy of its
points, and the names sort in run order, which is the order TensorBoard reads a directory's files.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import time
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from klpipe.errors import OutputError
from klpipe.storage.atomic import OutputGroup, scratch_directory
from klpipe.storage.store import Location

if TYPE_CHECKING:
    from klpipe.score.config import ScoreConfig
    from klpipe.score.report import RunTotals
    from klpipe.score.steps import ControllerSteps

# Event tags are PREFIX + name (the mismatch figures', which hold a "/", their own name); JSONL keys are the
# names, plus `step`.
PREFIX = "klpipe/"
METRICS = (
    "kl",  # mean per-row KL of the step, nats (TRL's name)
    "kl_coef",  # the coefficient applied to the step's rows: the one before its update
    "kl_coef_after",  # the coefficient after the step's update
    "reward_kl_penalty",  # verl's name for the mean KL
    "reward_kl_penalty_coeff",  # verl's name for the coefficient applied
    "reward",  # mean reward before the penalty
    "kl_penalty",  # mean penalty, kl_coef × per-row KL
    "adjusted_reward",  # mean reward after the penalty
    "kl_target",  # nats
    "kl_target_low",  # 0.5 × target: below it the window rule lowers the coefficient
    "kl_target_high",  # 1.5 × target: above it the window rule raises it
    "rows",
    "tokens",  # response tokens in the step
)

# Event files are named by the x value of the run's first step, zero-padded so names sort as numbers
# (20 digits hold any non-negative int64).
EVENT_FILE = "events.out.tfevents.{first_step:020d}.klpipe"

# tensorboardX writes into a scratch directory `.klpipe-tensorboard.<random>.tmp` inside DIR, the
# same filesystem, so the finished file is renamed into place; a killed run's is removed next time.
# (For a DIR on a store, in $TMPDIR, beside the file the upload is staged in.)
SCRATCH_NAME = "klpipe-tensorboard"

TENSORBOARD_EXTRA = "--tensorboard needs tensorboardX: pip install 'klpipe[tensorboard]'"


@dataclass
class StepMetrics:
    """A run's controller batches as columns, one entry per batch: what both files hold."""

    step: np.ndarray  # (batches,) int64 x axis: the step label, or the running batch counter
    kl: np.ndarray  # (batches,) mean per-row KL, nats
    kl_coef: np.ndarray  # (batches,) coefficient applied to the batch's rows
    kl_coef_after: np.ndarray  # (batches,) coefficient after the batch's update
    reward: np.ndarray  # (batches,) mean reward before the penalty
    kl_penalty: np.ndarray  # (batches,) mean penalty
    adjusted_reward: np.ndarray  # (batches,) mean reward after the penalty
    rows: np.ndarray  # (batches,) int64
    tokens: np.ndarray  # (batches,) int64 response tokens
    kl_target: float  # nats, the same for every batch
    # Per batch, the sampler-against-trainer figures (score/mismatch.py) under their own names, verl's
    # `rollout_corr/…` and klpipe's `mismatch/…`: written unprefixed, so dashboards line up with verl's.
    mismatch: list[dict[str, Any]] | None = None
    # Per batch, with the exact KL's columns, score/exact.py's FIGURES (`exact_kl`, `k1_spread`, ...), prefixed.
    exact: list[dict[str, Any]] | None = None

    def records(self) -> Iterator[dict[str, Any]]:
        """One dict per batch: `step`, then every name in METRICS, as Python numbers."""
        target = self.kl_target
        columns = (self.step, self.kl, self.kl_coef, self.kl_coef_after, self.reward, self.kl_penalty,
                   self.adjusted_reward, self.rows, self.tokens)
        none: list[dict[str, Any]] = [{}] * len(self.step)
        extras = [a | b for a, b in zip(self.mismatch or none, self.exact or none, strict=True)]
        for (step, kl, coef, after, reward, penalty, adjusted, rows, tokens), extra in zip(
            zip(*(c.tolist() for c in columns), strict=True), extras, strict=True
        ):
            yield extra | {
                "step": step, "kl": kl, "kl_coef": coef, "kl_coef_after": after,
                "reward_kl_penalty": kl, "reward_kl_penalty_coeff": coef,
                "reward": reward, "kl_penalty": penalty, "adjusted_reward": adjusted,
                "kl_target": target, "kl_target_low": 0.5 * target, "kl_target_high": 1.5 * target,
                "rows": rows, "tokens": tokens,
            }  # fmt: skip


def from_steps(entries: list[dict[str, Any]], kl_target: float, first_batch: int | None) -> StepMetrics:
    """From the report's per-step entries (report.step_entry).

    The x axis is each step's label when `first_batch` is None (an integer step column), else a
    batch counter starting at `first_batch`.
    """
    def column(key: str, dtype: type[np.generic] = np.float64) -> np.ndarray:
        return np.array([entry[key] for entry in entries], dtype=dtype)

    if first_batch is None:
        step = column("step", np.int64)
    else:
        step = first_batch + np.arange(len(entries), dtype=np.int64)
    return StepMetrics(
        step=step, kl=column("kl_mean"), kl_coef=column("kl_coeff_before"), kl_coef_after=column("kl_coeff_after"),
        reward=column("reward_mean_before"), kl_penalty=column("kl_penalty_mean"),
        adjusted_reward=column("reward_mean_after"), rows=column("rows", np.int64),
        tokens=column("tokens", np.int64), kl_target=kl_target,
        mismatch=_section(entries, "mismatch"), exact=_section(entries, "exact"),
    )  # fmt: skip


def _section(entries: list[dict[str, Any]], key: str) -> list[dict[str, Any]] | None:
    """Each step's figures of the section under `key` (score/steps.py), None when the run has no such section."""
    return [_numbers(entry[key]) for entry in entries] if entries and key in entries[0] else None


def _numbers(figures: dict[str, Any]) -> dict[str, Any]:
    """The numeric figures of a step's section entry (a quantile of no tokens is None: left out)."""
    return {name: value for name, value in figures.items() if isinstance(value, int | float)}


def from_rows(kls: np.ndarray, coeffs: np.ndarray, final_coeff: float, rewards: np.ndarray, tokens: np.ndarray,
              kl_target: float, first_batch: int) -> StepMetrics:
    """From per-row arrays (rows,) when each row is its own controller batch; x counts batches from `first_batch`.

    `final_coeff` is the controller's coefficient after the last row.
    """
    n = len(kls)
    # Batches are consecutive rows: a row's coefficient after its update is the next row's before.
    after = np.append(coeffs[1:], final_coeff) if n else coeffs
    penalty = coeffs * kls  # the output column's arithmetic
    return StepMetrics(
        step=first_batch + np.arange(n, dtype=np.int64), kl=kls, kl_coef=coeffs, kl_coef_after=after,
        reward=rewards, kl_penalty=penalty, adjusted_reward=rewards - penalty, rows=np.ones(n, dtype=np.int64),
        tokens=tokens.astype(np.int64), kl_target=kl_target,
    )  # fmt: skip


def write_run(outputs: OutputGroup, config: ScoreConfig, batches: ControllerSteps, totals: RunTotals,
              batches_before: int, integer_steps: bool) -> None:
    """A run's metrics files, as `config` asks. The x axis is the step label of an integer step column, else a
    count of controller batches that continues from `batches_before`, the count of earlier runs on the same state."""
    target = config.controller.kl_target
    if batches.has_steps:
        step_metrics = from_steps(batches.steps, target, None if integer_steps else batches_before)
    else:
        def joined(parts: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(parts) if parts else np.zeros(0)

        step_metrics = from_rows(
            totals.all_kls(), joined(batches.per_row_coeffs), batches.controller.kl_coeff,
            joined(batches.per_row_rewards), joined(batches.per_row_tokens), target, first_batch=batches_before,
        )  # fmt: skip
    if config.tensorboard is not None:
        write_tensorboard(outputs, config.tensorboard, step_metrics)
    if config.metrics_jsonl is not None:
        write_jsonl(outputs, config.metrics_jsonl, step_metrics)


# -- JSON Lines ---------------------------------------------------------------------------------------


def write_jsonl(outputs: OutputGroup, path: Location, metrics: StepMetrics) -> None:
    """This run's records, one JSON object a line, at full precision; the file appears with the run's others."""
    with outputs.file(path) as tmp, open(tmp, "w") as out:
        out.writelines(json.dumps(record) + "\n" for record in metrics.records())


# -- TensorBoard --------------------------------------------------------------------------------------


class _HideTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if name.split(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def _import_tensorboardx() -> None:
    # tensorboardX's writer imports torch whenever it can, only to accept tensors. klpipe hands it
    # floats, and `klpipe score` stays torch-free: torch would cost seconds of start-up on a GPU host.
    if "torch" in sys.modules:
        importlib.import_module("tensorboardX")
        return
    hide = _HideTorch()
    sys.meta_path.insert(0, hide)
    try:
        importlib.import_module("tensorboardX")
    finally:
        sys.meta_path.remove(hide)


def require_tensorboardx(directory: Location) -> None:
    """Checked before the run, so a missing extra or a file named DIR does not cost an hour of scoring."""
    try:
        _import_tensorboardx()
    except ImportError as exc:
        # A broken install (say, a protobuf it cannot use) is not mended by the pip line alone: name it.
        broken = "" if exc.name == "tensorboardX" else f" ({exc})"
        raise OutputError(f"{directory}: {TENSORBOARD_EXTRA}{broken}") from None
    if directory.exists() and not directory.is_dir():
        raise OutputError(f"{directory}: --tensorboard needs a directory, and this is a file")


def event_file_name(first_step: int) -> str:
    return EVENT_FILE.format(first_step=first_step)


def write_tensorboard(outputs: OutputGroup, directory: Location, metrics: StepMetrics) -> Location | None:
    """One scalar per metric per step into DIR/events.out.tfevents.<first step>.klpipe; None when there were no steps.

    TensorBoard stores scalars as float32; the JSONL and the report keep float64.
    """
    if not len(metrics.step):
        return None
    _import_tensorboardx()
    # EventsWriter is the synchronous core of tensorboardX's FileWriter, whose queue and flush
    # thread serve training loops; here every record is in memory already.
    from tensorboardX.event_file_writer import EventsWriter
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.proto.summary_pb2 import Summary

    path = directory / event_file_name(int(metrics.step[0]))
    wall_time = time.time()  # one for the whole run: its steps are written together
    try:
        with scratch_directory(directory, SCRATCH_NAME) as scratch:
            writer = EventsWriter(str(scratch / "events"))  # names its file events.out.tfevents.<time>.<host>
            try:
                for record in metrics.records():
                    step = record.pop("step")
                    values = [Summary.Value(tag=name if "/" in name else PREFIX + name, simple_value=value)
                              for name, value in record.items()]
                    writer.write_event(Event(wall_time=wall_time, step=step, summary=Summary(value=values)))
            finally:
                writer.close()
            (written,) = scratch.iterdir()
            with outputs.file(path) as tmp:  # appears with the run's other outputs
                os.replace(written, tmp)
    except OSError as exc:
        raise OutputError(f"{path}: write failed ({exc.strerror or exc})") from None
    return path
