"""Token-budget batching: pure index logic, plus order restoration through a fake model."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from klpipe.precompute.batching import (
    group_by_prompt,
    padding_efficiency,
    plan_batches,
    plan_shared,
)
from klpipe.precompute.logprobs import ForwardStats, chunk_logprobs
from tests.helpers import tokenized_chunk


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
        for a, b in zip(cuts, cuts[1:]):
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


class FakeModel:
    """Scores response token t of a row whose prompt is p as -(t + p[0]/100)/1000, so every logprob says
    which token, row and prompt it came from. The shared path also checks its calling contract."""

    prefill_skips_layers = False  # like a Llama: auto shares only prompts that repeat

    def __init__(self):
        self.batch_sizes = []
        self.prefills = []

    def score_batch(self, rows, temperature=1.0):
        self.batch_sizes.append(len(rows))
        return [self._values(p, r) for p, r in rows]

    def score_shared(self, prompts, responses, prompt_of, passes, temperature=1.0):
        self.prefills.append(len(prompts))
        fed = sorted(int(i) for p in passes for i in p)
        # Every row with a token to feed (two or more response tokens) is in exactly one pass.
        assert fed == [i for i, r in enumerate(responses) if len(r) >= 2]
        assert sorted(set(int(g) for g in prompt_of)) == list(range(len(prompts)))
        return [self._values(prompts[g], r) for g, r in zip(prompt_of, responses)]

    @staticmethod
    def _values(prompt, response):
        return -((np.asarray(response, dtype=np.float32) + np.float32(prompt[0] / 100)) / np.float32(1000))


def _tokenized(prompts, responses):
    return tokenized_chunk(list(zip(prompts, responses)))


@given(st.lists(st.tuples(st.integers(0, 4), st.integers(1, 3), st.integers(0, 40)), min_size=1, max_size=30),
       st.integers(1, 300), st.sampled_from(["auto", "on", "off"]), st.booleans())
@settings(max_examples=150, deadline=None)
def test_results_come_back_in_input_order(shapes, budget, sharing, skips_layers):
    # Rows draw their prompt from 15 (token, length) kinds, so prompts repeat, in any order.
    prompts = [[kind + 1] * (13 * length) for kind, length, _ in shapes]
    responses = [list(range(10 * i, 10 * i + r)) for i, (_, _, r) in enumerate(shapes)]
    model = FakeModel()
    model.prefill_skips_layers = skips_layers
    stats = ForwardStats()
    results = chunk_logprobs(model, _tokenized(prompts, responses), budget, 1.0, sharing, stats)
    for prompt, response, values in zip(prompts, responses, results):
        np.testing.assert_array_equal(values, FakeModel._values(prompt, response))
    repeated = [sum(p == q for q in prompts) > 1 for p in prompts]
    if sharing == "auto" and skips_layers:
        sharing = "on"  # where the prefill skips layers, auto sends every row through it
    alone = {"off": len(shapes), "on": 0, "auto": repeated.count(False)}[sharing]
    assert sum(model.batch_sizes) == alone
    assert stats.shared_rows == len(shapes) - alone
    assert stats.prompt_tokens == sum(len(p) for p in prompts)
    distinct = {tuple(p) for p, shared in zip(prompts, repeated) if shared or sharing == "on"}
    if sharing != "off":
        # Each shared prompt is fed once: every other row of its group reuses it.
        reused = sum(len(p) for p, shared in zip(prompts, repeated) if shared or sharing == "on")
        assert stats.prompt_tokens_reused == reused - sum(len(p) for p in distinct)
        assert sum(model.prefills) == len(distinct)  # one prefill row per distinct shared prompt
    else:
        assert stats.prompt_tokens_reused == 0 and not model.prefills


def test_group_by_prompt_groups_identical_ids_wherever_they_are():
    prompts = [[5, 6], [7], [5, 6], [5, 6, 0], [7], [5]]
    chunk = _tokenized(prompts, [[]] * len(prompts))
    group_of_row, first_row = group_by_prompt(chunk.prompt_ids, chunk.prompt_offsets)
    # Numbered by first appearance; a prompt that merely starts like another is its own group.
    assert group_of_row.tolist() == [0, 1, 0, 2, 1, 3]
    assert first_row.tolist() == [0, 1, 3, 5]


@given(st.lists(st.integers(1, 120), min_size=1, max_size=12), st.data(), st.integers(1, 400))
@settings(max_examples=200, deadline=None)
def test_shared_plan_covers_every_row_once_within_budget(prompt_lengths, data, budget):
    groups = len(prompt_lengths)
    group_of_row = np.array(data.draw(st.lists(st.integers(0, groups - 1), min_size=groups, max_size=60)) +
                            list(range(groups)))  # every group has a row
    response_lengths = np.array(data.draw(st.lists(st.integers(0, 50), min_size=len(group_of_row),
                                                   max_size=len(group_of_row))))
    batches = plan_shared(prompt_lengths, response_lengths, group_of_row, budget)
    assert sorted(g for b in batches for g in b.groups.tolist()) == list(range(groups))
    assert sorted(r for b in batches for r in b.rows.tolist()) == list(range(len(group_of_row)))
    for batch in batches:
        assert set(group_of_row[batch.rows].tolist()) == set(batch.groups.tolist())
        longest = max(prompt_lengths[g] for g in batch.groups)
        # A prefill fits the budget unless it is one prompt longer than the budget.
        assert len(batch.groups) * longest <= budget or len(batch.groups) == 1
        fed = sorted(r for p in batch.passes for r in p.tolist())
        assert fed == sorted(r for r in batch.rows.tolist() if response_lengths[r] >= 2)
        for p in batch.passes:
            # A pass feeds its rows' tokens and holds their prompt positions (padded to the batch's
            # longest), each position charged at 1/8 of a token, rounded up.
            cost = len(p) * (-(-longest // 8) + max(response_lengths[r] - 1 for r in p))
            assert cost <= budget or len(p) == 1
