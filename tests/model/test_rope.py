"""RoPEs whose frequencies depend on the batch: one long row, or one pad's position, must not move the others.

transformers' long RoPE takes the long factors for the whole batch once any position passes
original_max_position_embeddings, and its dynamic RoPE recomputes (and keeps) its frequencies once
any position passes max_position_embeddings. So rows past the limit run only with each other, and
no pad ever carries a position beyond its row's own: on every path, against the one-row oracle.
"""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from klpipe.model import ModelSpec, ReferenceModel
from klpipe.precompute.logprobs import ForwardStats, chunk_logprobs
from tests.helpers import oracle_logprobs, worst_error

TOLERANCE = 1e-4
CONTEXT = 96
LIMIT = 32  # long RoPE: original_max_position_embeddings
ROPES = {
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                 "long_factor": [16.0] * 8, "original_max_position_embeddings": LIMIT},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
}


@pytest.fixture(scope="module", params=sorted(ROPES))
def model_dir(request, tmp_path_factory):
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                         rope_parameters=ROPES[request.param], tie_word_embeddings=False)
    torch.manual_seed(5)
    directory = tmp_path_factory.mktemp(request.param)
    LlamaForCausalLM(config).save_pretrained(directory)
    return request.param, directory


def mixed_rows(seed=0):
    """Groups that share prompts, with rows on both sides of the long RoPE's limit, fed up to CONTEXT - 1."""
    rng = np.random.default_rng(seed)
    rows = []
    for prompt_len, responses in ((70, [5, 20, 26]), (10, [80, 3, 12]), (25, [4, 9]), (6, [2]), (40, [50])):
        prompt = rng.integers(0, 512, prompt_len)
        rows += [(prompt, rng.integers(0, 512, n)) for n in responses]
    return rows


@pytest.mark.parametrize("sharing", ["off", "on", "auto"])
def test_rows_of_mixed_lengths_in_one_batch_match_the_oracle(model_dir, sharing):
    kind, directory = model_dir
    reference = ReferenceModel.load(ModelSpec(str(directory), dtype="float32", device="cpu"))
    limit = reference.rope_length_limit
    assert limit == {"longrope": LIMIT, "dynamic": CONTEXT}[kind]
    rows = mixed_rows()
    lengths = [len(p) + len(r) - 1 for p, r in rows]
    assert min(lengths) < LIMIT < max(lengths) < CONTEXT  # both sides of the long RoPE's limit
    results = chunk_logprobs(reference, rows, 100_000, 1.0, sharing, ForwardStats())  # one batch, if allowed
    oracle_model = AutoModelForCausalLM.from_pretrained(directory).eval()
    assert worst_error(oracle_model, rows, results) <= TOLERANCE
    if kind == "dynamic":  # no position of any pass went past the context: the frequencies never grew
        assert reference.model.model.rotary_emb.max_seq_len_cached == CONTEXT


def test_a_long_row_beside_short_ones_would_change_them(model_dir):
    """The hazard is real on the long RoPE: the same short row, computed in a batch whose longest row passes
    the limit, gets other logprobs (why klpipe keeps such rows apart). The dynamic RoPE does not move
    for real rows, which all stay within the context; only a pad's position could push it."""
    kind, directory = model_dir
    reference = ReferenceModel.load(ModelSpec(str(directory), dtype="float32", device="cpu"))
    short, long = mixed_rows()[8], mixed_rows()[3]  # fed 7 and 89 tokens
    alone = reference.score_batch([short])[0]
    together = reference.score_batch([short, long])[0]
    gap = float(np.max(np.abs(alone - together)))
    if kind == "longrope":
        assert gap > 10 * TOLERANCE
    else:
        assert gap < 1e-6


@pytest.mark.parametrize("sharing", ["off", "on", "auto"])
def test_a_row_just_past_the_limit_is_fed_whole(model_dir, sharing):
    """A row's own forward takes the long RoPE's frequencies from the whole row. One of LIMIT + 1 tokens whose last
    token is only a target, or a longer one whose masked tail is never scored, would be fed LIMIT tokens or fewer and
    get the short frequencies: every logprob silently wrong. So such rows are fed whole."""
    kind, directory = model_dir
    reference = ReferenceModel.load(ModelSpec(str(directory), dtype="float32", device="cpu"))
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 512, 20)
    rows = [(prompt, rng.integers(0, 512, LIMIT + 1 - 20)),  # LIMIT + 1 tokens: fed LIMIT, less its last
            (prompt, rng.integers(0, 512, LIMIT + 6 - 20)),  # its last 8 tokens a tool's: fed LIMIT - 3
            (prompt, rng.integers(0, 512, 5)),  # short, sharing the prompt
            (rng.integers(0, 512, 8), rng.integers(0, 512, 4))]
    needed = [np.ones(len(r), dtype=bool) for _, r in rows]
    needed[1][-8:] = False
    results = chunk_logprobs(reference, rows, 100_000, 1.0, sharing, ForwardStats(), needed=needed)
    oracle_model = AutoModelForCausalLM.from_pretrained(directory).eval()
    for (prompt_ids, response), got, need in zip(rows, results, needed, strict=True):
        expected = oracle_logprobs(oracle_model, prompt_ids, response)
        assert np.max(np.abs(got[need] - expected[need])) <= TOLERANCE, (kind, sharing)
        assert np.isnan(got[~need]).all()
