"""Prefix sharing against the naive fp32 oracle: a prompt run once must give every row of its group
the logprobs that a full forward of that row alone gives, to 1e-4, on the tiny Llama and on the tiny
Gemma 4 (softcap, sliding window of 8 and full attention, KV-shared layers, per-layer inputs)."""

import numpy as np
import pytest

from klpipe.model.loading import ModelSpec
from klpipe.model.reference import ReferenceModel
from klpipe.precompute.logprobs import ForwardStats, chunk_logprobs
from tests.helpers import TINY_GEMMA, TINY_LLAMA, oracle_logprobs, tokenized_chunk

TOLERANCE = 1e-4
WINDOW = 8  # the tiny Gemma's sliding window; the Llama has none, the shapes serve both


@pytest.fixture(scope="module", params=["gemma4", "llama"])
def reference(request):
    path = {"gemma4": TINY_GEMMA, "llama": TINY_LLAMA}[request.param]
    model = ReferenceModel.load(ModelSpec(str(path), dtype="float32", device="cpu"))
    if request.param == "gemma4":
        assert model.model.config.sliding_window == WINDOW and model.model.config.num_kv_shared_layers > 0
    return model


def grpo_rows(vocab: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Groups of rows sharing a prompt, shuffled so that no group is contiguous."""
    rng = np.random.default_rng(seed)
    groups = {
        # prompt length: response lengths
        5 * WINDOW + 3: [0, 1, 2, 3 * WINDOW, 40],  # a long prompt; responses of 0 and 1 tokens, and very different lengths
        3: [7, 1, 25],  # a prompt shorter than the window; responses crossing it
        WINDOW - 1: [9, 9],  # same lengths, different tokens
        12: [6],  # a group of one
        2 * WINDOW + 1: [WINDOW + 1, 0],
    }
    rows = []
    for prompt_len, response_lens in groups.items():
        prompt = rng.integers(0, vocab, prompt_len)
        rows += [(prompt, rng.integers(0, vocab, n)) for n in response_lens]
    order = rng.permutation(len(rows))
    return [rows[i] for i in order]


def worst_error(reference, rows, results) -> float:
    worst = 0.0
    for (prompt, response), values in zip(rows, results):
        expected = oracle_logprobs(reference.model, prompt, response)
        assert values.dtype == np.float32 and values.shape == expected.shape
        if len(expected):
            worst = max(worst, float(np.max(np.abs(values - expected))))
    return worst


@pytest.mark.parametrize("sharing", ["on", "auto"])
@pytest.mark.parametrize("max_tokens", [16, 96, 100_000], ids=["prompts-over-budget", "mixed", "one-batch"])
def test_shared_prompts_match_oracle(reference, sharing, max_tokens):
    rows = grpo_rows(reference.vocab_size)
    prefills = []
    score_shared = reference.score_shared

    def recording(prompts, *args, **kwargs):
        prefills.append(sorted(len(p) for p in prompts))
        return score_shared(prompts, *args, **kwargs)

    reference.score_shared = recording
    try:
        stats = ForwardStats()
        results = chunk_logprobs(reference, tokenized_chunk(rows), max_tokens, 1.0, sharing, stats)
    finally:
        del reference.score_shared
    assert worst_error(reference, rows, results) <= TOLERANCE
    # Each prompt ran once.
    prompt_lengths = sorted(length for batch in prefills for length in batch)
    # A group of one gets a prefill of its own under "on", and under "auto" where the prefill skips layers.
    alone_prefilled = sharing == "on" or reference.prefill_skips_layers
    expected = [3, WINDOW - 1, 2 * WINDOW + 1, 5 * WINDOW + 3] + ([12] if alone_prefilled else [])
    assert prompt_lengths == sorted(expected)
    if max_tokens == 100_000:
        assert len(prefills) == 1  # groups with four different prompt lengths in one left-padded batch
    if max_tokens == 16:
        assert all(len(batch) == 1 for batch in prefills if batch[0] > 16)  # a prompt over the budget runs alone
    reused = (5 - 1) * (5 * WINDOW + 3) + (3 - 1) * 3 + (2 - 1) * (WINDOW - 1) + (2 - 1) * (2 * WINDOW + 1)
    assert stats.prompt_tokens_reused == reused
    assert stats.shared_rows == len(rows) - (not alone_prefilled)


def test_shared_and_per_row_paths_agree_with_temperature(reference):
    rows = grpo_rows(reference.vocab_size, seed=1)
    shared = chunk_logprobs(reference, tokenized_chunk(rows), 100_000, 1.5, "on", ForwardStats())
    per_row = chunk_logprobs(reference, tokenized_chunk(rows), 100_000, 1.5, "off", ForwardStats())
    for (prompt, response), a, b in zip(rows, shared, per_row):
        expected = oracle_logprobs(reference.model, prompt, response, temperature=1.5)
        if len(expected):
            assert np.max(np.abs(a - expected)) <= TOLERANCE
            assert np.max(np.abs(b - expected)) <= TOLERANCE


def test_probe_accepts_both_tiny_models(reference):
    assert reference.check_prefix_sharing() is None


def test_only_gemma_prefill_skips_layers(reference):
    # Gemma 4's KV-shared layers run on the prompt's last position alone; a Llama has no such layers.
    is_gemma = type(reference.model).__name__.startswith("Gemma4")
    assert reference.prefill_skips_layers == is_gemma


def test_probe_refuses_a_model_whose_forward_ignores_the_cache(reference, monkeypatch):
    # Both tiny models accept unknown keyword arguments and drop them: a cache passed under a name
    # the model does not know is silently ignored, the responses then run without their prompt.
    monkeypatch.setattr(reference, "cache_argument", "not_a_cache_argument")
    problem = reference.check_prefix_sharing()
    assert problem is not None and problem.startswith("continuing a prompt's KV cache changes the logprobs")
