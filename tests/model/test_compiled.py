"""precompute --compile (klpipe/model/compiled.py): the decoder layers' norms and MLPs compiled, held to the oracle.

The quick tests (make test) check what is compiled and what is left, the option's words, and that compiled modules
that disagree with the model's own forward are dropped at load. The compiled runs themselves (inductor's C++ on
CPU: tens of seconds per model) are `-m compile`, `make test-compile` (in .ci/run): `klpipe.precompute` end to end
with --compile on, on tiny Llama, Qwen3 and Gemma 4 (sliding windows, KV-shared layers, softcap) models, fp32 and
bf16, tree on and off, against the oracle; the graphs dynamo compiles across chunks of other lengths; a compile that
fails (no C++ compiler) falling back with one line; and no torch chatter on stderr.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests import matrix
from tests.helpers import TINY_GEMMA, TINY_LLAMA, Fp64Oracle, oracle_logprobs, run_cli
from tests.model.test_bf16 import HEAD, spread

FAMILIES = ["llama", "qwen3", "gemma4_text"]


def test_targets_are_the_layers_norms_and_mlps_and_never_attention():
    from transformers import AutoModelForCausalLM

    from klpipe.model.architecture import decoder_body
    from klpipe.model.compiled import targets

    body = decoder_body(AutoModelForCausalLM.from_pretrained(TINY_GEMMA))
    found = targets(body)
    names = [name for name, _ in found]
    # Each layer's four norms around attention and MLP, its per-layer-input norm, its MLP; the body's own norms.
    assert "0.input_layernorm" in names and "0.mlp" in names and "0.post_per_layer_input_norm" in names
    assert "norm" in names
    assert not any("attn" in name or "rotary" in name or "embed" in name for name in names), names
    layers = len(body.layers)
    assert sum(name.endswith(".mlp") for name in names) == layers
    assert {type(m).__name__ for _, m in found} == {"Gemma4RMSNorm", "Gemma4TextMLP"}


def test_auto_compiles_on_cuda_only():
    from klpipe.model.compiled import wanted

    assert wanted("auto", "cuda:0") and wanted("on", "cpu") and not wanted("auto", "cpu") and not wanted("off", "cuda")


def test_a_bad_mode_is_one_line_and_exit_2(tmp_path):
    result = run_cli("precompute", "--model", str(TINY_LLAMA), "missing.parquet", "--compile", "sideways",
                     "-o", str(tmp_path / "out.parquet"))
    assert result.returncode == 2
    assert result.stderr.strip() == "Error: --compile must be auto, on or off, not 'sideways'"


def test_compiled_modules_that_disagree_with_the_models_own_forward_run_eager():
    """A 'compiler' whose MLPs are off by 1% (what a miscompile would do): the load-time probe holds them to the
    oracle, drops them, says so in one line, and the rows come out as the model's own forward computes them."""
    from transformers import AutoModelForCausalLM

    from klpipe.model import ModelSpec, ReferenceModel

    def miscompile(forward):
        def wrong(module, *args, **kwargs):
            out = forward(module, *args, **kwargs)
            return out * 1.01 if type(module).__name__.endswith("MLP") else out
        return wrong

    reference = ReferenceModel.load(ModelSpec(str(TINY_LLAMA), dtype="float32", device="cpu"))
    reference.use_compile("on", compiler=miscompile)
    assert reference.compiled is None
    [line] = [note for note in reference.notes if "compiled" in note]
    assert re.fullmatch(r"LlamaForCausalLM: its compiled norms and MLPs disagree with its own forward "
                        r"\(max \|Δ logprob\| = [0-9.e-]+\); they run eager", line), line
    untouched = AutoModelForCausalLM.from_pretrained(TINY_LLAMA).eval()
    rng = np.random.default_rng(0)
    rows = [(rng.integers(0, reference.vocab_size, 9), rng.integers(0, reference.vocab_size, 6)) for _ in range(3)]
    for (prompt, response), values in zip(rows, reference.score_batch(rows), strict=True):
        assert np.max(np.abs(values - oracle_logprobs(untouched, prompt, response))) <= 1e-4


def test_the_oracles_forward_runs_eager_while_compiled():
    """ReferenceModel.own_logprobs (what the tree's probe holds klpipe to) never runs a compiled module."""
    from klpipe.model import ModelSpec, ReferenceModel

    calls = []

    def counting(forward):
        def compiled(module, *args, **kwargs):
            calls.append(type(module).__name__)
            return forward(module, *args, **kwargs)
        return compiled

    reference = ReferenceModel.load(ModelSpec(str(TINY_LLAMA), dtype="float32", device="cpu"))
    reference.use_compile("on", compiler=counting)
    assert reference.compiled is not None and calls  # the probe ran through them
    calls.clear()
    ids = np.arange(3, 20)
    reference.own_logprobs([(ids[:4], ids[4:])])
    assert calls == []
    reference.score_batch([(ids[:4], ids[4:])])
    assert "LlamaMLP" in calls and "LlamaRMSNorm" in calls


# -- compiled for real (inductor on CPU): make test-compile ------------------------------------------------------


def _rollouts(path: Path, rows) -> Path:
    table = pa.table({"prompt_ids": pa.array([list(map(int, p)) for p, _ in rows], pa.list_(pa.int64())),
                      "response_ids": pa.array([list(map(int, r)) for _, r in rows], pa.list_(pa.int64()))})
    pq.write_table(table, path)
    return path


def _precompute(model_dir: Path, rollouts: Path, output: Path, dtype: str, sharing: str, compile: str = "on"):
    from klpipe.precompute import PrecomputeConfig, precompute

    lines = []
    precompute(PrecomputeConfig(inputs=[rollouts], output=output, model=str(model_dir), device="cpu", dtype=dtype,
                                prefix_sharing=sharing, compile=compile, progress="none", overwrite=True,
                                max_tokens_per_batch=96, max_cache_mib=1),
               log=lines.append)
    values = [np.asarray(v, dtype=np.float32) for v in pq.read_table(output).column("ref_logprobs").to_pylist()]
    return values, lines


@pytest.fixture(scope="module")
def tiny_models():
    with tempfile.TemporaryDirectory() as directory:
        yield {name: matrix.save_tiny(name, Path(directory) / name) for name in FAMILIES}


@pytest.mark.compile
@pytest.mark.parametrize("name", FAMILIES)
def test_compiled_fp32_matches_the_oracle_tree_on_and_off(name, tiny_models, tmp_path):
    from transformers import AutoModelForCausalLM

    directory = tiny_models[name]
    untouched = AutoModelForCausalLM.from_pretrained(directory, dtype="float32").eval()
    rows = matrix.agent_rows(untouched.config.get_text_config().vocab_size)[:12]
    rollouts = _rollouts(tmp_path / "rollouts.parquet", rows)
    oracle = Fp64Oracle(untouched)
    for sharing in ("on", "off"):
        results, lines = _precompute(directory, rollouts, tmp_path / f"{sharing}.parquet", "float32", sharing)
        compiled = [line for line in lines if "compiled (torch.compile)" in line]
        assert len(compiled) == 1 and not any("eager" in line for line in lines), lines
        ours, own = oracle.errors(rows, results)
        assert ours <= own + 1e-4, f"{name} {sharing}: {ours:.3g} against fp64, the fp32 oracle's own {own:.3g}"


@pytest.mark.compile
@pytest.mark.parametrize("name", FAMILIES)
def test_compiled_bf16_within_its_own_rounding_of_fp64_tree_on_and_off(name, tiny_models, tmp_path):
    """tests/model/test_bf16.py's bound (2 x the fp64 model's spread under bf16-sized rounding + 1e-4), compiled."""
    from transformers import AutoModelForCausalLM

    directory = tiny_models[name]
    model64 = AutoModelForCausalLM.from_pretrained(directory, dtype="bfloat16").eval().to(torch.float64)
    rows = matrix.agent_rows(model64.config.get_text_config().vocab_size)[:12]
    rollouts = _rollouts(tmp_path / "rollouts.parquet", rows)
    expected = [oracle_logprobs(model64, p, r) for p, r in rows]
    tolerance = 2 * spread(model64, rows, expected) + HEAD
    own_model = AutoModelForCausalLM.from_pretrained(directory, dtype="bfloat16").eval()
    own = [oracle_logprobs(own_model, p, r) for p, r in rows]  # the model's own bf16 forward, a row at a time
    for sharing in ("on", "off"):
        results, lines = _precompute(directory, rollouts, tmp_path / f"{sharing}.parquet", "bfloat16", sharing)
        assert any("compiled (torch.compile)" in line for line in lines) and not any("eager" in line for line in lines)
        error = max(float(np.max(np.abs(v - e))) for v, e in zip(results, expected, strict=True) if len(e))
        from_own = max(float(np.max(np.abs(v - o))) for v, o, e in zip(results, own, expected, strict=True) if len(e))
        assert error <= tolerance or from_own <= tolerance, (name, sharing, error, from_own, tolerance)


@pytest.mark.compile
def test_batches_of_other_lengths_compile_nothing_after_the_first_chunk():
    """dynamic=True: the load-time probe compiles the shapes a run meets (packed rows, a batch of rows, a lone
    token); the tree's probe may add one (a strided view); chunks of other lengths then compile nothing."""
    from klpipe.model import ModelSpec, ReferenceModel
    from klpipe.model.compiled import graphs_compiled
    from klpipe.precompute.logprobs import run_plan
    from klpipe.precompute.sharing import Sharing

    reference = ReferenceModel.load(ModelSpec(str(TINY_GEMMA), dtype="float32", device="cpu"), compile="on")
    assert reference.compiled is not None
    sharing = Sharing(reference, "on", 1 << 10, lambda line: None)
    counts = []
    for seed in range(3):
        rows = matrix.agent_rows(reference.vocab_size, seed=seed)
        run_plan(reference, sharing.plan(rows, 96 + 40 * seed, None), rows, 1.0)
        counts.append(graphs_compiled())
    assert counts[0] == counts[1] == counts[2], counts


@pytest.mark.compile
def test_a_compile_that_fails_runs_eager_with_one_line_each_and_right_numbers(tmp_path):
    """No C++ compiler (CXX names none) and a cold inductor cache: each class's compile fails at load, says so in one
    line, and runs eager: the same logprobs as --compile off."""
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    out = {}
    for mode in ("on", "off"):
        result = run_cli("precompute", "--model", str(TINY_LLAMA), str(matrix_rollouts(tmp_path)), "--compile", mode,
                         "-o", str(tmp_path / f"{mode}.parquet"), "--progress", "none", env=env)
        assert result.returncode == 0, result.stderr
        out[mode] = result.stderr.strip().splitlines()
    failed = [line for line in out["on"] if "runs eager: torch.compile failed on it" in line]
    assert sorted(line.split(":")[1].strip().split()[0] for line in failed) == ["LlamaMLP", "LlamaRMSNorm"], out["on"]
    assert all(line.startswith("LlamaForCausalLM: ") and "\n" not in line for line in failed)
    assert not any("compiled (torch.compile)" in line for line in out["on"])
    assert len(out["on"]) == len(out["off"]) + 2  # those two lines, nothing else
    values = {mode: pq.read_table(tmp_path / f"{mode}.parquet").column("ref_logprobs").to_pylist() for mode in out}
    assert values["on"] == values["off"]


def matrix_rollouts(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    rows = [(rng.integers(3, 200, 20), rng.integers(3, 200, 8)) for _ in range(6)]
    return _rollouts(tmp_path / "rollouts.parquet", rows)


@pytest.mark.compile
def test_compile_on_says_one_line_and_nothing_of_torchs(tmp_path):
    """The CLI with --compile on, as a user runs it: klpipe's lines only, no dynamo or inductor warnings."""
    result = run_cli("precompute", "--model", str(TINY_GEMMA), str(matrix_rollouts(tmp_path)), "--compile", "on",
                     "--prefix-sharing", "on", "-o", str(tmp_path / "out.parquet"), "--progress", "none")
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert re.fullmatch(r"Gemma4ForCausalLM: Gemma4RMSNorm, Gemma4TextMLP compiled \(torch\.compile\) in [0-9.]+s, "
                        r"held to its own forward", lines[0]), lines
    assert lines[-1].startswith("wrote "), lines
    assert len(lines) == 2, lines
