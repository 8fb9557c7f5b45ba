"""`precompute --full-kl` and `--ref-topk`: the joint head's columns in the cache, over adapters, streamed weights and
every refusal. The numbers themselves are held to the full-softmax oracle in tests/model/test_joint_head.py; here the
cache's columns are, through the whole stage."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from klpipe import cache
from klpipe.errors import InputError, OutputError, ProvenanceError
from klpipe.model import wide
from klpipe.precompute import PrecomputeConfig, precompute
from tests import matrix
from tests.helpers import ROLLOUTS, SAMPLE, TINY_GEMMA, TINY_LLAMA, crash_at_chunk, run_cli
from tests.model.test_joint_head import QUANTITIES, TOLERANCE, Oracle, _worst, full_oracle
from tests.model.test_lora import MLP, bare_rollouts, merged, save_adapter, streaming_budget

POLICY_GEMMA = SAMPLE / "tiny-gemma4-policy"


def run(tmp_path, model, policy, inputs=(ROLLOUTS,), name="out.parquet", log=lambda line: None, **options):
    config = PrecomputeConfig(inputs=[Path(p) for p in inputs], output=tmp_path / name, model=str(model),
                              policy=None if policy is None else str(policy), device="cpu", progress="none",
                              overwrite_policy_logprobs=policy is not None, **options)
    return precompute(config, log=log)


def columns(path) -> tuple[list, dict[str, list[np.ndarray]]]:
    table = pq.read_table(path)
    rows = list(zip(table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist(), strict=True))
    found = {name: [np.array(v, dtype=np.float64) for v in table.column(name).to_pylist()]
             for name in QUANTITIES if name in table.column_names}
    return rows, found


def assert_cache_at_oracle(path, ref_model, policy_model, temperature: float = 1.0) -> None:
    rows, found = columns(path)
    exact, own = Oracle(ref_model, policy_model).expected(rows, temperature)
    assert set(found) == set(QUANTITIES)
    for name in QUANTITIES:  # the cache holds float32: its rounding is far inside the bound
        assert _worst(found[name], exact[name]) <= own[name] + TOLERANCE + 1e-6, name


def test_the_cache_holds_the_exact_kl_and_says_so(tmp_path):
    from transformers import AutoModelForCausalLM

    summary = run(tmp_path, TINY_GEMMA, POLICY_GEMMA, full_kl=True, temperature=0.7)
    table = pq.read_table(summary.output)
    assert table.column_names[-5:] == [cache.POLICY_LOGPROBS, *cache.FULL_KL_COLUMNS]
    for name in cache.FULL_KL_COLUMNS:
        assert table.schema.field(name).type == cache.REF_LOGPROBS_TYPE
    provenance = cache.read_provenance(summary.output)
    assert provenance.full_kl and provenance.ref_topk is None
    assert_cache_at_oracle(summary.output, AutoModelForCausalLM.from_pretrained(TINY_GEMMA),
                           AutoModelForCausalLM.from_pretrained(POLICY_GEMMA), 0.7)
    off = run(tmp_path, TINY_GEMMA, POLICY_GEMMA, name="off.parquet", full_kl=False, temperature=0.7)
    assert not set(cache.FULL_KL_COLUMNS) & set(pq.read_schema(off.output).names)
    assert not cache.read_provenance(off.output).full_kl
    # Without the exact KL, the same logprobs (the joint head's are the heads' own).
    for name in (cache.REF_LOGPROBS, cache.POLICY_LOGPROBS):
        assert _worst(columns(off.output)[1][name], columns(summary.output)[1][name]) <= 1e-6


def test_a_masked_token_gets_no_exact_kl(tmp_path):
    tools = SAMPLE / "tool_calls.parquet"
    summary = run(tmp_path, TINY_GEMMA, POLICY_GEMMA, inputs=[tools], full_kl=True,
                  columns={"response_ids": "completion_ids"})
    table = pq.read_table(summary.output)
    for mask, kl in zip(table.column("tool_mask").to_pylist(), table.column(cache.KL_POLICY_REF).to_pylist(),
                        strict=True):
        assert [m == 0 for m in mask] == [v is None for v in kl]
    assert sum(m == 0 for row in table.column("tool_mask").to_pylist() for m in row) > 10


@pytest.mark.parametrize("dora", [False, True])
def test_an_adapter_policy_with_its_own_head(tmp_path, dora):
    # The policy is the reference's weights with the adapter on, its LM head replaced (modules_to_save): the joint
    # head applies both heads, one module's two weights, side by side.
    from transformers import AutoModelForCausalLM

    adapter = save_adapter(TINY_LLAMA, tmp_path / "adapter", dora=dora, modules_to_save=["lm_head"])
    summary = run(tmp_path, TINY_LLAMA, adapter, inputs=[bare_rollouts(tmp_path)], full_kl=True)
    assert_cache_at_oracle(summary.output, AutoModelForCausalLM.from_pretrained(TINY_LLAMA),
                           merged(TINY_LLAMA, adapter))


def test_streamed_weights_give_the_in_memory_columns(tmp_path, monkeypatch):
    # The reference's layers and LM head stream from their files (the joint head reads the head's blocks once, in
    # vocabulary order), the policy an adapter over it: every column equals the run held in memory.
    adapter = save_adapter(TINY_GEMMA, tmp_path / "lora", targets=MLP)
    streams = streaming_budget(monkeypatch, [adapter])
    rows, lines = bare_rollouts(tmp_path), []
    options = dict(inputs=[rows], full_kl=True, ref_topk=4, max_tokens_per_batch=256, chunk_rows=5, max_cache_mib=0)
    streamed = run(tmp_path, TINY_GEMMA, adapter, name="streamed.parquet", log=lines.append, max_memory=str(streams),
                   **options)
    assert any("its decoder layers stream from their files" in line for line in lines), lines
    in_memory = run(tmp_path, TINY_GEMMA, adapter, name="memory.parquet", **options)
    got, expected = pq.read_table(streamed.output), pq.read_table(in_memory.output)
    for name in (*QUANTITIES, cache.REF_TOPK_LOGPROBS):
        a, b = (np.concatenate([np.ravel(v) for v in t.column(name).to_pylist() if v]) for t in (got, expected))
        assert np.max(np.abs(a - b)) <= 1e-5, name
    assert got.column(cache.REF_TOPK_IDS).equals(expected.column(cache.REF_TOPK_IDS))


def test_fp64_cache_columns(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    adapter = save_adapter(TINY_LLAMA, tmp_path / "a", dora=True, modules_to_save=["lm_head"])
    summary = run(tmp_path, TINY_LLAMA, adapter, inputs=[bare_rollouts(tmp_path)], full_kl=True, dtype="float64")
    rows, found = columns(summary.output)
    ref = AutoModelForCausalLM.from_pretrained(TINY_LLAMA, dtype=torch.float64)
    policy = merged(TINY_LLAMA, adapter).to(torch.float64)
    with wide.fp64():
        exact = full_oracle(ref, policy, rows, 1.0)
    for name in QUANTITIES:  # within float32's rounding of the fp64 values the cache stores
        for got, want in zip(found[name], exact[name], strict=True):
            assert np.all(np.abs(got - want) <= 1e-9 + 2 ** -23 * np.abs(want)), name


def test_the_top_k_columns_and_their_size_said_before_any_row(tmp_path):
    lines = []
    summary = run(tmp_path, TINY_GEMMA, None, ref_topk=8, log=lines.append)
    table = pq.read_table(summary.output)
    tokens = sum(len(r) for r in table.column("response_ids").to_pylist())
    assert f"--ref-topk 8: 48 rows, {tokens:,} response tokens x 8 x 8 bytes" in "\n".join(lines)
    assert table.schema.field(cache.REF_TOPK_IDS).type == cache.REF_TOPK_IDS_TYPE
    ids, logprobs = table.column(cache.REF_TOPK_IDS).to_pylist(), table.column(cache.REF_TOPK_LOGPROBS).to_pylist()
    for row_ids, row_logprobs, ref, response in zip(ids, logprobs, table.column(cache.REF_LOGPROBS).to_pylist(),
                                                    table.column("response_ids").to_pylist(), strict=True):
        assert len(row_ids) == len(response) and all(len(k) == 8 for k in row_ids)
        for token, top, values, logprob in zip(response, row_ids, row_logprobs, ref, strict=True):
            assert values == sorted(values, reverse=True)
            # The sampled token among the top 8: the same logprob, its logit by a dot product (ref_logprobs) or off
            # the block's matmul (the top-k), each fp32 (a few 1e-6 apart); else below the 8th.
            if token in top:
                assert abs(values[top.index(token)] - logprob) <= 1e-5
            else:
                assert logprob <= values[-1] + 1e-5
    assert cache.read_provenance(summary.output).ref_topk == 8
    assert cache.FULL_KL_COLUMNS[0] not in table.column_names  # no policy: no KL


def test_another_top_k_is_another_run(tmp_path, monkeypatch):
    with crash_at_chunk(monkeypatch):  # a run killed after two chunks leaves its work directory
        run(tmp_path, TINY_GEMMA, None, ref_topk=4, chunk_rows=16)
    with pytest.raises(ProvenanceError, match="ref_topk 4 → 8"):  # resumed only by the same command
        run(tmp_path, TINY_GEMMA, None, ref_topk=8, chunk_rows=16)
    done = run(tmp_path, TINY_GEMMA, None, ref_topk=4, chunk_rows=16)
    assert done.resumed_chunks == 2 and pq.read_table(done.output).num_rows == 48


@pytest.mark.parametrize("k", [-1, 257])
def test_a_top_k_out_of_range_is_refused(tmp_path, k):
    with pytest.raises(InputError, match=f"--ref-topk must be between 0 and 256, not {k}"):
        run(tmp_path, TINY_GEMMA, None, ref_topk=k)


def test_a_model_run_by_its_own_forward_is_refused_in_one_line(tmp_path):
    model = matrix.save_tiny("cpmant", tmp_path / "model")
    policy = matrix.save_tiny("cpmant", tmp_path / "policy", seed=1)
    done = run_cli("precompute", "-m", str(model), "--policy", str(policy), str(ROLLOUTS), "-o",
                   str(tmp_path / "out.parquet"), "--overwrite-policy-logprobs", "--full-kl", "--device", "cpu")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("Error: --full-kl cannot run: CpmAntForCausalLM runs each "
                                                          "row by its own forward")
    assert "--no-full-kl" in done.stderr and not list(tmp_path.glob("out.parquet*"))


@pytest.fixture
def small_disk(tmp_path):
    """A real filesystem of 256 KiB: `mount -t tmpfs` (root only)."""
    mountpoint = tmp_path / "disk"
    mountpoint.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mountpoint)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()})")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)


def test_a_top_k_the_output_disk_cannot_hold_is_refused_before_any_row(small_disk):
    # 356 response tokens x 256 x 8 bytes = 712 KiB of top-k, onto a disk of 256 KiB.
    refused = r"--ref-topk 256 would write 1.4 MiB onto .*disk, which has 2\d\d.0 KiB free"
    with pytest.raises(OutputError, match=refused):
        run(small_disk, TINY_GEMMA, None, ref_topk=256)
    assert list(small_disk.iterdir()) == []  # no work directory, no output


@pytest.mark.slow
def test_streamed_in_its_memory_cgroup_at_the_in_memory_columns(tmp_path):
    # A reference 2.8 times its cgroup's memory streams layer by layer and its LM head block by block; the policy is
    # a LoRA adapter over it (PEFT's config, its keys written here: loading the base into PEFT would take minutes).
    # Every joint-head column, top-k too, equals the run held in memory.
    import json

    import pyarrow as pa
    import torch
    from peft import LoraConfig
    from safetensors.torch import save_file

    from tests.model.test_streaming import CGROUP_LIMIT, SAME, big_llama, streamed_in_a_cgroup_and_in_memory

    model = big_llama(tmp_path / "big")
    config = json.loads((model / "config.json").read_text())
    adapter = tmp_path / "lora"
    LoraConfig(r=4, lora_alpha=8, target_modules=["down_proj"], task_type="CAUSAL_LM",
               base_model_name_or_path=str(model)).save_pretrained(adapter)
    generator = torch.Generator().manual_seed(0)
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    save_file({f"base_model.model.model.layers.{i}.mlp.down_proj.lora_{part}.weight":
               torch.randn(shape, generator=generator) * 0.05
               for i in range(config["num_hidden_layers"]) for part, shape in (("A", (4, inner)), ("B", (hidden, 4)))},
              adapter / "adapter_model.safetensors")
    rng = np.random.default_rng(0)
    prompt = rng.integers(10, 200, 120).tolist()
    pq.write_table(pa.Table.from_pylist([{"prompt_ids": prompt, "response_ids": rng.integers(10, 200, 40).tolist()}
                                         for _ in range(6)]), tmp_path / "rows.parquet")
    streamed, used, in_memory, _, _ = streamed_in_a_cgroup_and_in_memory(tmp_path, [
        "precompute", str(tmp_path / "rows.parquet"), "--model", str(model), "--policy", str(adapter), "--full-kl",
        "--ref-topk", "8", "--progress", "none", "--max-tokens-per-batch", "256", "--prefix-sharing", "on"],
        "full-kl")
    assert streamed.returncode == 0, streamed.stderr[-2000:]
    assert "its decoder layers stream from their files" in streamed.stderr and used <= CGROUP_LIMIT
    assert in_memory.returncode == 0, in_memory.stderr[-2000:]
    got, expected = pq.read_table(tmp_path / "streamed.parquet"), pq.read_table(tmp_path / "memory.parquet")
    for name in (*QUANTITIES, cache.REF_TOPK_LOGPROBS):
        a, b = (np.concatenate([np.ravel(v) for v in t.column(name).to_pylist()]) for t in (got, expected))
        assert np.max(np.abs(a - b)) <= SAME, name
    assert got.column(cache.REF_TOPK_IDS).equals(expected.column(cache.REF_TOPK_IDS))
    assert np.mean(np.concatenate(expected.column(cache.KL_POLICY_REF).to_pylist())) > 1e-3  # the adapter moved it


def test_both_stages_on_the_sample_data_score_the_exact_kl(tmp_path):
    # make demo's steps: the policy that sampled the rollouts beside the reference, then score --estimator full.
    import json

    done = run_cli("precompute", "--model", str(TINY_GEMMA), "--policy", str(POLICY_GEMMA), str(ROLLOUTS),
                   "--full-kl", "-o", str(tmp_path / "cached.parquet"))
    assert done.returncode == 0, done.stderr
    scored = run_cli("score", str(tmp_path / "cached.parquet"), "--estimator", "full", "-o",
                     str(tmp_path / "scored.parquet"), "--report", str(tmp_path / "report.json"))
    assert scored.returncode == 0, scored.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    run_figures = report["exact"]["run"]
    table = pq.read_table(tmp_path / "scored.parquet")
    exact = np.concatenate([np.array(v, dtype=np.float64) for v in table.column(cache.KL_POLICY_REF).to_pylist()])
    k1 = np.concatenate([np.array(p, dtype=np.float64) - np.array(r, dtype=np.float64) for p, r in zip(
        table.column(cache.POLICY_LOGPROBS).to_pylist(), table.column(cache.REF_LOGPROBS).to_pylist(), strict=True)])
    assert run_figures["exact_kl"] == pytest.approx(exact.mean(), rel=1e-5)
    assert run_figures["k1_kl"] == pytest.approx(k1.mean(), rel=1e-5)
    # The rows' KL is the exact one's mean over each row's tokens.
    for kl, values in zip(table.column("kl").to_pylist(), table.column(cache.KL_POLICY_REF).to_pylist(), strict=True):
        if values:
            assert kl == pytest.approx(np.mean(values), rel=1e-5)
