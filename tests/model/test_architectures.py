"""The architecture matrix (tests/architectures.py) against an fp64 forward, in every --prefix-sharing mode, on
rows shaped like an agent's: a system prompt longer than every sliding window and attention chunk, GRPO
groups, multi-turn chains stored a row per turn, duplicates, responses of 0 and 1 tokens.

The fast half runs in `make test`; the rest is marked `arch` and runs in `make test-arch`.
"""

import re

import numpy as np
import pytest

from klpipe.model import ModelSpec, ReferenceModel
from klpipe.precompute.logprobs import ForwardStats, check_tree, chunk_logprobs
from tests import helpers
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
    oracle = Fp64Oracle(reference.model)  # the model as loaded, before klpipe's attention
    reference.use_cascade()  # as a run that may share installs it (precompute/sharing.py)
    return request.param, reference, oracle


def agent_rows(vocab: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """An agent's chunk (helpers.agent_rows), a system prompt longer than every window and attention chunk. Rows
    run from 3 to ~130 tokens: on both sides of Phi-3's LongRoPE limit."""
    return helpers.agent_rows(vocab, seed, window=WINDOW, system=2 * WINDOW + 5, low=3, three_token_row=True)


def test_the_probe_accepts_every_architecture_and_the_model_is_not_trivial(tiny):
    name, reference, _oracle = tiny
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
    assert own < 1e-3  # the bound stays tight: fp32 rounding alone is far below any wrong computation
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


# -- a hybrid as a user runs it -------------------------------------------------------------------------


# Where the tree's attention layers attend over the context in place (klpipe/model/attention/cascade.py): every sdpa
# model with a full or sliding attention layer. GPT-OSS's sinks run eager; DeepSeek-V3's attention expands MLA latents
# from its cache, so it gets its context gathered.
IN_PLACE = {"falcon_h1", "gemma3", "lfm2", "llama", "llama4", "mistral", "nemotron_h", "phi3", "qwen3", "qwen3_5",
            "qwen3_moe", "qwen3_next"}
# Sliding-window layers take it too (window_cascade.py), where the family has them and attends by sdpa.
SLIDING_IN_PLACE = {"gemma3", "mistral"}


def test_full_attention_layers_attend_in_place_where_that_is_exact(tiny):
    from klpipe.model.attention import cascade

    name, reference, _ = tiny
    rows = agent_rows(reference.vocab_size, seed=5)
    cascade.CALLS.clear()
    chunk_logprobs(reference, rows, 96, 1.0, "on", ForwardStats())
    assert (cascade.CALLS["cascade"] > 0) == (name in IN_PLACE), dict(cascade.CALLS)
    assert (cascade.CALLS["window"] > 0) == (name in SLIDING_IN_PLACE), dict(cascade.CALLS)
    assert cascade.CALLS["gathered"] == 0
    # DeepSeek-V3's first pass hands the tree back to the gathered way; GPT-OSS never left eager attention.
    assert reference.cascade == (name not in {"deepseek_v3", "gpt_oss"})


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    return save_tiny("qwen3_5", tmp_path_factory.mktemp("qwen3_5-cli"))


def precompute(*args, env=None):
    from typer.testing import CliRunner

    from klpipe.cli import app

    return CliRunner().invoke(app, ["precompute", *map(str, args)], env={"KLPIPE_PROGRESS": "none", **(env or {})})


def cached_rows(path):
    import pyarrow.parquet as pq

    table = pq.read_table(path).to_pydict()
    rows = list(zip(table["prompt_ids"], table["response_ids"], strict=True))
    return rows, [np.asarray(v, dtype=np.float32) for v in table["ref_logprobs"]]


def test_a_hybrid_shares_prefixes_through_the_command_line(qwen3_5, tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.helpers import agent_rollouts

    agent = agent_rollouts(tmp_path / "agent.parquet", tasks=3, group=3, turns=3, system_tokens=40)
    oracle = Fp64Oracle(AutoModelForCausalLM.from_pretrained(qwen3_5, dtype="float32").eval())
    fed = {}
    for sharing in ("off", "auto", "on"):
        out = tmp_path / f"{sharing}.parquet"
        result = precompute("-m", qwen3_5, agent, "-o", out, "--device", "cpu", "--prefix-sharing", sharing)
        assert result.exit_code == 0, result.output
        assert "prefix sharing off" not in result.stderr
        fed[sharing] = int(re.search(r"fed ([\d,]+) tokens", result.stderr).group(1).replace(",", ""))
        ours, own = oracle.errors(*cached_rows(out))
        assert ours <= own + TOLERANCE
    assert fed["on"] == fed["auto"] < fed["off"] / 2  # the system prompt and the histories once


def test_a_layout_the_tree_does_not_know_falls_back_under_auto_and_is_refused_under_on(qwen3_5, tmp_path,
                                                                                      monkeypatch):
    from klpipe.model.attention import continuation

    monkeypatch.delitem(continuation.CONTINUATIONS, "linear_attention")
    rows = tmp_path / "rows.parquet"
    write_rows(rows, agent_rows(512)[:6])
    why = ("UnknownLayer: the prefix tree does not know how a 'linear_attention' cache layer (layer 0) "
           "continues a prefix")
    result = precompute("-m", qwen3_5, rows, "-o", tmp_path / "auto.parquet", "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert [line for line in result.stderr.splitlines() if "prefix sharing" in line] == [
        f"prefix sharing off: Qwen3_5ForCausalLM cannot share prefixes exactly ({why})"]
    result = precompute("-m", qwen3_5, rows, "-o", tmp_path / "on.parquet", "--device", "cpu",
                        "--prefix-sharing", "on")
    assert result.exit_code == 2
    # With the table's entry gone, nothing marks the layer as recurrent before the packed-rows probe, which
    # catches it (its state would run on from one row into the next) and says so on a line of its own.
    *notes, error = result.stderr.strip().splitlines()
    assert error == f"Error: --prefix-sharing on: Qwen3_5ForCausalLM cannot share prefixes exactly ({why})"
    assert all(note.startswith("Qwen3_5ForCausalLM: rows run whole go padded (packed rows disagree") for note in notes)


def test_rows_run_whole_ask_nothing_of_the_tree(qwen3_5, tmp_path, monkeypatch):
    from klpipe.model import ReferenceModel
    from klpipe.model.attention import context_cache, continuation

    def refuse(*args):
        raise AssertionError("--prefix-sharing off asked the prefix tree")

    monkeypatch.setattr(continuation, "layer_kinds", refuse)
    monkeypatch.setattr(context_cache, "cache_cost", refuse)
    monkeypatch.setattr(ReferenceModel, "kernel_note", "the kernel note")
    rows = tmp_path / "rows.parquet"
    write_rows(rows, agent_rows(512)[:6])
    result = precompute("-m", qwen3_5, rows, "-o", tmp_path / "off.parquet", "--device", "cpu",
                        "--prefix-sharing", "off")
    assert result.exit_code == 0, result.output
    assert result.stderr.count("the kernel note") == 1


def test_a_state_taken_before_a_nodes_pass_ends_is_refused(qwen3_5):
    """Pads after a node would enter its recurrent state: the planner keeps continued nodes the longest in
    their pass (exact_ends), and the tree refuses a plan that does not, rather than hand on a wrong state."""
    from klpipe.model.attention.tree import score_tree
    from klpipe.plan import Wanted
    from klpipe.precompute import prefix_tree

    reference = ReferenceModel.load(ModelSpec(str(qwen3_5), dtype="float32", device="cpu"))
    rng = np.random.default_rng(0)
    system = rng.integers(3, 512, 10)
    short, long = np.concatenate([system, [5, 6]]), np.concatenate([system, rng.integers(3, 512, 8)])
    rows = [(short, [7, 8]), (short, [9, 9]), (long, [4]), (long, [3])]  # two parents of 12 and 18 tokens
    fed = [np.concatenate([p, r[:-1]]) for p, r in rows]
    tree = prefix_tree.build_tree(fed)
    first = np.array([len(p) - 1 for p, _ in rows])
    need = prefix_tree.needs(tree, first)
    for exact_ends in (True, False):
        passes = prefix_tree.plan_passes(tree, need.only_last, 10_000, 10**9, split_by_need=False,
                                         exact_ends=exact_ends)
        if exact_ends:
            results = score_tree(reference, tree, passes, Wanted(first, first, [np.array(r) for _, r in rows]))
            assert len(results) == 4
        else:
            with pytest.raises(RuntimeError, match="a recurrent state was asked for at a node shorter than its pass"):
                score_tree(reference, tree, passes, Wanted(first, first, [np.array(r) for _, r in rows]))


def test_transformers_slow_fallbacks_are_named_for_the_log(qwen3_5):
    import importlib.util

    from tests.helpers import run_python

    if importlib.util.find_spec("fla") or importlib.util.find_spec("causal_conv1d"):
        pytest.skip("flash-linear-attention or causal-conv1d is installed: transformers falls back to nothing")
    code = ("import sys\nfrom klpipe.model import ModelSpec, ReferenceModel\n"
            "r = ReferenceModel.load(ModelSpec(sys.argv[1], dtype='float32', device='cpu'))\n"
            "print(r.slow_kernels, r.kernel_note)\nr.device = 'cuda:0'\nprint(r.kernel_note)")
    result = run_python(code, str(qwen3_5))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "('causal_conv1d', 'flash-linear-attention') None"
    assert lines[1] == ("Qwen3_5ForCausalLM's linear-attention, SSM or convolution layers run transformers' slow "
                        "reference code on this GPU: pip install causal_conv1d and flash-linear-attention for its "
                        "kernels")
    assert "falling back" not in result.stderr  # transformers' own warnings stay out of the log


def write_rows(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt_ids": [list(map(int, p)) for p, _ in rows],
                             "response_ids": [list(map(int, r)) for _, r in rows]}), path)


def test_the_hubs_qwen3_5_layout_loads_as_its_text_model_and_shares(tmp_path):
    """Qwen3.5's hub checkpoints are Qwen3_5ForConditionalGeneration (a vision tower beside the text model): klpipe
    loads the text model and head alone, held to the whole model's own forward, and its tree to fp64."""
    import shutil

    import torch
    import transformers

    from tests.architectures import TOKENIZER_FILES
    from tests.helpers import TINY_LLAMA

    config = transformers.Qwen3_5Config(
        text_config=ARCHITECTURES["qwen3_5"].config().to_dict(),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64))
    torch.manual_seed(0)
    whole = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    whole.save_pretrained(tmp_path)
    for file in TOKENIZER_FILES:
        shutil.copy(TINY_LLAMA / file, tmp_path / file)
    reference = ReferenceModel.load(ModelSpec(str(tmp_path), dtype="float32", device="cpu"))
    assert type(reference.model).__name__ == "Qwen3_5ForCausalLM" and reference.keeps_state
    rows = agent_rows(reference.vocab_size, seed=4)[:12]
    results = chunk_logprobs(reference, rows, 96, 1.0, "on", ForwardStats())
    worst = 0.0
    for (prompt, response), values in zip(rows, results, strict=True):
        if len(response):
            ids = torch.tensor([[*prompt, *response]])
            with torch.no_grad():
                logprobs = torch.log_softmax(whole(input_ids=ids).logits[0].float(), dim=-1)
            expected = logprobs[len(prompt) - 1:-1].gather(-1, torch.tensor(response)[:, None])[:, 0].numpy()
            worst = max(worst, float(np.max(np.abs(values - expected))))
    assert worst <= TOLERANCE


def test_a_hybrid_with_a_mask_scores_only_the_policys_tokens(qwen3_5):
    """Tool results (mask 0) are context only: on a hybrid too, the tree and rows run whole give the oracle's
    numbers on mask 1 and NaN on mask 0."""
    reference = ReferenceModel.load(ModelSpec(str(qwen3_5), dtype="float32", device="cpu"))
    oracle = Fp64Oracle(reference.model)
    rows = agent_rows(reference.vocab_size, seed=5)
    rng = np.random.default_rng(6)
    needed = [rng.random(len(r)) < 0.6 for _, r in rows]
    expected, own = oracle.expected(rows)
    for sharing in ("off", "on"):
        results = chunk_logprobs(reference, rows, 96, 1.0, sharing, ForwardStats(), needed=needed)
        for values, exact, need in zip(results, expected, needed, strict=True):
            assert np.isnan(values[~need]).all()
            if need.any():
                assert np.max(np.abs(values[need] - exact[need])) <= own + TOLERANCE
