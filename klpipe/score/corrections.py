"""What each rollout correction would have done to a run, from the cache alone: the sweep table.

Every trainer corrects the sampler–trainer mismatch inside its step and logs a batch mean; here each
scheme runs over the whole run's tokens at a grid of thresholds that holds each peer's default:

    token_tis     token  w_t = min(r_t, C)                         verl C = 2, TRL C = 3
    sequence_is   row    W = min(exp Σℓ, C)                         verl's sequence-level truncation
    geometric_is  row    W = min(exp mean ℓ, C)
    icepop        token  w_t = r_t, or 0 outside [lo, hi]           IcePop 0.5–5 (slime's MIS, OpenRLHF)
    geometric_rs  row    reject the row when exp mean ℓ ∉ [lo, hi]  verl 0.999–1.001
    veto          row    reject the row when any r_t < floor        verl 1e-4

For each: the fraction of tokens and of rows truncated, masked or rejected; the weight mass kept
(Σ w after / Σ w before: r_t for token schemes, the row weight for row schemes, 1 a token for
rejection); Kish's ESS of the weights after, as a fraction of the tokens (token schemes) or rows
(row schemes); and the GRPO groups (rows of one step with the same prompt) that would lose a member,
a row rejected or masked whole. Exact: the thresholds only touch tokens far from r = 1, so the
per-threshold work runs over that tail alone, and the sums over every token come from mismatch.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from klpipe.score.mismatch import TAIL, MismatchSums, RowMismatch, TokenMismatch, dot, ess_fraction


@dataclass(frozen=True)
class Scheme:
    name: str
    level: str  # "token" or "row": what its weights and its ESS count
    action: str  # "truncate", "mask" or "reject"
    low: float | None  # mask/reject below this (the veto's floor)
    high: float | None  # truncate at, or mask/reject above, this
    default_of: str = ""  # whose default this threshold is

    @property
    def threshold(self) -> str:
        if self.low is not None and self.high is not None:
            return f"[{self.low:g}, {self.high:g}]"
        return f"{self.high:g}" if self.high is not None else f"< {self.low:g}"

    @property
    def loses_rows(self) -> bool:
        return self.action in ("mask", "reject")


SCHEMES: tuple[Scheme, ...] = (
    *(Scheme("token_tis", "token", "truncate", None, c, who) for c, who in
      ((1.5, ""), (2.0, "verl"), (3.0, "TRL"), (5.0, ""), (10.0, ""))),
    *(Scheme("sequence_is", "row", "truncate", None, c, who) for c, who in ((2.0, "verl"), (5.0, ""), (10.0, ""))),
    *(Scheme("geometric_is", "row", "truncate", None, c) for c in (1.01, 1.1, 2.0)),
    *(Scheme("icepop", "token", "mask", lo, hi, who) for lo, hi, who in
      ((0.5, 5.0, "IcePop"), (0.5, 2.0, ""), (0.8, 1.25, ""))),
    *(Scheme("geometric_rs", "row", "reject", lo, hi, who) for lo, hi, who in
      ((0.999, 1.001, "verl"), (0.99, 1.01, ""), (0.95, 1.05, ""))),
    *(Scheme("veto", "row", "reject", floor, None, who) for floor, who in ((1e-6, ""), (1e-4, "verl"), (1e-3, ""))),
)

# Token schemes leave r_t with |ℓ_t| below mismatch.TAIL untouched, so only the tail at or above it (each block's
# `tail`) is looked at per threshold. A threshold nearer to r = 1 would need a smaller TAIL.
_TOKEN = [s for s in SCHEMES if s.name in ("token_tis", "icepop", "veto")]
_NEAREST = min(min(np.log(s.high) for s in _TOKEN if s.high is not None),
               min(-np.log(s.low) for s in _TOKEN if s.low is not None))
assert TAIL <= _NEAREST + 1e-12


@dataclass
class CorrectionSums:
    """Per scheme (SCHEMES order): running counts and weight sums over a step or a run."""

    tokens_affected: np.ndarray = field(default_factory=lambda: np.zeros(len(SCHEMES), np.int64))
    rows_affected: np.ndarray = field(default_factory=lambda: np.zeros(len(SCHEMES), np.int64))
    weight_before: np.ndarray = field(default_factory=lambda: np.zeros(len(SCHEMES)))
    weight_after: np.ndarray = field(default_factory=lambda: np.zeros(len(SCHEMES)))
    ess_sum: np.ndarray = field(default_factory=lambda: np.zeros(len(SCHEMES)))  # Σ w of the ESS's weights
    ess_sq: np.ndarray = field(default_factory=lambda: np.zeros(len(SCHEMES)))  # Σ w²
    groups: int | None = None  # GRPO groups seen; None when the cache has no prompt to group by
    groups_losing: np.ndarray = field(default_factory=lambda: np.zeros(len(SCHEMES), np.int64))
    # Rows not yet counted into groups: their group keys and a bit per scheme that loses them.
    _keys: list[np.ndarray] = field(default_factory=list)
    _lost: list[np.ndarray] = field(default_factory=list)

    def add(self, tokens: TokenMismatch, rows: RowMismatch, group_keys: np.ndarray | None, sum_r: float,
            sum_r2: float) -> None:
        """Add a block of rows; (Σr, Σr²) over its tokens are MismatchSums.add's."""
        offsets = tokens.offsets
        counts = rows.tokens
        n_rows = len(counts)
        tail = tokens.tail
        tail_r = tokens.expm1[tail] + 1.0
        tail_row = np.searchsorted(offsets, tail, side="right") - 1
        has = rows.has_tokens
        lost = np.zeros(n_rows, np.uint32)
        for i, scheme in enumerate(SCHEMES):
            # Each branch reads the bounds its scheme has; a side it has not is never read.
            low = -np.inf if scheme.low is None else scheme.low
            high = np.inf if scheme.high is None else scheme.high
            if scheme.name == "token_tis":
                hit = tail_r > high
                excess = tail_r[hit]
                cap = high
                after = sum_r - float(np.sum(excess - cap))
                after_sq = sum_r2 - float(np.sum(excess * excess - cap * cap))
                self._tally(i, int(np.count_nonzero(hit)), np.unique(tail_row[hit]).size, sum_r, after, after_sq)
            elif scheme.name == "icepop":
                hit = (tail_r < low) | (tail_r > high)
                out = tail_r[hit]
                masked = np.bincount(tail_row[hit], minlength=n_rows)
                whole = has & (masked == counts)
                lost |= whole.astype(np.uint32) << i
                self._tally(i, int(np.count_nonzero(hit)), int(np.count_nonzero(masked)), sum_r,
                            sum_r - float(np.sum(out)), sum_r2 - dot(out, out))
            elif scheme.name == "veto":
                rejected = np.zeros(n_rows, bool)
                rejected[tail_row[tail_r < low]] = True
                self._reject(i, rejected, counts, has, lost)
            elif scheme.name == "geometric_rs":
                geo = rows.geometric_weight
                rejected = has & ((geo < low) | (geo > high))
                self._reject(i, rejected, counts, has, lost)
            else:  # sequence_is, geometric_is: truncate the row weight
                weight = (rows.sequence_weight if scheme.name == "sequence_is" else rows.geometric_weight)[has]
                hit = weight > high
                truncated = np.minimum(weight, high)
                self._tally(i, int(np.sum(counts[has][hit])), int(np.count_nonzero(hit)), float(np.sum(weight)),
                            float(np.sum(truncated)), dot(truncated, truncated))
        if group_keys is not None:
            self._keys.append(group_keys[has])
            self._lost.append(lost[has])
            self.groups = self.groups or 0

    def _tally(self, i: int, tokens: int, rows: int, before: float, after: float, after_sq: float,
               ess_sum: float | None = None) -> None:
        """`after_sq` is Σ w² of the weights the ESS counts, `ess_sum` their Σ w when they are not `after`'s."""
        self.tokens_affected[i] += tokens
        self.rows_affected[i] += rows
        self.weight_before[i] += before
        self.weight_after[i] += after
        self.ess_sum[i] += after if ess_sum is None else ess_sum
        self.ess_sq[i] += after_sq

    def _reject(self, i: int, rejected: np.ndarray, counts: np.ndarray, has: np.ndarray, lost: np.ndarray) -> None:
        # A rejected row's tokens all weigh 0, a kept row's 1: the row-level ESS is the kept fraction.
        kept = float(np.count_nonzero(has & ~rejected))
        lost |= rejected.astype(np.uint32) << i
        self._tally(i, int(np.sum(counts[rejected])), int(np.count_nonzero(rejected)), float(np.sum(counts[has])),
                    float(np.sum(counts[has & ~rejected])), kept, ess_sum=kept)

    def close_groups(self) -> None:
        """Count the groups of the rows added so far (one step's, or a run's without steps) and forget the rows."""
        if not self._keys:
            return
        keys, lost = np.concatenate(self._keys), np.concatenate(self._lost)
        self._keys, self._lost = [], []
        self.groups = (self.groups or 0) + int(np.unique(keys).size)
        for i in range(len(SCHEMES)):
            hit = (lost >> np.uint32(i)) & np.uint32(1)
            self.groups_losing[i] += int(np.unique(keys[hit.astype(bool)]).size)

    def merge(self, other: CorrectionSums) -> None:
        for name in ("tokens_affected", "rows_affected", "weight_before", "weight_after", "ess_sum", "ess_sq",
                     "groups_losing"):
            getattr(self, name).__iadd__(getattr(other, name))
        if other.groups is not None:
            self.groups = (self.groups or 0) + other.groups
        self._keys += other._keys
        self._lost += other._lost

    def table(self, totals: MismatchSums) -> list[dict[str, Any]]:
        """One entry per scheme and threshold: the report's sweep table."""
        self.close_groups()
        entries = []
        for i, scheme in enumerate(SCHEMES):
            n = totals.tokens if scheme.level == "token" else totals.rows
            before = self.weight_before[i]
            entries.append({
                "scheme": scheme.name, "level": scheme.level, "action": scheme.action, "threshold": scheme.threshold,
                "low": scheme.low, "high": scheme.high, "default_of": scheme.default_of or None,
                "tokens_affected_fraction": float(self.tokens_affected[i] / totals.tokens) if totals.tokens else None,
                "rows_affected_fraction": float(self.rows_affected[i] / totals.rows) if totals.rows else None,
                "weight_kept": float(self.weight_after[i] / before) if before > 0 else None,
                "ess_fraction": ess_fraction(float(self.ess_sum[i]), float(self.ess_sq[i]), n),
                "groups_losing_members": int(self.groups_losing[i]) if scheme.loses_rows and self.groups is not None
                else None,
            })  # fmt: skip
        return entries
