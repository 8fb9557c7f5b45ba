"""Token-budget batching: pure index logic."""

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from klpipe.precompute.length_batches import padding_efficiency, plan_batches


@given(st.lists(st.integers(0, 300), min_size=0, max_size=60), st.integers(1, 2000))
@settings(max_examples=200, deadline=None)
def test_every_row_lands_in_exactly_one_batch_within_budget(lengths, budget):
    batches = plan_batches(lengths, budget)
    flat = sorted(int(i) for b in batches for i in b)
    assert flat == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) >= 1
        longest = max(max(lengths[i] for i in batch), 1)
        # Only a single row may exceed the budget: it cannot be split.
        assert len(batch) * longest <= budget or len(batch) == 1


def test_rows_are_grouped_longest_first():
    lengths = [5, 100, 7, 90, 6, 95]
    batches = plan_batches(lengths, 190, batch_cost=12)
    # Padding the short rows up to 90 would cost more than a third forward pass.
    assert [[lengths[i] for i in b] for b in batches] == [[100], [95, 90], [7, 6, 5]]


def brute_force_cost(sorted_lengths, max_tokens, batch_cost):
    """Least padded tokens + batch_cost per batch over every split of the sorted rows."""
    n = len(sorted_lengths)
    best = None
    for mask in range(1 << max(n - 1, 0)):
        cuts = [0] + [i + 1 for i in range(n - 1) if mask >> i & 1] + [n]
        cost = 0
        for a, b in itertools.pairwise(cuts):
            padded = (b - a) * max(sorted_lengths[a], 1)
            if padded > max_tokens and b - a > 1:
                break
            cost += padded + batch_cost
        else:
            best = cost if best is None else min(best, cost)
    return best


@given(st.lists(st.integers(0, 50), min_size=1, max_size=9), st.integers(1, 120), st.integers(0, 40))
@settings(max_examples=300, deadline=None)
def test_plan_is_optimal_against_brute_force(lengths, budget, batch_cost):
    batches = plan_batches(lengths, budget, batch_cost=batch_cost)
    cost = sum(len(b) * max(max(lengths[i] for i in b), 1) + batch_cost for b in batches)
    assert cost == brute_force_cost(sorted(lengths, reverse=True), budget, batch_cost)


def test_sorting_reduces_padding_against_input_order():
    rng = np.random.default_rng(0)
    lengths = np.exp(rng.uniform(np.log(16), np.log(512), size=500)).astype(int)
    real, padded = padding_efficiency(lengths, plan_batches(lengths, 4096))
    naive = [np.arange(i, min(i + 8, len(lengths))) for i in range(0, len(lengths), 8)]
    _, naive_padded = padding_efficiency(lengths, naive)
    assert real / padded > 0.9
    assert padded < naive_padded
