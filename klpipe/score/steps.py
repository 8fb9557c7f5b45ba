"""Controller batches: runs of consecutive rows with the same `step`, each penalised with the
coefficient in force when it began, the controller updated once it ends.

A step may span record batches and input files: its rows are penalised as they arrive, and only
its per-row KLs are held until it closes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from klpipe.arrow import from_numpy, numpy_view
from klpipe.score import report
from klpipe.score.controller import KLController


@dataclass
class _OpenStep:
    """The controller batch being read: its rows so far, all penalised with `kl_coeff`."""

    label: object
    kl_coeff: float
    kls: list[np.ndarray] = field(default_factory=list)
    rewards: list[np.ndarray] = field(default_factory=list)
    negative_k1: int = 0
    tokens: int = 0  # response tokens


class StepSection(Protocol):
    """Figures measured beside the KL per controller step (score/sampler.py's mismatch, score/exact.py's exact KL):
    each record batch is measured first, then its rows go to the step they belong to."""

    def open_step(self) -> None: ...

    def add_rows(self, start: int, stop: int) -> None: ...

    def close_step(self) -> dict[str, Any]: ...


class ControllerSteps:
    """Cuts the row stream into controller batches and hands each row its coefficient."""

    def __init__(self, controller: KLController, has_steps: bool, previous_last_step: object, warnings: list[str],
                 keep_rows: bool = False, sections: dict[str, StepSection] | None = None):
        self.controller = controller
        self.has_steps = has_steps
        self.previous_last_step = previous_last_step
        self.warnings = warnings
        self.kl_coeff_before = controller.kl_coeff  # at the start of the run
        self.open: _OpenStep | None = None
        self.steps: list[dict[str, Any]] = []  # report entries, one per step
        self.batch_count = 0
        self.last_label: object = None
        # Without steps each row is a batch, and these hold its values (8 bytes a row each): the
        # coefficients for the plot, and with `keep_rows` rewards and token counts for the metrics.
        self.per_row_coeffs: list[np.ndarray] = []
        self.keep_rows = keep_rows and not has_steps
        self.per_row_rewards: list[np.ndarray] = []
        self.per_row_tokens: list[np.ndarray] = []
        # By the key of the step entry that holds its figures: each step's rows go to it.
        self.sections = sections or {}

    def coefficients(
        self, steps: pa.Array | None, kl: np.ndarray, reward: np.ndarray, negative_k1: np.ndarray, tokens: np.ndarray
    ) -> np.ndarray:
        """The coefficient for each row of a record batch, closing the steps that end in it.

        `tokens` is each row's count of response tokens.
        """
        if not self.has_steps:
            if self.keep_rows:
                self.per_row_rewards.append(reward)
                self.per_row_tokens.append(tokens)
            return self._per_row(kl)
        assert steps is not None, "a run with steps reads their column"
        n = len(kl)
        coeffs = np.empty(n)
        if n == 0:
            return coeffs
        changes = pc.indices_nonzero(pc.not_equal(steps.slice(1), steps.slice(0, n - 1)))
        starts = np.concatenate(([0], numpy_view(changes).astype(np.int64) + 1))
        ends = np.append(starts[1:], n)
        labels = steps.take(from_numpy(starts)).to_pylist()
        for start, end, label in zip(starts.tolist(), ends.tolist(), labels, strict=True):
            step = self.open
            if step is None or label != step.label:
                self._close()
                step = self._open(label)
            step.kls.append(kl[start:end])
            step.rewards.append(reward[start:end])
            step.negative_k1 += int(np.count_nonzero(negative_k1[start:end]))
            step.tokens += int(np.sum(tokens[start:end]))
            for section in self.sections.values():
                section.add_rows(start, end)
            coeffs[start:end] = step.kl_coeff
        return coeffs

    def _per_row(self, kl: np.ndarray) -> np.ndarray:
        # Each row is its own batch: the coefficient can change after every row, so this is a
        # loop, but one of scalar updates; the KL math stays vectorised.
        coeffs = np.empty(len(kl))
        controller = self.controller
        for i, value in enumerate(kl.tolist()):
            coeffs[i] = controller.kl_coeff
            controller.observe_batch((value,))
        self.batch_count += len(kl)
        self.per_row_coeffs.append(coeffs)
        return coeffs

    def _open(self, label: object) -> _OpenStep:
        if not self.batch_count and self.previous_last_step is not None and label == self.previous_last_step:
            self.warnings.append(
                f"step {label!r} continues from the previous run recorded in the state file; it is scored "
                "as a new controller batch, so its coefficients differ from scoring both runs together"
            )
        self.open = _OpenStep(label=label, kl_coeff=self.controller.kl_coeff)
        for section in self.sections.values():
            section.open_step()
        self.batch_count += 1
        self.last_label = label
        return self.open

    def _close(self) -> None:
        step, self.open = self.open, None
        if step is None:
            return
        kls = np.concatenate(step.kls)
        self.controller.observe_batch(kls.tolist())
        rewards = np.concatenate(step.rewards)
        entry = report.step_entry(step.label, kls, rewards, step.kl_coeff, step.negative_k1, step.tokens,
                                  self.controller)
        for key, section in self.sections.items():
            entry[key] = section.close_step()
        self.steps.append(entry)

    def finish(self) -> None:
        self._close()
