import math

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from klpipe.arrow import list_values
from klpipe.score.kl import estimate_kl_from_samples, kl_divergence, row_kl, sequence_kl
from tests.helpers import load_seed

LOGPROB = st.floats(min_value=-30, max_value=0, allow_nan=False, width=32)
ROWS = st.lists(st.lists(st.tuples(LOGPROB, LOGPROB), max_size=8), max_size=12)


def python_token_kl(policy: float, ref: float, estimator: str) -> float:
    d = policy - ref
    return {
        "k1": d,
        "abs": abs(d),
        "k2": 0.5 * d * d,
        "k3": math.exp(ref - policy) - (ref - policy) - 1,
    }[estimator]


def python_row_kl(pairs, estimator, aggregate, clamp) -> float:
    """Straightforward per-row oracle, written from the issue's definitions."""
    if not pairs:
        return 0.0
    total = sum(python_token_kl(p, r, estimator) for p, r in pairs)
    value = total / len(pairs) if aggregate == "mean" else total
    return max(0.0, value) if (estimator == "k1" and clamp) else value


def arrow_row_kl(policy: pa.Array, ref: pa.Array, *args, **kwargs):
    """row_kl over two list columns, as `klpipe score` feeds it (which first checks that the offsets agree)."""
    policy_values, offsets = list_values(policy)
    ref_values, _ = list_values(ref)
    return row_kl(policy_values, ref_values, offsets, *args, **kwargs)


def as_arrow(rows):
    policy = pa.array([[p for p, _ in row] for row in rows], pa.list_(pa.float32()))
    ref = pa.array([[r for _, r in row] for row in rows], pa.list_(pa.float32()))
    return policy, ref


@settings(max_examples=60, deadline=None)
@given(
    rows=ROWS,
    estimator=st.sampled_from(["k1", "abs", "k2", "k3"]),
    aggregate=st.sampled_from(["mean", "sum"]),
    clamp=st.booleans(),
)
def test_estimators_match_their_definitions(rows, estimator, aggregate, clamp):
    policy, ref = as_arrow(rows)
    result = arrow_row_kl(policy, ref, estimator, aggregate, clamp)
    expected = [python_row_kl(row, estimator, aggregate, clamp) for row in rows]
    np.testing.assert_allclose(result.kl, expected, rtol=1e-9, atol=1e-9)
    if estimator in ("abs", "k2", "k3") or clamp:
        assert (result.kl >= 0).all()


@settings(max_examples=40, deadline=None)
@given(rows=ROWS)
def test_diagnostics_negative_k1_and_largest_gap(rows):
    policy, ref = as_arrow(rows)
    result = arrow_row_kl(policy, ref)
    assert result.negative_k1.tolist() == [sum(p - r for p, r in row) < 0 for row in rows]
    assert result.max_abs_diff.tolist() == pytest.approx(
        [max((abs(p - r) for p, r in row), default=0.0) for row in rows]
    )


def test_k1_clamp_is_the_default_and_can_be_turned_off():
    policy, ref = as_arrow([[(-2.0, -1.0)], [(-1.0, -2.0)]])
    assert arrow_row_kl(policy, ref).kl.tolist() == [0.0, 1.0]
    assert arrow_row_kl(policy, ref, clamp=False).kl.tolist() == [-1.0, 1.0]
    assert arrow_row_kl(policy, ref).negative_k1.tolist() == [True, False]


def test_sliced_arrays_use_only_their_own_rows():
    rows = [
        [(-1.0, -3.0)],
        [(-0.5, -1.0), (-0.25, -0.5)],
        [],
        [(-4.0, -1.0), (-1.0, -2.0), (0.0, -8.0)],
        [(-1.0, -1.5)],
    ]
    policy, ref = as_arrow(rows)
    # Slices with different offsets on each side: the reference slice starts at another token position.
    sliced = arrow_row_kl(policy.slice(1, 3), ref.slice(1, 3), aggregate="sum", clamp=False, per_token=True)
    assert sliced.kl.tolist() == [0.75, 0.0, 6.0]
    assert sliced.offsets.tolist() == [0, 2, 2, 5]
    assert sliced.token_kl.tolist() == [0.5, 0.25, -3.0, 1.0, 8.0]


def test_empty_rows_and_empty_arrays_give_zero():
    policy, ref = as_arrow([[], [], []])
    assert arrow_row_kl(policy, ref, estimator="k3").kl.tolist() == [0.0, 0.0, 0.0]
    empty_policy, empty_ref = as_arrow([])
    result = arrow_row_kl(empty_policy, empty_ref)
    assert result.kl.shape == (0,) and result.max_abs_diff.shape == (0,)
    # An empty slice of a non-empty array.
    policy, ref = as_arrow([[(-1.0, -2.0)], [(-1.0, -3.0)]])
    assert arrow_row_kl(policy.slice(1, 0), ref.slice(1, 0)).kl.shape == (0,)


def test_chunked_arrays_are_combined():
    policy = pa.chunked_array(
        [pa.array([[-1.0]], pa.list_(pa.float32())), pa.array([[-2.0, -2.0]], pa.list_(pa.float32()))]
    )
    ref = pa.chunked_array([pa.array([[-2.0], [-3.0, -4.0]], pa.list_(pa.float32()))])
    assert arrow_row_kl(policy, ref).kl.tolist() == [1.0, 1.5]


def test_k3_is_accurate_for_tiny_gaps():
    # exp(-d) - 1 + d cancels badly in float64 near d = 0; the exact value is d²/2 - d³/6 + ...
    d = 1e-6
    value = row_kl(np.array([d]), np.array([0.0]), np.array([0, 1]), estimator="k3").kl[0]
    assert value == pytest.approx(d * d / 2 - d**3 / 6, rel=1e-9)


def test_per_token_values_follow_the_estimator():
    policy, ref = as_arrow([[(-1.0, -3.0), (-2.0, -1.0)]])
    assert arrow_row_kl(policy, ref, estimator="k2", per_token=True).token_kl.tolist() == [2.0, 0.5]
    assert arrow_row_kl(policy, ref).token_kl is None


@settings(max_examples=40, deadline=None)
@given(pairs=st.lists(st.tuples(LOGPROB, LOGPROB), max_size=10))
def test_sequence_kl_is_the_seeds_compute_kl_from_logprobs(pairs):
    seed = load_seed().KLControllerBase(load_seed().KLConfig(reference_model_name="test"))
    policy, ref = [p for p, _ in pairs], [r for _, r in pairs]
    assert sequence_kl(policy, ref) == pytest.approx(seed.compute_kl_from_logprobs(policy, ref), rel=1e-12, abs=1e-12)


def test_full_aggregates_the_exact_values_with_no_clamp_and_keeps_the_diagnostics():
    # Two rows: k1 says −1 (and would clamp to 0), the exact values 0.5 and 1.5; an empty row; one of 4.
    policy, ref = np.array([-3.0, -1.0, -2.0]), np.array([-1.0, -1.0, -1.0])
    offsets = np.array([0, 2, 2, 3])
    exact = np.array([0.5, 1.5, 4.0], np.float32)
    mean = row_kl(policy, ref, offsets, estimator="full", exact=exact, per_token=True)
    assert mean.kl.tolist() == [1.0, 0.0, 4.0] and mean.token_kl.tolist() == [0.5, 1.5, 4.0]
    assert mean.negative_k1.tolist() == [True, False, True] and mean.max_abs_diff.tolist() == [2.0, 0.0, 1.0]
    assert row_kl(policy, ref, offsets, "full", "sum", exact=exact).kl.tolist() == [2.0, 0.0, 4.0]
    assert sequence_kl([-3.0, -1.0], [-1.0, -1.0], "full", exact=[0.5, 1.5]) == 1.0
    with pytest.raises(ValueError, match=r"the full estimator needs exact= with one value per token \(3\), got none"):
        row_kl(policy, ref, offsets, estimator="full")
    with pytest.raises(ValueError, match=r"one value per token \(3\), got 2 values"):
        row_kl(policy, ref, offsets, estimator="full", exact=exact[:2])


def test_sequence_kl_refuses_unequal_lengths():
    with pytest.raises(ValueError, match="policy_logprobs has 2 tokens but ref_logprobs has 1"):
        sequence_kl([-1.0, -2.0], [-1.0])


# Either zero or not tiny: below ~1e-300 the seed's p/q overflows to inf, where klpipe stays finite.
PROBS = st.lists(st.one_of(st.just(0.0), st.floats(min_value=1e-200, max_value=1)), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(p=PROBS, q=PROBS)
def test_kl_divergence_matches_the_seed(p, q):
    n = min(len(p), len(q))
    p, q = p[:n], q[:n]
    assert kl_divergence(p, q) == pytest.approx(load_seed().compute_kl_divergence(p, q), rel=1e-9, abs=1e-12)


def test_kl_divergence_known_values():
    assert kl_divergence([0.5, 0.5], [0.5, 0.5]) == 0.0
    assert kl_divergence([1.0, 0.0], [0.5, 0.5]) == pytest.approx(math.log(2))
    with pytest.raises(ValueError, match="same length"):
        kl_divergence([1.0], [0.5, 0.5])
    # The seed returns inf here, because 1.0 / 5e-324 overflows; the true value is finite.
    assert kl_divergence([1.0, 0.0], [5e-324, 1.0]) == pytest.approx(-math.log(5e-324))


class CharTokenizer:
    def encode(self, text):
        return [ord(c) for c in text]


@settings(max_examples=40, deadline=None)
@given(
    policy=st.lists(st.text("abcde", max_size=6), max_size=4),
    reference=st.lists(st.text("abcdef", max_size=6), max_size=4),
)
def test_estimate_kl_from_samples_matches_the_seed(policy, reference):
    expected = load_seed().estimate_kl_from_samples(policy, reference, CharTokenizer())
    assert estimate_kl_from_samples(policy, reference, CharTokenizer()) == pytest.approx(expected, rel=1e-9, abs=1e-12)
