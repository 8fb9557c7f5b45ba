"""The sampler against the trainer: the training–inference mismatch of every sampled token.

Rollouts carry the sampler's logprobs (vLLM, SGLang); `klpipe precompute --policy` adds the trainer's
own forward of the same tokens. On a token the policy sampled (mask 1):

    ℓ_t = log π_trainer(y_t) − log π_sampler(y_t),    r_t = exp(ℓ_t)

Every figure counts mask-1 tokens whose sampler logprob is usable (diagnosis.py names the others), never padding;
token-weighted figures average over those tokens, row-weighted ones per-row values over the rows holding one. The
figures are verl's (`rollout_corr_helper.py`), by its names and definitions, and quantiles of ℓ come from a
log-spaced histogram, so memory stays bounded however many tokens a run holds. Pure numpy: no loop over rows.
docs/score.md, "Sampler against trainer", tables every figure and the histogram's bins.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from klpipe.score.kl import Estimator, row_reduce, token_kl

# verl clamps a log-ratio sum at ±20 before exp (its SAFETY_BOUND), so one wild row cannot overflow.
SAFETY_BOUND = 20.0

QUANTILES = (0.001, 0.01, 0.5, 0.99, 0.999)
QUANTILE_NAMES = ("p0.1", "p1", "p50", "p99", "p99.9")

# The correction sweep (corrections.py) touches only tokens with |ℓ| at or above this (r ∉ (0.8, 1.25)); each
# block keeps their indices.
TAIL = float(np.log(1.25))

# The histogram of ℓ: bins of |ℓ| from 10^LOW_DECADE to 10^HIGH_DECADE, BINS_PER_DECADE per decade,
# for each sign, around one bin for |ℓ| < 10^LOW_DECADE (0 included). Index order is the order of ℓ.
LOW_DECADE, HIGH_DECADE, BINS_PER_DECADE = -9, 3, 100
MAGNITUDE_BINS = (HIGH_DECADE - LOW_DECADE) * BINS_PER_DECADE
BINS = 2 * MAGNITUDE_BINS + 1

# Breakdowns: the sampler's probability of the sampled token (edges on p), the token's position in
# the response (edges on the index), and where it sits against the tool results of its row.
PROBABILITY_EDGES = (1e-3, 1e-2, 0.1, 0.5, 0.9)
PROBABILITY_LABELS = ("p<0.001", "0.001≤p<0.01", "0.01≤p<0.1", "0.1≤p<0.5", "0.5≤p<0.9", "p≥0.9")
POSITION_EDGES = (1, 4, 16, 64, 256, 1024)
POSITION_LABELS = ("0", "1-3", "4-15", "16-63", "64-255", "256-1023", "≥1024")
AFTER_TOOL_FIRST = 4  # the first tokens the policy samples after a tool result get their own bucket
MASK_RUN_LABELS = ("before any tool result", "first 4 tokens after a tool result", "later after a tool result")
BREAKDOWNS = {"sampler_probability": PROBABILITY_LABELS, "position": POSITION_LABELS, "mask_run": MASK_RUN_LABELS}


def dot(a: np.ndarray, b: np.ndarray) -> float:
    """Σ a·b. Not np.dot: BLAS threads a long dot product, and on a busy machine its threads cost 300 times the
    arithmetic (18 ms against 0.06 ms for 200k values, measured); einsum runs it in this thread."""
    return float(np.einsum("i,i->", a, b))


def bin_index(log_ratio: np.ndarray, magnitude: np.ndarray | None = None) -> np.ndarray:
    """(tokens,) int64 histogram bin of each ℓ, monotone in ℓ; `magnitude` is |ℓ| when the caller has it."""
    level = np.abs(log_ratio) if magnitude is None else magnitude.copy()
    return _bins(log_ratio, level).astype(np.int64)


def _bins(log_ratio: np.ndarray, level: np.ndarray) -> np.ndarray:
    """`level`, holding |ℓ|, made each ℓ's histogram bin (as floats), in place: no copy of a long array."""
    with np.errstate(divide="ignore"):
        np.log10(level, out=level)  # −inf for 0
    level -= LOW_DECADE
    level *= BINS_PER_DECADE
    np.floor(level, out=level)
    np.clip(level, -1, MAGNITUDE_BINS - 1, out=level)  # −1: below the lowest bin; the top bin takes overflow
    level += 1  # 0 .. MAGNITUDE_BINS: steps away from the middle bin
    np.copysign(level, log_ratio, out=level)  # −0.0 and 0 both land in the middle bin
    level += MAGNITUDE_BINS
    return level


def bin_centres() -> np.ndarray:
    """(BINS,) the value each bin stands for: its geometric centre, 0 for the middle bin."""
    magnitude = 10.0 ** (LOW_DECADE + (np.arange(MAGNITUDE_BINS) + 0.5) / BINS_PER_DECADE)
    return np.concatenate((-magnitude[::-1], [0.0], magnitude))


def bin_of(value: float) -> int:
    """The bin holding ℓ = value."""
    return int(bin_index(np.array([value], np.float64))[0])


def histogram_quantiles(counts: np.ndarray, absolute: bool = False) -> dict[str, float | None]:
    """The inverted-CDF quantiles (QUANTILES) of a bin_index histogram, of |ℓ| with `absolute`; None when empty.

    The q-quantile is the k-th smallest value, k = ⌈q·n⌉: reported as the centre of its bin.
    """
    centres = bin_centres()
    if absolute:  # fold the negative half onto the positive one
        folded = counts[MAGNITUDE_BINS:].copy()
        folded[1:] += counts[:MAGNITUDE_BINS][::-1]
        counts, centres = folded, centres[MAGNITUDE_BINS:]
    total = int(counts.sum())
    if total == 0:
        return dict.fromkeys(QUANTILE_NAMES)
    ranks = np.maximum(np.ceil(np.array(QUANTILES) * total - 1e-9), 1)
    index = np.searchsorted(np.cumsum(counts), ranks, side="left")
    return dict(zip(QUANTILE_NAMES, centres[index].tolist(), strict=True))


@dataclass
class TokenMismatch:
    """A block of rows' usable sampled tokens, flat, and what the figures are made of.

    `offsets` are zero-based row offsets into the token arrays; a row may hold none (an empty
    response, a row masked whole, or one whose sampler logprobs were unusable).
    """

    trainer: np.ndarray  # (tokens,) log π_trainer, as stored (float32 or float64)
    sampler: np.ndarray  # (tokens,) log π_sampler, likewise
    ref: np.ndarray  # (tokens,) log π_ref (float32 as cached, or float64)
    offsets: np.ndarray  # (rows + 1,) int64
    position_bucket: np.ndarray  # (tokens,) int8 POSITION_EDGES bucket of the token's index in its response
    # (tokens,) int64 tokens since the last mask-0 token of its row, −1: none; None: no mask
    after_tool: np.ndarray | None
    # Computed once for the whole block, then sliced by `rows`: each is one numpy pass over the tokens.
    log_ratio: np.ndarray = field(init=False)  # (tokens,) ℓ = trainer − sampler
    expm1: np.ndarray = field(init=False)  # (tokens,) r − 1 = e^ℓ − 1, exact for small ℓ
    tail: np.ndarray = field(init=False)  # (tail tokens,) int64 sorted indices of the tokens with |ℓ| ≥ TAIL
    cell: np.ndarray = field(init=False)  # (tokens,) intp category × BINS + bin: the joint histogram's cell

    def __post_init__(self) -> None:
        # Float64 from the stored values in one pass: the difference of two float32s is exact in it.
        self.log_ratio = np.subtract(self.trainer, self.sampler, dtype=np.float64)
        self.expm1 = np.expm1(self.log_ratio)
        level = np.abs(self.log_ratio)
        self.tail = np.flatnonzero(level >= TAIL)
        _bins(self.log_ratio, level)  # as bin_index, plus the category's block of bins:
        level += np.multiply(categories(self), BINS, dtype=np.float64)
        self.cell = level.astype(np.intp)

    def rows(self, start: int, stop: int) -> TokenMismatch:
        """Rows start..stop as views, their offsets rebased."""
        lo, hi = int(self.offsets[start]), int(self.offsets[stop])
        part = TokenMismatch.__new__(TokenMismatch)
        for name in ("trainer", "sampler", "ref", "position_bucket", "log_ratio", "expm1", "cell"):
            setattr(part, name, getattr(self, name)[lo:hi])
        part.tail = self.tail[np.searchsorted(self.tail, lo):np.searchsorted(self.tail, hi)] - lo
        part.after_tool = None if self.after_tool is None else self.after_tool[lo:hi]
        part.offsets = self.offsets[start:stop + 1] - lo
        return part

    @property
    def counts(self) -> np.ndarray:
        return np.diff(self.offsets)  # (rows,)


@dataclass
class RowMismatch:
    """Per-row values (rows,) float64: what the scored file gains, and the row-weighted figures' terms."""

    tokens: np.ndarray  # (rows,) int64 usable sampled tokens
    sum_ratio: np.ndarray  # Σ_t ℓ
    mean_ratio: np.ndarray  # mean_t ℓ (0 for a row without tokens)
    mean_trainer: np.ndarray  # mean_t log π_trainer
    mean_sampler: np.ndarray  # mean_t log π_sampler

    def rows(self, start: int, stop: int) -> RowMismatch:
        return RowMismatch(*(getattr(self, name)[start:stop] for name in self.__dataclass_fields__))

    @property
    def has_tokens(self) -> np.ndarray:
        return self.tokens > 0

    @property
    def mismatch_kl(self) -> np.ndarray:
        return -self.mean_ratio  # mean −ℓ over the row

    @property
    def log_ppl_diff(self) -> np.ndarray:
        # log(training ppl) − log(rollout ppl) per row = mean log π_sampler − mean log π_trainer = −mean ℓ: the
        # row's mismatch_kl; the two differ only in how a batch averages them (tokens against rows).
        diff: np.ndarray = self.mean_sampler - self.mean_trainer
        return diff

    @property
    def sequence_weight(self) -> np.ndarray:
        weight: np.ndarray = np.exp(np.clip(self.sum_ratio, -SAFETY_BOUND, SAFETY_BOUND))  # exp Σℓ, verl's clamp
        return weight

    @property
    def geometric_weight(self) -> np.ndarray:
        weight: np.ndarray = np.exp(self.mean_ratio)  # exp mean ℓ
        return weight


def per_row(tokens: TokenMismatch) -> RowMismatch:
    counts = tokens.counts
    safe = np.maximum(counts, 1)
    sum_ratio = row_reduce(np.add, tokens.log_ratio, tokens.offsets)
    mean_ratio = sum_ratio / safe
    mean_trainer = _row_sums(tokens.trainer, tokens.offsets) / safe
    # mean_t log π_sampler = mean_t log π_trainer − mean_t ℓ
    return RowMismatch(tokens=counts, sum_ratio=sum_ratio, mean_ratio=mean_ratio, mean_trainer=mean_trainer,
                       mean_sampler=mean_trainer - mean_ratio)


def _row_sums(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """(rows,) float64 Σ of each row's values (float32 summed in float64), 0 for an empty row."""
    lengths = np.diff(offsets)
    out = np.zeros(len(lengths))
    nonempty = lengths > 0
    if len(values):
        out[nonempty] = np.add.reduceat(values, offsets[:-1][nonempty], dtype=np.float64)
    return out


# The joint category of a token: its sampler-probability bucket, position bucket and mask-run bucket in one index.
CATEGORY_SHAPE = tuple(len(labels) for labels in BREAKDOWNS.values())  # (probability, position, mask run)
CATEGORIES = int(np.prod(CATEGORY_SHAPE))


def categories(tokens: TokenMismatch) -> np.ndarray:
    """(tokens,) int16 joint bucket of each token: probability + 6·(position + 7·mask run) (BREAKDOWNS).

    Small integer types throughout: each pass moves a quarter of int64's bytes.
    """
    joint = tokens.position_bucket.astype(np.int16)
    joint *= len(PROBABILITY_LABELS)
    for edge in np.log(PROBABILITY_EDGES).astype(tokens.sampler.dtype):
        joint += tokens.sampler >= edge
    if tokens.after_tool is not None:
        run = (tokens.after_tool >= 0).astype(np.int16)
        run += tokens.after_tool >= AFTER_TOOL_FIRST
        run *= len(PROBABILITY_LABELS) * len(POSITION_LABELS)
        joint += run
    return joint


def ess_fraction(sum_w: float, sum_w2: float, n: int) -> float | None:
    """Kish's effective sample size (Σw)² / Σw², as a fraction of the n weights (verl's ESS, normalised); 0 when
    every weight is 0 (a scheme that rejects everything), None when there are no weights."""
    if n == 0:
        return None
    if sum_w2 <= 0:
        return 0.0
    return float(sum_w * sum_w / (n * sum_w2))


@dataclass
class MismatchSums:
    """Running sums over a step or a run: every figure of the report's mismatch section is read from these."""

    tokens: int = 0
    rows: int = 0  # rows with at least one usable token
    neg_ratio: float = 0.0  # Σ −ℓ
    k3: float = 0.0  # Σ e^ℓ − 1 − ℓ
    ratio: float = 0.0  # Σ r
    ratio_sq: float = 0.0  # Σ r²
    training_ppl: float = 0.0  # Σ over rows
    rollout_ppl: float = 0.0
    log_ppl_diff: float = 0.0
    ppl_ratio: float = 0.0
    seq_sq: float = 0.0  # Σ over rows exp(2·clip Σℓ)
    seq_weight: float = 0.0  # Σ over rows exp(clip Σℓ)
    geo_weight: float = 0.0  # Σ over rows exp(mean ℓ)
    geo_sq: float = 0.0
    kl_trainer: float = 0.0  # Σ k(trainer − ref)
    kl_sampler: float = 0.0  # Σ k(sampler − ref)
    kl_corrected: float = 0.0  # Σ r·k(trainer − ref)
    # (CATEGORIES, BINS) int64 counts of ℓ per joint category: the histogram and every breakdown are its marginals.
    joint: np.ndarray = field(default_factory=lambda: np.zeros((CATEGORIES, BINS), np.int64))

    def add(self, tokens: TokenMismatch, rows: RowMismatch, estimator: Estimator) -> tuple[float, float]:
        """Add a block of rows; score's per-token `estimator` gives the KL figures. Returns the block's (Σr, Σr²)."""
        ratio, expm1 = tokens.log_ratio, tokens.expm1
        n = len(ratio)
        sum_ratio, sum_expm1 = float(np.sum(ratio)), float(np.sum(expm1))
        sum_r = sum_expm1 + n
        sum_r2 = dot(expm1, expm1) + 2 * sum_expm1 + n  # Σ (1 + (r − 1))²
        self.tokens += n
        self.neg_ratio -= sum_ratio
        self.k3 += sum_expm1 - sum_ratio
        self.ratio += sum_r
        self.ratio_sq += sum_r2
        has = rows.has_tokens
        self.rows += int(np.count_nonzero(has))
        self.training_ppl += float(np.sum(np.exp(-rows.mean_trainer[has])))
        self.rollout_ppl += float(np.sum(np.exp(-rows.mean_sampler[has])))
        self.log_ppl_diff += float(np.sum(rows.log_ppl_diff[has]))
        self.ppl_ratio += float(np.sum(np.exp(rows.log_ppl_diff[has])))
        seq = rows.sequence_weight[has]
        self.seq_weight += float(np.sum(seq))
        self.seq_sq += dot(seq, seq)
        geo = rows.geometric_weight[has]
        self.geo_weight += float(np.sum(geo))
        self.geo_sq += dot(geo, geo)
        k_trainer = token_kl(np.subtract(tokens.trainer, tokens.ref, dtype=np.float64), estimator)  # (tokens,) f64
        sum_k = float(np.sum(k_trainer))
        self.kl_trainer += sum_k
        self.kl_corrected += sum_k + dot(expm1, k_trainer)  # Σ (1 + (r − 1))·k
        if estimator == "k1":  # sampler − ref = (trainer − ref) − ℓ
            self.kl_sampler += sum_k - sum_ratio
        else:
            self.kl_sampler += float(np.sum(token_kl(np.subtract(tokens.sampler, tokens.ref, dtype=np.float64),
                                                     estimator)))
        self.joint += np.bincount(tokens.cell, minlength=self.joint.size).reshape(self.joint.shape)
        return sum_r, sum_r2

    @property
    def histogram(self) -> np.ndarray:
        counts: np.ndarray = self.joint.sum(axis=0)
        return counts

    def merge(self, other: MismatchSums) -> None:
        for name in self.__dataclass_fields__:
            if name != "joint":
                setattr(self, name, getattr(self, name) + getattr(other, name))
        self.joint += other.joint

    def figures(self) -> dict[str, Any]:
        """verl's metrics under verl's names, then klpipe's own; None where nothing was counted."""
        n, rows = self.tokens, self.rows
        tok = (lambda total: total / n) if n else (lambda total: None)
        row = (lambda total: total / rows) if rows else (lambda total: None)
        figures = {
            "rollout_corr/kl": tok(self.neg_ratio),
            "rollout_corr/k3_kl": tok(self.k3),
            "rollout_corr/chi2_token": tok(self.ratio_sq - n) if n else None,
            "rollout_corr/training_ppl": row(self.training_ppl),
            "rollout_corr/rollout_ppl": row(self.rollout_ppl),
            "rollout_corr/log_ppl_diff": row(self.log_ppl_diff),
            "rollout_corr/ppl_ratio": row(self.ppl_ratio),
            "rollout_corr/chi2_seq": row(self.seq_sq - rows) if rows else None,
            "mismatch/tokens": n,
            "mismatch/rows": rows,
            "mismatch/kl_trainer": tok(self.kl_trainer),
            "mismatch/kl_sampler": tok(self.kl_sampler),
            "mismatch/kl_importance_corrected": tok(self.kl_corrected),
            "mismatch/ess_token_is": ess_fraction(self.ratio, self.ratio_sq, n),
            "mismatch/ess_sequence_is": ess_fraction(self.seq_weight, self.seq_sq, rows),
            "mismatch/ess_geometric": ess_fraction(self.geo_weight, self.geo_sq, rows),
        }
        histogram = self.histogram
        for name, value in histogram_quantiles(histogram).items():
            figures[f"mismatch/log_ratio_{name}"] = value
        for name, value in histogram_quantiles(histogram, absolute=True).items():
            figures[f"mismatch/abs_log_ratio_{name}"] = value
        return figures

    def breakdown_tables(self) -> dict[str, Any]:
        """Per breakdown, per bucket: tokens and the quantiles of ℓ and |ℓ|."""
        joint = self.joint.reshape(*CATEGORY_SHAPE[::-1], BINS)  # (mask run, position, probability, BINS)
        marginals = {"sampler_probability": joint.sum(axis=(0, 1)), "position": joint.sum(axis=(0, 2)),
                     "mask_run": joint.sum(axis=(1, 2))}
        return {
            name: [{"bucket": label, "tokens": int(marginals[name][i].sum()),
                    "log_ratio": histogram_quantiles(marginals[name][i]),
                    "abs_log_ratio": histogram_quantiles(marginals[name][i], True)}
                   for i, label in enumerate(labels)]
            for name, labels in BREAKDOWNS.items()
        }  # fmt: skip
