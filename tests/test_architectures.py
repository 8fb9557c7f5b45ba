"""The architecture matrix (tests/architectures.py) against an fp64 forward, in every --prefix-sharing mode, on
rows shaped like an agent's: a system prompt longer than every sliding window and attention chunk, GRPO
groups, multi-turn chains stored a row per turn, duplicates, responses of 0 and 1 tokens.

The fast half runs in `make test`; the rest is marked `arch` and runs in `make test-arch`.
"""

import numpy as np
import pytest

from klpipe.model import ModelSpec, ReferenceModel
from klpipe.precompute.logprobs import ForwardStats, check_tree, chunk_logprobs
from tests.architectures import ARCHITECTURES, FAST, LONG_ROPE_LIMIT, WINDOW, save_tiny
from tests.helpers import Fp64Oracle

TOLERANCE = 1e-4  # beyond the fp32 oracle's own error against fp64
HYBRIDS = {"qwen3_5", "qwen3_next", "lfm2", "nemotron_h", "falcon_h1"}  # layers that continue from a state


def marked(names):
    return [pytest.param(n, marks=() if n in FAST else pytest.mark.arch) for n in names]


@pytest.fixture(scope="module", params=marked(sorted(ARCHITECTURES)))
def tiny(request, tmp_path_factory):
    directory = save_tiny(request.param, tmp_path_factory.mktemp(request.param))
    reference = ReferenceModel.load(ModelSpec(str(directory), dtype="float32", device="cpu"))
    return request.param, reference, Fp64Oracle(reference.model)


def agent_rows(vocab: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """An agent's chunk, shuffled. Rows run from 3 to ~130 tokens: on both sides of Phi-3's LongRoPE limit."""
    rng = np.random.default_rng(seed)

    def tokens(n):
        return rng.integers(3, vocab, n)

    system = tokens(2 * WINDOW + 5)  # longer than every window and chunk, in every row but two
    rows = []
    for task_len, responses in ((3, [0, 1, 2, 3 * WINDOW]), (WINDOW + 5, [7, 7, 40]), (1, [9])):
        task = np.concatenate([system, tokens(task_len)])
        rows += [(task, tokens(n)) for n in responses]  # GRPO groups; responses of 0 and 1 tokens
    rows.append((system.copy(), tokens(5)))  # a row whose prompt is the bare system prompt
    rows.append((system[:WINDOW + 2], tokens(4)))  # a prompt that is a strict prefix of every other prompt
    turn = (np.concatenate([system, tokens(6)]), tokens(2 * WINDOW))
    for _ in range(3):  # a trajectory stored a row per turn: each prompt holds the whole history
        rows.append(turn)
        turn = (np.concatenate([*turn, tokens(4)]), tokens(WINDOW + 1))
    rows.append(rows[0])  # duplicates
    rows.append(rows[-2])
    rows.append((tokens(11), tokens(6)))  # shares nothing
    rows.append((tokens(2), tokens(1)))  # a row of 3 tokens
    order = rng.permutation(len(rows))
    return [rows[i] for i in order]


def test_the_probe_accepts_every_architecture_and_the_model_is_not_trivial(tiny):
    name, reference, oracle = tiny
    assert check_tree(reference) is None
    assert reference.keeps_state == (name in HYBRIDS)
    # The body is the decoder, never the whole model (Llama 4's get_decoder() and base_model are the model).
    assert reference.body is not reference.model and reference.model.get_output_embeddings() not in \
        list(reference.body.modules())
    # Weights large enough that logprobs spread over nats: a wrong computation cannot hide near log(1/V).
    rows = agent_rows(reference.vocab_size, seed=3)[:6]
    values = np.concatenate(chunk_logprobs(reference, rows, 10_000, 1.0, "off", ForwardStats()))
    assert values.max() - values.min() > 4 and values.std() > 0.5


@pytest.mark.parametrize("sharing, max_tokens, max_cache", [
    ("off", 96, 10**9), ("auto", 96, 10**9), ("on", 96, 10**9), ("on", 24, 40)],
    ids=["off", "auto", "on", "on-tiny-budgets"])
def test_every_mode_matches_the_fp64_oracle(tiny, sharing, max_tokens, max_cache):
    name, reference, oracle = tiny
    rows = agent_rows(reference.vocab_size)
    stats = ForwardStats()
    results = chunk_logprobs(reference, rows, max_tokens, 1.0, sharing, stats, max_cache_tokens=max_cache)
    ours, own = oracle.errors(rows, results)
    assert ours <= own + TOLERANCE, f"{name}: {ours:.3g} against the fp32 oracle's {own:.3g}"
    with_response = sum(len(r) > 0 for _, r in rows)
    if sharing == "off":
        assert stats.tree_rows == 0 and stats.fed_tokens == stats.per_row_tokens
        return
    # Rows share their system prompt and histories through the tree (all but the few that share nothing
    # worth a pass, under auto), and far fewer tokens are fed than rows run whole.
    limit = reference.rope_length_limit
    within = [i for i, (p, r) in enumerate(rows) if len(r) and (limit is None or len(p) + len(r) - 1 <= limit)]
    assert len(within) - 3 <= stats.tree_rows <= len(within)
    if limit is None:
        assert stats.fed_tokens < 0.6 * stats.per_row_tokens
    else:  # Phi-3: rows past the LongRoPE limit run whole, with each other; the rest share
        assert name == "phi3" and limit == LONG_ROPE_LIMIT and 6 <= len(within) < with_response
        assert stats.fed_tokens < stats.per_row_tokens - 100


def test_every_mode_matches_with_temperature(tiny):
    name, reference, oracle = tiny
    rows = agent_rows(reference.vocab_size, seed=1)
    for sharing in ("off", "on"):
        results = chunk_logprobs(reference, rows, 64, 1.5, sharing, ForwardStats())
        ours, own = oracle.errors(rows, results, temperature=1.5)
        assert ours <= own + TOLERANCE, f"{name} {sharing}: {ours:.3g} against the fp32 oracle's {own:.3g}"
