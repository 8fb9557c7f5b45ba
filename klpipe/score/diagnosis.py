"""Setup mistakes behind a sampler–trainer mismatch, named with a code and the evidence, not averaged.

    nonfinite           NaN, ±inf or null sampler logprobs at sampled (mask-1) tokens
    placeholder_values  sampler logprobs of exactly 1.0, or 0.0 where the trainer gives the token p < 0.9
                        (the 0.0 / 1.0 a tool loop or a prompt writes in place of a logprob)
    misaligned          a row's sampler list has another length than its response, or the sampler's
                        logprobs fit the trainer's better shifted by one token
    truncated_sampling  ℓ ≤ 0 almost everywhere: the sampler renormalised over a top-p/top-k set, so its
                        logprob of the sampled token is log p − log P(set), never below the full softmax's
    temperature         ℓ linear in the sampler's log p: a sampler at temperature T_s against a trainer at
                        T_t gives log π_trainer ≈ (T_s/T_t)·log π_sampler + c, so ℓ has slope T_s/T_t − 1

Tokens of the first two kinds are left out of every figure (mismatch.py) and counted here. The last
two are read only when the tokens are aligned: a shifted list makes ℓ a difference of unrelated
logprobs, with a slope of −1. The fitted ratio is pooled over contexts, which pulls it towards 1 (the
constant c varies with the context): it says the direction and roughly the size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from klpipe.score.mismatch import TokenMismatch, bin_of, dot

CODES = ("nonfinite", "placeholder_values", "misaligned", "truncated_sampling", "temperature")

MIN_TOKENS = 100  # fewer usable tokens than this: too few to read a slope or a sign pattern
PLACEHOLDER_TRAINER_MAX = float(np.log(0.9))  # a 0.0 is a placeholder where the trainer gives p below this
TEMPERATURE_SLOPE = 0.03  # |slope of ℓ on log π_sampler| at or above this ...
TEMPERATURE_R2 = 0.2  # ... with this much of ℓ's variance explained by it
TRUNCATED_NONPOSITIVE = 0.99  # fraction of ℓ ≤ ZERO_TOLERANCE at or above this ...
TRUNCATED_NEGATIVE = 0.05  # ... and of ℓ < −CLEARLY_NEGATIVE at or above this
ZERO_TOLERANCE = 1e-6
CLEARLY_NEGATIVE = 1e-3
SHIFT_MIN_ALIGNED = 0.05  # mean |ℓ| (nats) of aligned pairs at or above this ...
SHIFT_RATIO = 0.5  # ... and a one-token shift's mean |difference| at most this fraction of it
NAMED_ROWS = 5
SHIFT_SAMPLE = 1 << 16  # tokens of each record batch the one-token-shift test reads


@dataclass
class Screen:
    """Which of a batch's sampled tokens the figures may use, and why not the others."""

    usable: np.ndarray  # (tokens,) bool over the batch's mask-1 tokens
    nonfinite: np.ndarray  # (tokens,) bool
    placeholder: np.ndarray  # (tokens,) bool
    length_rows: np.ndarray  # (rows,) bool: the sampler list's length differs from the response's


def screen(trainer: np.ndarray, sampler: np.ndarray, offsets: np.ndarray, rows_ok: np.ndarray) -> Screen:
    """Sort a batch's mask-1 tokens (flat, `offsets` per row) into usable and not.

    `sampler` is NaN where the column held a null or its row's list had another length (`rows_ok` False).
    """
    # One pass finds every candidate (a logprob is finite and below 0); the rare candidates are then sorted out.
    suspect = np.flatnonzero(~((sampler < 0) & (sampler > -np.inf)))
    nonfinite = np.zeros(len(sampler), bool)
    placeholder = np.zeros(len(sampler), bool)
    in_bad_row = None
    if not rows_ok.all():
        in_bad_row = np.repeat(~rows_ok, np.diff(offsets))
    if len(suspect):
        values = sampler[suspect]
        nonfinite[suspect] = ~np.isfinite(values)
        placeholder[suspect] = (values == 1.0) | ((values == 0.0) & (trainer[suspect] < PLACEHOLDER_TRAINER_MAX))
    if in_bad_row is not None:
        nonfinite &= ~in_bad_row
    usable = ~(nonfinite | placeholder) if len(suspect) else np.ones(len(sampler), bool)
    if in_bad_row is not None:
        usable &= ~in_bad_row
    return Screen(usable=usable, nonfinite=nonfinite, placeholder=placeholder, length_rows=~rows_ok)


@dataclass
class DiagnosisSums:
    """Running evidence over a run."""

    tokens: int = 0
    nonfinite: int = 0
    placeholder: int = 0
    length_rows: int = 0
    named: dict[str, Any] = field(default_factory=lambda: {code: [] for code in CODES})
    # ℓ regressed on x = log π_sampler
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    syy: float = 0.0
    # consecutive usable tokens of one row: |ℓ| aligned, and shifted by one token either way
    pairs: int = 0
    aligned: float = 0.0
    shift_forward: float = 0.0  # |trainer_{t+1} − sampler_t|
    shift_back: float = 0.0  # |trainer_t − sampler_{t+1}|

    def add_screen(self, found: Screen, offsets: np.ndarray, row_name: Callable[[int], str]) -> None:
        self.nonfinite += int(np.count_nonzero(found.nonfinite))
        self.placeholder += int(np.count_nonzero(found.placeholder))
        self.length_rows += int(np.count_nonzero(found.length_rows))
        for code, tokens in (("nonfinite", found.nonfinite), ("placeholder_values", found.placeholder)):
            room = NAMED_ROWS - len(self.named[code])
            if room > 0 and tokens.any():
                rows = np.unique(np.searchsorted(offsets, np.flatnonzero(tokens), side="right") - 1)[:room]
                self.named[code] += [row_name(int(i)) for i in rows]
        room = NAMED_ROWS - len(self.named["misaligned"])
        if room > 0:
            self.named["misaligned"] += [row_name(int(i)) for i in np.flatnonzero(found.length_rows)[:room]]

    def add_tokens(self, tokens: TokenMismatch, sum_trainer: float) -> None:
        """Add a batch's usable tokens; `sum_trainer` is Σ log π_trainer over them (the per-row sums')."""
        x, y = tokens.sampler, tokens.log_ratio
        sum_y = float(np.sum(y))
        self.tokens += len(y)
        self.sx += sum_trainer - sum_y  # Σ log π_sampler = Σ log π_trainer − Σℓ
        self.sy += sum_y
        self.sxx += float(np.einsum("i,i->", x, x, dtype=np.float64))  # the sampler's may be float32
        self.sxy += float(np.einsum("i,i->", x, y, dtype=np.float64))
        self.syy += dot(y, y)
        # The shift test compares means of |differences|: the first SHIFT_SAMPLE tokens of each batch tell them.
        n = min(len(y), SHIFT_SAMPLE)
        offsets = tokens.offsets[tokens.offsets <= n]
        y, trainer, sampler = y[:n], tokens.trainer[:n], x[:n]
        # Pairs (t, t+1) inside one row: drop the pairs that straddle a row boundary.
        same_row = np.ones(max(n - 1, 0), bool)
        inner = offsets[(offsets > 0) & (offsets < n)]
        same_row[inner - 1] = False
        self.pairs += int(np.count_nonzero(same_row))
        self.aligned += float(np.sum(np.abs(y[1:])[same_row]))
        self.shift_forward += float(np.sum(np.abs(trainer[1:] - sampler[:-1])[same_row]))
        self.shift_back += float(np.sum(np.abs(trainer[:-1] - sampler[1:])[same_row]))

    def fit(self) -> tuple[float, float] | None:
        """(slope, R²) of the least-squares line of ℓ on log π_sampler; None when it is undefined."""
        n = self.tokens
        if n < 2:
            return None
        vx = self.sxx - self.sx * self.sx / n
        vy = self.syy - self.sy * self.sy / n
        cov = self.sxy - self.sx * self.sy / n
        if vx <= 0:
            return None
        slope = cov / vx
        r2 = cov * cov / (vx * vy) if vy > 0 else 0.0
        return slope, r2

    def findings(self, sampler_name: str, histogram: np.ndarray) -> list[dict[str, Any]]:
        """[{code, evidence, rows}] in CODES order: what the data shows, one entry each. `histogram` is the run's
        histogram of ℓ (mismatch.bin_index), whose bin edges hold ZERO_TOLERANCE and CLEARLY_NEGATIVE exactly."""
        found = []
        self.nonpositive = int(histogram[:bin_of(ZERO_TOLERANCE)].sum())  # ℓ < 1e-6
        self.negative = int(histogram[:bin_of(-CLEARLY_NEGATIVE)].sum())  # ℓ < −1e-3, to the bin

        def say(code: str, evidence: str) -> None:
            found.append({"code": code, "evidence": evidence, "rows": self.named.get(code) or []})

        if self.nonfinite:
            say("nonfinite", f"{self.nonfinite} sampled token(s) hold NaN, ±inf or null in {sampler_name}; "
                             "left out of every figure")
        if self.placeholder:
            say("placeholder_values", f"{self.placeholder} sampled token(s) hold exactly 0.0 or 1.0 in {sampler_name} "
                                      "where the trainer gives p < 0.9: placeholders, not logprobs; left out of every "
                                      "figure")
        shifted = None
        if self.pairs >= MIN_TOKENS:
            aligned = self.aligned / self.pairs
            best = min(self.shift_forward, self.shift_back) / self.pairs
            if aligned >= SHIFT_MIN_ALIGNED and best <= SHIFT_RATIO * aligned:
                way = "ahead" if self.shift_forward <= self.shift_back else "behind"
                shifted = (f"the sampler's logprobs fit the trainer's shifted by one token (the sampler's list runs "
                           f"one token {way}): mean |trainer − sampler| {aligned:.4g} nats aligned, {best:.4g} shifted")
        if self.length_rows or shifted:
            parts = [(f"{self.length_rows} row(s) whose {sampler_name} list has another length than the response "
                      "(left out)")] if self.length_rows else []
            say("misaligned", "; ".join(parts + ([shifted] if shifted else [])))
        if shifted or self.tokens < MIN_TOKENS:
            return found  # a shifted ℓ says nothing about temperature or truncation
        truncated = (self.nonpositive >= TRUNCATED_NONPOSITIVE * self.tokens
                     and self.negative >= TRUNCATED_NEGATIVE * self.tokens)
        if truncated:
            say("truncated_sampling", f"{self.nonpositive / self.tokens:.1%} of sampled tokens have ℓ ≤ 0 and "
                                      f"{self.negative / self.tokens:.1%} ℓ < −{CLEARLY_NEGATIVE:g}: the sampler's "
                                      "logprobs look renormalised over a top-p/top-k set (see the breakdown by "
                                      "sampler probability)")
            return found
        fit = self.fit()
        if fit is not None and abs(fit[0]) >= TEMPERATURE_SLOPE and fit[1] >= TEMPERATURE_R2:
            slope, r2 = fit
            say("temperature", f"ℓ is linear in the sampler's log p, slope {slope:+.3f} (R² {r2:.2f}): fitted "
                               f"temperature ratio sampler/trainer ≈ {1 + slope:.3f}; check that the trainer divides "
                               "by the rollouts' temperature and the sampler's logprobs are at that temperature")
        return found

    def merge(self, other: DiagnosisSums) -> None:
        for name in self.__dataclass_fields__:
            if name not in ("named",):
                setattr(self, name, getattr(self, name) + getattr(other, name))
        for code in CODES:
            self.named[code] = (self.named[code] + other.named[code])[:NAMED_ROWS]
