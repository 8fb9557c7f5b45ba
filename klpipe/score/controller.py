"""The adaptive KL coefficient: penalties for rows or batches, and the rule that moves the coefficient.

The original controller is elizaOS's `KLController` (`kl_controller.py`): klpipe replays its behaviour exactly,
except where docs/controller.md says why it departs.

Three rules, chosen by `ControllerConfig.controller`:
    window        the original controller's rule: after each batch, once `window` per-row KLs are in the history,
                  their mean above 1.5×target multiplies the coefficient by `increase_factor`, below
                  0.5×target by `decrease_factor`.
    proportional  Ziegler et al. (as in TRL and verl): e = clip(batch_mean/target − 1, ±0.2),
                  coeff ×= 1 + e·rows/horizon.
    fixed         never moves (also what `adaptive=False` means, the original controller's switch).
Both adaptive rules clamp to [kl_coeff_min, kl_coeff_max] and count an adaptation when the value changed.
A coefficient of 0 (β = 0, TRL GRPO's default: KL monitored, not penalised) stays 0 under every
rule: they all multiply it, and no lower clamp lifts it. kl_coeff_min = 0 is no lower clamp.

Sequential exactness is the design constraint: the coefficient after N batches must not depend on
whether they were fed in one process or several joined by save_state/load_state. So the state keeps
the history the rules read, and means are taken with Python's `sum` in history order, exactly as
the original controller does, rather than with numpy's pairwise summation.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from klpipe.errors import InputError, StateError
from klpipe.options import option
from klpipe.score import kl as kl_math

ControllerKind = Literal["window", "proportional", "fixed"]
CONTROLLERS: tuple[str, ...] = ("window", "proportional", "fixed")

PANEL = "Controller"  # its options' panel in `klpipe score --help`

# Per-row KLs kept in memory and in saved state: get_stats reads the last 100 (the original controller's number),
# and the window rule needs at least `window` of them.
STATS_HISTORY = 100

# Identifies a saved state; bump the version when its meaning changes.
STATE_FORMAT = "klpipe-kl-state"
STATE_VERSION = 1

# Proportional rule: the per-batch error is clipped to this magnitude (TRL, verl).
PROPORTIONAL_ERROR_CLIP = 0.2


@dataclass
class ControllerConfig:
    """How the KL coefficient starts and moves. Defaults are the original controller's."""

    # A loaded state replaces the starting coefficient. 0: monitor KL, never penalise.
    kl_coeff: float = option(0.1, panel=PANEL, help="Starting coefficient (a loaded --state replaces it). 0: KL is "
                             "measured, not penalised.")
    kl_target: float = option(3.0, panel=PANEL, help="Target per-row KL in nats.")  # what the adaptive rules steer to
    # False keeps the coefficient fixed whatever `controller` says (the original controller's `adaptive`).
    adaptive: bool = option(True, flags=("--adaptive/--no-adaptive",), panel=PANEL,
                            help="--no-adaptive keeps the coefficient fixed, whichever --controller is set.")
    # The adaptive rules clamp the coefficient to [min, max]; min 0: no lower clamp.
    kl_coeff_min: float = option(0.01, panel=PANEL, help="Lower clamp; 0: none.")
    kl_coeff_max: float = option(1.0, panel=PANEL, help="Upper clamp.")
    # The original controller's adaptation_window.
    window: int = option(10, panel=PANEL, help="window rule: recent per-row KLs averaged before each update.")
    increase_factor: float = option(1.5, panel=PANEL,
                                    help="window rule: multiplier when the mean is above 1.5×target.")
    decrease_factor: float = option(0.8, panel=PANEL,
                                    help="window rule: multiplier when the mean is below 0.5×target.")
    controller: ControllerKind = option(
        "window", panel=PANEL, help="window: the mean of the last --window rows' KL against 0.5× and 1.5× the "
        "target; proportional: Ziegler et al. (TRL, verl); fixed.")
    # Proportional rule: rows over which a full error would act.
    horizon: int = option(10000, panel=PANEL,
                          help="proportional rule: coeff ×= 1 + clip(mean/target−1, ±0.2)·rows/horizon.")

    def __post_init__(self) -> None:
        if self.controller not in CONTROLLERS:
            raise InputError(f"unknown controller {self.controller!r}; choose one of {', '.join(CONTROLLERS)}")
        non_negative = ("kl_coeff", "kl_coeff_min")
        positive = ("kl_target", "kl_coeff_max", "increase_factor", "decrease_factor", "window", "horizon")
        for name in non_negative:
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise InputError(f"{name} must be a non-negative number, got {value!r}")
        for name in positive:
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise InputError(f"{name} must be a positive number, got {value!r}")
        if self.kl_coeff_min > self.kl_coeff_max:
            raise InputError(f"kl_coeff_min {self.kl_coeff_min} is above kl_coeff_max {self.kl_coeff_max}")

    @property
    def kind(self) -> ControllerKind:
        """The rule in force: `fixed` whenever adaptation is switched off."""
        return self.controller if self.adaptive else "fixed"


@dataclass
class KLStats:
    """Summary of a set of per-row KLs and the controller, under the original controller's logging keys."""

    mean_kl: float = 0.0
    max_kl: float = 0.0
    min_kl: float = 0.0
    std_kl: float = 0.0
    current_coeff: float = 0.1
    adaptation_count: int = 0
    samples_processed: int = 0

    def to_dict(self) -> dict[str, Any]:
        # The original controller's keys and 4-decimal rounding, so existing dashboards keep working.
        return {
            "kl/mean": round(self.mean_kl, 4),
            "kl/max": round(self.max_kl, 4),
            "kl/min": round(self.min_kl, 4),
            "kl/std": round(self.std_kl, 4),
            "kl/coeff": round(self.current_coeff, 4),
            "kl/adaptation_count": self.adaptation_count,
            "kl/samples_processed": self.samples_processed,
        }


class KLController:
    """Turns per-row KLs into penalties and adapts its coefficient; see the module docstring."""

    def __init__(self, config: ControllerConfig | None = None) -> None:
        self.config = config or ControllerConfig()
        self.kl_coeff = self.config.kl_coeff
        self.adaptation_count = 0
        self.samples_processed = 0
        self._history: deque[float] = deque(maxlen=self._history_kept)

    @property
    def _history_kept(self) -> int:
        return max(STATS_HISTORY, self.config.window)

    # -- penalties --------------------------------------------------------------------------------

    def penalise_sample(self, kl: float) -> float:
        """One row on its own, with the original controller's per-sample order: record, adapt, then penalise.

        The returned penalty uses the coefficient *after* this row's adaptation, as the original controller's
        `get_penalty_from_logprobs` does. Batch scoring uses `penalise_batch` instead.
        """
        self.observe_batch((kl,))
        return self.kl_coeff * kl

    def penalise_batch(self, kls: Sequence[float]) -> tuple[list[float], KLStats]:
        """Penalise every row with the coefficient in force before the batch, then adapt once."""
        kls = [float(kl) for kl in kls]
        coeff = self.kl_coeff
        penalties = [coeff * kl for kl in kls]
        self.observe_batch(kls)
        return penalties, self._stats(kls)

    def get_penalty_from_logprobs(
        self, policy_logprobs: Sequence[float], ref_logprobs: Sequence[float]
    ) -> tuple[float, float]:
        """(penalty, kl) for one response, per-sample order; the KL is the original controller's clamped mean k1."""
        kl = kl_math.sequence_kl(policy_logprobs, ref_logprobs)
        return self.penalise_sample(kl), kl

    def get_batch_penalty_from_logprobs(
        self,
        policy_logprobs_batch: Sequence[Sequence[float]],
        ref_logprobs_batch: Sequence[Sequence[float]],
    ) -> tuple[list[float], KLStats]:
        """(penalties, stats) for a batch of responses, batch order; KLs as in the original controller."""
        if len(policy_logprobs_batch) != len(ref_logprobs_batch):
            raise ValueError(f"{len(policy_logprobs_batch)} policy rows but {len(ref_logprobs_batch)} reference rows")
        kls = [kl_math.sequence_kl(p, r) for p, r in zip(policy_logprobs_batch, ref_logprobs_batch, strict=True)]
        return self.penalise_batch(kls)

    # -- adaptation -------------------------------------------------------------------------------

    def observe_batch(self, kls: Iterable[float]) -> None:
        """Record a batch's per-row KLs (already penalised) and adapt the coefficient once."""
        batch = kls if isinstance(kls, list | tuple) else list(kls)
        if not batch:
            return
        self._history.extend(batch)
        self.samples_processed += len(batch)
        if self.kl_coeff == 0:
            # β = 0 stays 0: every rule multiplies the coefficient, and a lower clamp would lift it
            # to kl_coeff_min, penalising KL the user chose only to monitor. (The original controller does lift it.)
            return
        kind = self.config.kind
        if kind == "window":
            proposed = self._window_rule()
        elif kind == "proportional":
            proposed = self._proportional_rule(batch)
        else:
            return
        if proposed is None:
            return
        clamped = max(self.config.kl_coeff_min, min(self.config.kl_coeff_max, proposed))
        if clamped != self.kl_coeff:
            self.adaptation_count += 1
        self.kl_coeff = clamped

    def _window_rule(self) -> float | None:
        window = self.config.window
        if len(self._history) < window:
            return None  # not enough evidence yet; the original controller does not even clamp here
        recent = list(itertools.islice(self._history, len(self._history) - window, None))
        recent_mean = sum(recent) / len(recent)
        target = self.config.kl_target
        if recent_mean > target * 1.5:
            return self.kl_coeff * self.config.increase_factor
        if recent_mean < target * 0.5:
            return self.kl_coeff * self.config.decrease_factor
        return self.kl_coeff

    def _proportional_rule(self, batch: Sequence[float]) -> float:
        batch_mean = sum(batch) / len(batch)
        error = batch_mean / self.config.kl_target - 1.0
        error = min(max(error, -PROPORTIONAL_ERROR_CLIP), PROPORTIONAL_ERROR_CLIP)
        return self.kl_coeff * (1.0 + error * len(batch) / self.config.horizon)

    # -- statistics and state ---------------------------------------------------------------------

    def get_stats(self) -> KLStats:
        """Statistics over the last 100 per-row KLs, with the current coefficient and counters."""
        recent = list(itertools.islice(self._history, max(0, len(self._history) - STATS_HISTORY), None))
        return self._stats(recent)

    def reset_history(self) -> None:
        """Forget the per-row KL history (e.g. at a checkpoint); coefficient and counters stay."""
        self._history.clear()

    def save_state(self) -> dict[str, Any]:
        """A JSON-able snapshot that continues this controller exactly, with the config it ran under."""
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "config": asdict(self.config),
            "kl_coeff": self.kl_coeff,
            "adaptation_count": self.adaptation_count,
            "samples_processed": self.samples_processed,
            "recent_history": list(self._history),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from `save_state` output (or a checkpoint of the original controller, which records no config).

        A state made under another rule or target would steer towards the wrong place, so it is
        refused; start a fresh controller instead.
        """
        if not isinstance(state, dict):
            raise StateError("controller state must be a JSON object")
        if state.get("format", STATE_FORMAT) != STATE_FORMAT or state.get("version", STATE_VERSION) != STATE_VERSION:
            raise StateError(f"unsupported state format {state.get('format')!r} version {state.get('version')!r}")
        recorded = state.get("config")
        if recorded is not None:
            self._check_same_goal(recorded)
        kl_coeff = _number(state, "kl_coeff", self.config.kl_coeff)
        if kl_coeff < 0:  # a negative coefficient would reward drifting from the reference
            raise StateError(f"state kl_coeff must be a non-negative number, got {kl_coeff!r}")
        adaptation_count = _count(state, "adaptation_count")
        samples_processed = _count(state, "samples_processed")
        history = state.get("recent_history", [])
        if not isinstance(history, list) or not all(_is_finite_number(v) for v in history):
            raise StateError("state recent_history must be a list of finite numbers")
        self.kl_coeff = kl_coeff
        self.adaptation_count = adaptation_count
        self.samples_processed = samples_processed
        self._history = deque((float(v) for v in history), maxlen=self._history_kept)

    def _check_same_goal(self, recorded: dict[str, Any]) -> None:
        try:
            made_with = ControllerConfig(
                **{f.name: recorded[f.name] for f in fields(ControllerConfig) if f.name in recorded}
            )
        except (TypeError, InputError) as exc:
            raise StateError(f"state records an invalid controller config ({exc})") from None
        if made_with.kind != self.config.kind or made_with.kl_target != self.config.kl_target:
            raise StateError(
                f"state was made with the {made_with.kind} controller and kl_target {made_with.kl_target}, "
                f"this run uses the {self.config.kind} controller and kl_target {self.config.kl_target}"
            )

    def config_differences(self, recorded: dict[str, Any]) -> list[str]:
        """Config fields, other than the starting coefficient, that differ from a state's record."""
        current = asdict(self.config)
        return [
            f"{name} {recorded[name]!r} → {current[name]!r}"
            for name in current
            if name != "kl_coeff" and name in recorded and recorded[name] != current[name]
        ]

    def _stats(self, kls: list[float]) -> KLStats:
        # Python arithmetic in row order, as the original controller computes its stats.
        if not kls:
            # The original controller drops the counters here; they stay meaningful, so klpipe keeps them.
            return KLStats(
                current_coeff=self.kl_coeff,
                adaptation_count=self.adaptation_count,
                samples_processed=self.samples_processed,
            )
        mean = sum(kls) / len(kls)
        std = (sum((k - mean) ** 2 for k in kls) / len(kls)) ** 0.5 if len(kls) > 1 else 0.0
        return KLStats(
            mean_kl=mean,
            max_kl=max(kls),
            min_kl=min(kls),
            std_kl=std,
            current_coeff=self.kl_coeff,
            adaptation_count=self.adaptation_count,
            samples_processed=self.samples_processed,
        )


def _is_finite_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _number(state: dict[str, Any], key: str, default: float) -> float:
    value = state.get(key, default)
    if not _is_finite_number(value):
        raise StateError(f"state {key} must be a finite number, got {value!r}")
    return float(value)


def _count(state: dict[str, Any], key: str) -> int:
    value = state.get(key, 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise StateError(f"state {key} must be a non-negative integer, got {value!r}")
    return value
