"""The prefix tree against the naive fp32 oracle: every prefix computed once must give every row the
logprobs that a full forward of that row alone gives, to 1e-4, on the tiny Llama and on the tiny
Gemma 4 (softcap, sliding window of 8 and full attention, KV-shared layers, per-layer inputs)."""

import numpy as np
import pytest

from klpipe.model import ModelSpec, ReferenceModel
from klpipe.precompute import prefix_tree
from klpipe.precompute.logprobs import ForwardStats, check_tree, chunk_logprobs
from tests.helpers import TINY_GEMMA, TINY_LLAMA, agent_rows, worst_error

TOLERANCE = 1e-4
WINDOW = 8  # the tiny Gemma's sliding window; the Llama has none, the shapes serve both


@pytest.fixture(scope="module", params=["gemma4", "llama"])
def reference(request):
    path = {"gemma4": TINY_GEMMA, "llama": TINY_LLAMA}[request.param]
    model = ReferenceModel.load(ModelSpec(str(path), dtype="float32", device="cpu"))
    assert model.use_cascade() is None  # as a run that may share installs it (precompute/sharing.py)
    if request.param == "gemma4":
        assert model.model.config.sliding_window == WINDOW and model.model.config.num_kv_shared_layers > 0
    return model


@pytest.mark.parametrize("sharing", ["on", "auto"])
@pytest.mark.parametrize("max_tokens, max_cache", [(24, 40), (96, 10**9), (100_000, 10**9)],
                         ids=["tiny-budgets", "mixed", "one-pass"])
def test_the_tree_matches_the_oracle(reference, sharing, max_tokens, max_cache):
    rows = agent_rows(reference.vocab_size)
    stats = ForwardStats()
    results = chunk_logprobs(reference, rows, max_tokens, 1.0, sharing, stats, max_cache_tokens=max_cache)
    assert worst_error(reference.model, rows, results) <= TOLERANCE
    # What was fed: each distinct prefix once (and the one unrelated row whole), far less than per row.
    per_row = sum(len(p) + len(r) - 1 for p, r in rows if len(r))
    assert stats.per_row_tokens == per_row
    distinct = len({tuple(np.concatenate([p, r[:-1]])[:k]) for p, r in rows if len(r)
                    for k in range(1, len(p) + len(r))})
    assert distinct <= stats.fed_tokens < per_row / 3
    with_response = sum(len(r) > 0 for _, r in rows)
    if sharing == "on" or reference.prefill_skips_layers:  # Gemma 4: auto runs every row through the tree
        assert stats.tree_rows == with_response
    else:  # the row that shares nothing, and the one whose prompt is 10 tokens anyone shares, run whole
        assert with_response - 3 <= stats.tree_rows < with_response


def test_the_tree_and_the_per_row_path_agree_with_temperature(reference):
    rows = agent_rows(reference.vocab_size, seed=1)
    tree = chunk_logprobs(reference, rows, 100_000, 1.5, "on", ForwardStats())
    per_row = chunk_logprobs(reference, rows, 100_000, 1.5, "off", ForwardStats())
    assert worst_error(reference.model, rows, tree, temperature=1.5) <= TOLERANCE
    assert worst_error(reference.model, rows, per_row, temperature=1.5) <= TOLERANCE


def test_shuffled_rows_give_the_same_numbers(reference):
    rows = agent_rows(reference.vocab_size, seed=2)
    order = np.random.default_rng(5).permutation(len(rows))
    first = chunk_logprobs(reference, rows, 96, 1.0, "on", ForwardStats())
    shuffled = chunk_logprobs(reference, [rows[i] for i in order], 96, 1.0, "on", ForwardStats())
    for i, j in enumerate(order):
        np.testing.assert_allclose(shuffled[i], first[j], atol=TOLERANCE, rtol=0)


def test_the_probe_accepts_both_tiny_models(reference):
    assert check_tree(reference) is None


def test_only_gemma_prefill_skips_layers_and_the_tree_uses_it(reference, monkeypatch):
    is_gemma = type(reference.model).__name__.startswith("Gemma4")
    assert reference.prefill_skips_layers == is_gemma
    kept = []
    real = reference.body.forward

    def forward(*args, **kwargs):
        kept.append(kwargs.get("logits_to_keep"))
        return real(*args, **kwargs)

    monkeypatch.setattr(reference.body, "forward", forward)
    rows = agent_rows(reference.vocab_size)
    results = chunk_logprobs(reference, rows, 96, 1.0, "auto", ForwardStats())
    assert worst_error(reference.model, rows, results) <= TOLERANCE
    # Gemma 4 runs the nodes that need only their last output (the system prompt, tasks, a unique
    # row's prompt) with logits_to_keep=1, its KV-shared layers on that position alone.
    assert (1 in kept) == is_gemma


def test_the_probe_refuses_a_model_whose_forward_ignores_the_cache(reference, monkeypatch):
    # Both tiny models accept unknown keyword arguments and drop them: a cache passed under a name
    # the model does not know is silently ignored, and a node then runs without its context.
    monkeypatch.setattr(reference, "cache_argument", "not_a_cache_argument")
    assert check_tree(reference) == ("CacheIgnored: the model's forward wrote no keys, values or states into the cache "
                                     "it was given")


def test_rows_without_a_response_and_a_chunk_of_one(reference):
    rows = [(np.array([2, 5, 6]), np.array([], dtype=np.int64)), (np.array([2, 9]), np.array([4]))]
    for sharing in ("on", "auto", "off"):
        out = chunk_logprobs(reference, rows, 64, 1.0, sharing, ForwardStats())
        assert out[0].shape == (0,) and out[1].shape == (1,)
        assert worst_error(reference.model, rows, out) <= TOLERANCE


def test_the_kept_keys_and_values_respect_the_cache_budget(reference, monkeypatch):
    from klpipe.model.attention import tree as tree_module

    rows = agent_rows(reference.vocab_size)
    budget = 64  # tokens: below the system prompt's 75, so every subtree is too big as a whole
    peak = []
    real = tree_module._run_pass

    def run_pass(run, step, *args):
        real(run, step, *args)
        peak.append(sum(int(run.tree.end[n] - run.tree.start[n]) for n in run.kept))

    monkeypatch.setattr(tree_module, "_run_pass", run_pass)
    results = chunk_logprobs(reference, rows, 96, 1.0, "on", ForwardStats(), max_cache_tokens=budget)
    assert worst_error(reference.model, rows, results) <= TOLERANCE
    system = 9 * WINDOW + 3
    assert max(peak) <= system + budget  # the one node longer than the budget, plus at most the budget
    assert prefix_tree.HELD_POSITIONS_PER_TOKEN == 8


@pytest.mark.parametrize("fault", ["queries", "context"])
def test_the_probe_refuses_a_tree_that_changes_the_numbers(reference, monkeypatch, fault, request):
    from klpipe.model.attention import context_cache, lse_attention

    in_place = reference.cascade
    request.addfinalizer(reference.use_cascade)  # put back after the test: the probe may turn it off
    if fault == "queries" and in_place:
        # The Llama's full-attention layers attend in place (cascade.py): its own part made non-causal. The probe
        # turns the cascade off, and the tree passes again with its context gathered.
        attend = lse_attention.attend
        monkeypatch.setattr(lse_attention, "attend", lambda q, k, v, causal, scale: attend(q, k, v, False, scale))
        assert check_tree(reference) is None and not reference.cascade
        return
    if fault == "queries":
        # Queries placed three slots later than they are: the causal (and sliding) masks shift.
        monkeypatch.setattr(context_cache.ContextLayer, "get_seq_length", lambda layer: layer.full_length + 3)
    else:
        # Each kept node's keys one slot off from their values, as a wrong cut would pair them; both ways of
        # attending read them. (Rolling keys and values together is no fault for a row that sees its whole
        # context: attention sums over its slots.)
        state_of = context_cache.ContextCache.state_of

        def shifted(self, *args):
            kept = state_of(self, *args)
            for layer in kept:
                if layer.keys is not None:
                    layer.keys = layer.keys.roll(1, dims=-2)
            return kept

        monkeypatch.setattr(context_cache.ContextCache, "state_of", shifted)
    problem = check_tree(reference)
    assert problem is not None and problem.startswith("continuing a prefix's keys and values changes the logprobs")
    assert not reference.cascade  # probed both ways
