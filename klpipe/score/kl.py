"""KL estimates from cached logprobs, vectorised over flat token values and row offsets.

That is an Arrow list column's own layout (`arrow.list_values` hands it out without a copy), so
every estimator is one numpy pass over the tokens and one `reduceat` over the rows: no Python loop
over tokens or rows, and nothing here needs pyarrow.

The per-token estimators of KL(policy ‖ ref), with d = policy − ref on the sampled token:
    k1   d                        unbiased, noisy, can be negative
    abs  |d|
    k2   ½·d²                     low variance, biased
    k3   exp(−d) + d − 1          unbiased and never negative (Schulman's k3)

and `full`, which estimates nothing: the exact per-token KL(π ‖ π_ref) over the whole vocabulary, which
`klpipe precompute --policy` computes (cache.KL_POLICY_REF), handed to `row_kl` as `exact`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

Estimator = Literal["k1", "abs", "k2", "k3", "full"]
Aggregate = Literal["mean", "sum"]
ESTIMATORS: tuple[str, ...] = ("k1", "abs", "k2", "k3", "full")
SAMPLED_ESTIMATORS: tuple[str, ...] = ("k1", "abs", "k2", "k3")  # from the sampled token's two logprobs alone
AGGREGATES: tuple[str, ...] = ("mean", "sum")

# estimate_kl_from_samples: additive smoothing of token counts, the original controller's value.
SAMPLE_SMOOTHING = 1e-4


@dataclass
class RowKL:
    """Per-row KL of a block of rows, plus the diagnostics score reports alongside it."""

    kl: np.ndarray  # (rows,) float64: estimator aggregated per row; k1 clamped at 0 when asked
    negative_k1: np.ndarray  # (rows,) bool: the unclamped k1 sum is below zero
    max_abs_diff: np.ndarray  # (rows,) float64: largest |policy − ref| in the row, 0 when empty
    token_kl: np.ndarray | None  # (tokens,) float64 per-token estimator values, when asked for
    offsets: np.ndarray  # (rows + 1,) zero-based row offsets into token_kl


def token_kl(diff: np.ndarray, estimator: Estimator) -> np.ndarray:
    """Per-token KL estimates from d = policy − ref (float64)."""
    out: np.ndarray
    if estimator == "k1":
        return diff
    if estimator == "abs":
        out = np.abs(diff)
        return out
    if estimator == "k2":
        out = 0.5 * np.square(diff)
        return out
    if estimator == "k3":
        # expm1 keeps the small-d values accurate where exp(−d) − 1 would cancel. An overflow
        # (d < −709) becomes inf, which the caller reports as a row error.
        with np.errstate(over="ignore"):
            out = np.expm1(-diff)
        out += diff
        return out
    if estimator == "full":
        raise ValueError("the full estimator is the exact KL over the vocabulary, not a function of policy − ref: "
                         "pass its per-token values to row_kl as exact=")
    raise ValueError(f"unknown estimator {estimator!r}; choose one of {', '.join(ESTIMATORS)}")


def row_reduce(ufunc: np.ufunc, tokens: np.ndarray, offsets: np.ndarray, empty: float = 0.0) -> np.ndarray:
    """`ufunc.reduce` over each row's tokens; rows without tokens get `empty`.

    reduceat returns the element *at* the index for an empty segment, so it runs over the
    non-empty rows' starts only: each non-empty row then ends where the next one starts.
    """
    lengths = np.diff(offsets)
    out = np.full(len(lengths), empty, dtype=np.float64)
    nonempty = lengths > 0
    if tokens.size:
        out[nonempty] = ufunc.reduceat(tokens, offsets[:-1][nonempty])
    return out


def row_kl(
    policy_values: np.ndarray,
    ref_values: np.ndarray,
    offsets: np.ndarray,
    estimator: Estimator = "k1",
    aggregate: Aggregate = "mean",
    clamp: bool = True,
    per_token: bool = False,
    exact: np.ndarray | None = None,
) -> RowKL:
    """Per-row KL from flat policy and reference logprobs that share the row `offsets`.

    `clamp` applies to k1 only, the original controller's `max(0, kl)`: the other estimators are never negative.
    The `full` estimator aggregates `exact` (tokens,), the exact per-token KL(π ‖ π_ref) of the same tokens, which
    is never negative either; the diagnostics (negative k1, largest gap) still come from policy − ref.
    An empty row has KL 0.
    """
    if aggregate not in AGGREGATES:
        raise ValueError(f"unknown aggregate {aggregate!r}; choose one of {', '.join(AGGREGATES)}")
    # Float64 before subtracting: the original controller subtracts Python floats, and float32 would lose digits.
    diff = np.subtract(policy_values, ref_values, dtype=np.float64)  # (tokens,)
    k1_sum = row_reduce(np.add, diff, offsets)  # (rows,)
    # max |d| from the row max and min: two cheap reductions instead of a full |d| array.
    max_abs_diff = np.maximum(row_reduce(np.maximum, diff, offsets), -row_reduce(np.minimum, diff, offsets))

    if estimator == "full":
        if exact is None or np.shape(exact) != diff.shape:
            got = "none" if exact is None else f"{np.size(exact)} values"
            raise ValueError(f"the full estimator needs exact= with one value per token ({diff.size}), got {got}")
        tokens = np.asarray(exact, dtype=np.float64)
    else:
        tokens = token_kl(diff, estimator)
    kl = k1_sum.copy() if estimator == "k1" else row_reduce(np.add, tokens, offsets)
    if aggregate == "mean":
        lengths = np.diff(offsets)
        np.divide(kl, lengths, out=kl, where=lengths > 0)
    if estimator == "k1" and clamp:
        np.maximum(kl, 0.0, out=kl)
    return RowKL(
        kl=kl,
        negative_k1=k1_sum < 0,
        max_abs_diff=max_abs_diff,
        token_kl=tokens if per_token else None,
        offsets=offsets,
    )


def sequence_kl(
    policy_logprobs: Sequence[float],
    ref_logprobs: Sequence[float],
    estimator: Estimator = "k1",
    aggregate: Aggregate = "mean",
    clamp: bool = True,
    exact: Sequence[float] | None = None,
) -> float:
    """The KL of one response; the defaults are the original controller's `compute_kl_from_logprobs`.

    With `estimator="full"`, `exact` holds each token's exact KL(π ‖ π_ref) over the vocabulary.
    """
    if len(policy_logprobs) != len(ref_logprobs):
        raise ValueError(f"policy_logprobs has {len(policy_logprobs)} tokens but ref_logprobs has {len(ref_logprobs)}")
    offsets = np.array([0, len(policy_logprobs)])
    policy = np.asarray(policy_logprobs, dtype=np.float64)
    ref = np.asarray(ref_logprobs, dtype=np.float64)
    values = None if exact is None else np.asarray(exact, dtype=np.float64)
    return float(row_kl(policy, ref, offsets, estimator, aggregate, clamp, exact=values).kl[0])


def kl_divergence(policy_probs: Sequence[float], reference_probs: Sequence[float]) -> float:
    """KL(P ‖ Q) = Σ p·log(p/q) in nats between two discrete distributions, floored at 0.

    As in the original controller, only terms where both probabilities are positive count: mass the policy puts
    where the reference has none is ignored rather than making the result infinite.
    """
    p = np.asarray(policy_probs, dtype=np.float64)
    q = np.asarray(reference_probs, dtype=np.float64)
    if p.shape != q.shape:
        raise ValueError(f"distributions must have the same length, got {p.size} and {q.size}")
    both = (p > 0) & (q > 0)
    p, q = p[both], q[both]
    # log p − log q rather than log(p/q): the ratio overflows when q is tiny (the original controller then says inf).
    return max(0.0, float(np.sum(p * (np.log(p) - np.log(q)))))


class Encoder(Protocol):
    """What estimate_kl_from_samples reads of a tokenizer."""

    def encode(self, text: str) -> Iterable[int]: ...


def estimate_kl_from_samples(
    policy_samples: Iterable[str],
    reference_samples: Iterable[str],
    tokenizer: Encoder,
) -> float:
    """A rough KL between two sets of texts from their smoothed token frequencies (for debugging).

    `tokenizer` is anything with `encode(text) -> list of token ids`. Each side's counts are
    smoothed over the union of tokens seen on either side, as the original controller does.
    """
    policy_counts = Counter(token for text in policy_samples for token in tokenizer.encode(text))
    reference_counts = Counter(token for text in reference_samples for token in tokenizer.encode(text))
    vocabulary = list(policy_counts.keys() | reference_counts.keys())
    if not vocabulary:
        return 0.0
    policy = np.array([policy_counts[t] for t in vocabulary], dtype=np.float64)
    reference = np.array([reference_counts[t] for t in vocabulary], dtype=np.float64)
    smoothing_mass = SAMPLE_SMOOTHING * len(vocabulary)
    p = (policy + SAMPLE_SMOOTHING) / (policy.sum() + smoothing_mass)
    q = (reference + SAMPLE_SMOOTHING) / (reference.sum() + smoothing_mass)
    return max(0.0, float(np.sum(p * (np.log(p) - np.log(q)))))
