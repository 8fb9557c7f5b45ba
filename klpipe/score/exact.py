"""The exact KL beside the sampled estimators, per controller step and for the whole run.

`klpipe precompute --policy` can write, per response token, the exact KL(π ‖ π_ref) over the whole vocabulary
and its companions (cache.FULL_KL_COLUMNS). Where a cache holds them, `klpipe score` reads them on every
sampled (mask-1) token and reports, whatever `--estimator` is:

    exact_kl              mean KL(π ‖ π_ref)                     the penalty's divergence, exactly
    exact_kl_ref_policy   mean KL(π_ref ‖ π)                     the other direction
    k1_kl, k3_kl          mean k1 and k3 of the sampled tokens   what a sampled estimator makes of it
    k1_spread, k3_spread  population std of (k_t − KL_t)         each estimator's noise around the exact value
    policy_entropy        mean H(π)                              entropy collapse shows here first
    ref_entropy           mean H(π_ref)

Every figure is token-weighted: a mean over the sampled tokens of the step (or the run). k1 and k3 are
unbiased, so k1_kl and k3_kl sit within about spread / √tokens of exact_kl. `--estimator full` makes the
exact values the per-row KL itself (score/kl.py). Numpy only, one pass per quantity, no loop over rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from klpipe.arrow import first_null, is_list_type, list_values, numpy_valid
from klpipe.cache import (
    FULL_KL_COLUMNS,
    KL_POLICY_REF,
    KL_REF_POLICY,
    POLICY_ENTROPY,
    REF_ENTROPY,
    read_provenance,
)
from klpipe.errors import InputError
from klpipe.rows import RowLocator
from klpipe.score.input import Logprobs
from klpipe.score.mismatch import dot
from klpipe.storage.store import Location

FIGURES = ("exact_kl", "exact_kl_ref_policy", "k1_kl", "k3_kl", "k1_spread", "k3_spread", "policy_entropy",
           "ref_entropy")
PRECOMPUTE = "`klpipe precompute --policy MODEL` computes it"


def exact_source(files: list[Location], schema: pa.Schema, estimator: str) -> tuple[bool, str | None]:
    """Whether the caches hold the exact KL's columns as precompute wrote them, and a warning when some such
    column is there but is not read. `--estimator full` without them is refused."""
    missing = [name for name in FULL_KL_COLUMNS if name not in schema.names]
    # A rollouts' own column of one of these names passes through precompute untouched: the provenance says
    # whether precompute computed it (a file klpipe did not write can only be taken at its word).
    disowned = [path for path in files if (made := read_provenance(path)) is not None and not made.full_kl]
    if estimator == "full" and (missing or disowned):
        path, why = ((files[0], f"has no {' or '.join(missing)} column") if missing else
                     (disowned[0], "was made without it (its provenance says full_kl false)"))
        raise InputError(f"{path}: --estimator full reads the exact per-token KL ({KL_POLICY_REF}), and this cache "
                         f"{why}; {PRECOMPUTE}")
    present = [name for name in FULL_KL_COLUMNS if name in schema.names]
    if not present:
        return False, None
    if disowned:
        return False, (f"{disowned[0]}: holds {', '.join(present)} but its provenance says klpipe precompute did not "
                       "compute the exact KL (full_kl false): those columns are passed through, not read")
    if missing:
        return False, (f"the caches hold {', '.join(present)} but no {', '.join(missing)}: the exact KL's columns "
                       "come together from klpipe precompute --policy, and none is read")
    for name in FULL_KL_COLUMNS:
        kind = schema.field(name).type
        if not (is_list_type(kind) and pa.types.is_floating(kind.value_type)):
            raise InputError(f"{files[0]}: {name} must be a list of floats, got {kind}")
    return True, None


@dataclass
class ExactTokens:
    """A block of rows' scored (mask-1) tokens: the exact values as stored, and the logprobs k1 and k3 read."""

    kl: np.ndarray  # (tokens,) KL(π ‖ π_ref)
    kl_reverse: np.ndarray  # (tokens,) KL(π_ref ‖ π)
    policy_entropy: np.ndarray  # (tokens,) H(π)
    ref_entropy: np.ndarray  # (tokens,) H(π_ref)
    policy: np.ndarray  # (tokens,) log π of the sampled token: the trainer's where the cache has both sides
    ref: np.ndarray  # (tokens,) log π_ref of it
    offsets: np.ndarray  # (rows + 1,) zero-based row offsets

    def rows(self, start: int, stop: int) -> ExactTokens:
        """Rows start..stop as views, their offsets rebased."""
        lo, hi = int(self.offsets[start]), int(self.offsets[stop])
        values = {name: getattr(self, name)[lo:hi] for name in self.__dataclass_fields__ if name != "offsets"}
        return ExactTokens(**values, offsets=self.offsets[start:stop + 1] - lo)


def read_exact(batch: pa.RecordBatch, logprobs: Logprobs, rows: RowLocator, policy_name: str) -> ExactTokens:
    """The batch's exact values on the tokens `logprobs` scores; a list of another length than the response, or a
    null, NaN, ±inf or negative value on a scored token, is refused naming the row."""
    offsets = logprobs.offsets
    if logprobs.keep is not None:
        assert logprobs.response_offsets is not None  # read with the mask
        offsets = logprobs.response_offsets
    kl, kl_reverse, policy_entropy, ref_entropy = (_column(batch.column(name), name, offsets, logprobs.keep, rows,
                                                           policy_name) for name in FULL_KL_COLUMNS)
    trainer = logprobs.trainer if logprobs.trainer is not None else logprobs.policy
    return ExactTokens(kl, kl_reverse, policy_entropy, ref_entropy, policy=trainer, ref=logprobs.ref,
                       offsets=logprobs.offsets)


def _column(array: pa.Array | pa.ChunkedArray, name: str, offsets: np.ndarray, keep: np.ndarray | None,
            rows: RowLocator, policy_name: str) -> np.ndarray:
    """(scored tokens,) one exact column's values as stored, checked."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    i = first_null(array)
    if i is not None:
        raise InputError(f"{rows.name(i)}: {name} is null")
    values, own = list_values(array)
    if not np.array_equal(own, offsets):
        i = int(np.flatnonzero(np.diff(own) != np.diff(offsets))[0])
        raise InputError(f"{rows.name(i)}: {name} has {own[i + 1] - own[i]} tokens but {policy_name} has "
                         f"{offsets[i + 1] - offsets[i]}; both must cover the same response tokens")
    flat = array.values.slice(int(array.offsets[0].as_py()), len(values))
    counted = np.ones(len(values), bool) if keep is None else keep
    where = " where the mask is 1" if keep is not None else ""
    bad = counted & ~numpy_valid(flat) if flat.null_count else None
    if bad is not None and bad.any():
        raise InputError(f"{_row(rows, offsets, bad)}: {name} holds a null{where}")
    picked = values if keep is None else values[keep]
    if not np.isfinite(picked).all() or (picked < 0).any():
        wrong = np.zeros(len(values), bool)
        wrong[counted] = ~np.isfinite(picked) | (picked < 0)
        value = float(values[np.flatnonzero(wrong)[0]])
        said = "NaN" if math.isnan(value) else f"{value:g}"
        raise InputError(f"{_row(rows, offsets, wrong)}: {name} holds {said}{where}; a KL or an entropy is a finite "
                         "number ≥ 0")
    return picked


def _row(rows: RowLocator, offsets: np.ndarray, token_flags: np.ndarray) -> str:
    return rows.name(int(np.searchsorted(offsets, np.flatnonzero(token_flags)[0], side="right") - 1))


@dataclass
class Spread:
    """Count, mean and sum of squared deviations of a stream of values, merged block by block (Chan et al.), so a
    long run's standard deviation loses no digits to cancellation."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, values: np.ndarray) -> None:
        if len(values):
            mean = float(np.mean(values))
            with np.errstate(invalid="ignore"):  # an overflowed k3 (inf) makes the spread NaN: reported as None
                centred = values - mean
            self.merge(Spread(len(values), mean, dot(centred, centred)))

    def merge(self, other: Spread) -> None:
        if not other.n:
            return
        n = self.n + other.n
        with np.errstate(invalid="ignore"):
            delta = other.mean - self.mean
            self.mean += delta * other.n / n
            self.m2 += other.m2 + delta * delta * self.n * other.n / n
        self.n = n

    @property
    def std(self) -> float | None:
        """The population standard deviation (as the report's kl/std), None without values or when not finite."""
        return _finite(math.sqrt(self.m2 / self.n)) if self.n and self.m2 >= 0 else None


@dataclass
class ExactSums:
    """Running sums over a step or a run: every figure is read from these."""

    tokens: int = 0
    kl: float = 0.0  # Σ KL(π ‖ π_ref)
    kl_reverse: float = 0.0
    policy_entropy: float = 0.0
    ref_entropy: float = 0.0
    k1: float = 0.0  # Σ k1 of the sampled tokens
    k3: float = 0.0
    k1_gap: Spread = field(default_factory=Spread)  # of k1_t − KL_t
    k3_gap: Spread = field(default_factory=Spread)

    def add(self, tokens: ExactTokens) -> None:
        self.tokens += len(tokens.kl)
        for name in ("kl", "kl_reverse", "policy_entropy", "ref_entropy"):
            setattr(self, name, getattr(self, name) + float(np.sum(getattr(tokens, name), dtype=np.float64)))
        k1 = np.subtract(tokens.policy, tokens.ref, dtype=np.float64)  # (tokens,)
        with np.errstate(over="ignore"):  # a gap below −709 nats overflows k3 to inf: its figures become None
            k3 = np.expm1(-k1)
        k3 += k1
        self.k1 += float(np.sum(k1))
        self.k3 += float(np.sum(k3))
        exact = tokens.kl.astype(np.float64)
        k1 -= exact
        with np.errstate(invalid="ignore"):
            k3 -= exact
        self.k1_gap.add(k1)
        self.k3_gap.add(k3)

    def merge(self, other: ExactSums) -> None:
        for name in ("tokens", "kl", "kl_reverse", "policy_entropy", "ref_entropy", "k1", "k3"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.k1_gap.merge(other.k1_gap)
        self.k3_gap.merge(other.k3_gap)

    def figures(self) -> dict[str, Any]:
        """FIGURES, token-weighted; None where no token was counted (or k3 overflowed)."""
        n = self.tokens

        def mean(total: float) -> float | None:
            return _finite(total / n) if n else None

        return {"exact_kl": mean(self.kl), "exact_kl_ref_policy": mean(self.kl_reverse), "k1_kl": mean(self.k1),
                "k3_kl": mean(self.k3), "k1_spread": self.k1_gap.std, "k3_spread": self.k3_gap.std,
                "policy_entropy": mean(self.policy_entropy), "ref_entropy": mean(self.ref_entropy)}


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


class ExactRun:
    """The exact-KL sums of one scoring run, fed as score/sampler.py's SamplerRun is: each record batch measured
    once, its rows then handed to their controller step; without a step column, to the run at once."""

    def __init__(self, has_steps: bool):
        self.has_steps = has_steps
        self.run = ExactSums()
        self.step: ExactSums | None = None
        self._batch: ExactTokens | None = None

    def measure(self, tokens: ExactTokens) -> None:
        if self.has_steps:
            self._batch = tokens
        else:
            self.run.add(tokens)

    def open_step(self) -> None:
        self.step = ExactSums()

    def _open(self) -> ExactSums:
        assert self.step is not None, "no step is open"
        return self.step

    def add_rows(self, start: int, stop: int) -> None:
        """Rows start..stop of the batch last measured belong to the open step."""
        assert self._batch is not None, "no batch measured"
        self._open().add(self._batch.rows(start, stop))

    def close_step(self) -> dict[str, Any]:
        step = self._open()
        figures = step.figures()
        self.run.merge(step)
        self.step = None
        return figures

    def section(self, policy_name: str) -> dict[str, Any]:
        """The report's `exact` section."""
        return {
            "columns": {"kl": KL_POLICY_REF, "kl_ref_policy": KL_REF_POLICY, "policy_entropy": POLICY_ENTROPY,
                        "ref_entropy": REF_ENTROPY},
            "sampled_logprobs": policy_name,  # the policy's logprobs k1 and k3 are read from (against ref_logprobs)
            "counted": "sampled (mask-1) tokens; every figure is a mean over them (token-weighted), and each spread "
                       "the population standard deviation over them of k_t − KL_t",
            "run": self.run.figures() | {"tokens": self.run.tokens},
        }
