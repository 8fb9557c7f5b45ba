"""`klpipe precompute --policy MODEL`: the policy's logprobs computed in the same pass as the reference's,
for rollouts that carry none (verl dumps, offline trajectories, an evaluation set)."""

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from transformers import AutoModelForCausalLM

from klpipe.cache import FULL_KL_COLUMNS, read_provenance
from klpipe.errors import InputError, ModelError, OutputError, ProvenanceError
from klpipe.precompute import PrecomputeConfig, precompute
from klpipe.score import ScoreConfig, score
from tests.helpers import (
    ROLLOUTS,
    SAMPLE,
    TINY_GEMMA,
    TINY_LLAMA,
    agent_rollouts,
    assert_mismatch_figures,
    oracle_logprobs,
    run_cli,
    sampled_logprobs,
)

TOLERANCE = 1e-4
POLICY = SAMPLE / "tiny-gemma4-policy"  # the policy that sampled rollouts.parquet
TOOL_IDS = SAMPLE / "tool_calls.parquet"


@pytest.fixture(scope="module")
def models():
    return {path: AutoModelForCausalLM.from_pretrained(path).eval() for path in (TINY_GEMMA, POLICY, TINY_LLAMA)}


def run(tmp_path, inputs, name="out.parquet", model=TINY_GEMMA, policy=POLICY, **kwargs):
    config = PrecomputeConfig(inputs=[Path(p) for p in inputs], output=tmp_path / name, model=str(model),
                              policy=str(policy) if policy else None, device="cpu", progress="none", **kwargs)
    return precompute(config, log=lambda message: None)


def without_policy_logprobs(tmp_path, source=ROLLOUTS) -> Path:
    path = tmp_path / "rollouts.parquet"
    pq.write_table(pq.read_table(source).drop_columns(["policy_logprobs"]), path)
    return path


def worst(model, table, column, response="response_ids", mask=None) -> float:
    error = 0.0
    for row in table.to_pylist():
        expected = oracle_logprobs(model, row["prompt_ids"], row[response])
        got = np.array([np.nan if v is None else v for v in row[column]], dtype=np.float32)
        keep = np.ones(len(got), bool) if mask is None else np.array(row[mask], dtype=bool)
        assert got.shape == expected.shape and np.isnan(got[~keep]).all()
        if keep.any():
            error = max(error, float(np.max(np.abs(got[keep] - expected[keep]))))
    return error


@pytest.mark.parametrize("sharing", ["off", "on", "auto"])
def test_both_columns_match_each_models_own_oracle(tmp_path, models, sharing):
    source = agent_rollouts(tmp_path / "agent.parquet", tasks=3, group=3, turns=2)
    pq.write_table(pq.read_table(source).drop_columns(["policy_logprobs"]), tmp_path / "bare.parquet")
    summary = run(tmp_path, [tmp_path / "bare.parquet"], prefix_sharing=sharing, max_tokens_per_batch=96,
                  chunk_rows=7)
    table = pq.read_table(summary.output)
    assert worst(models[TINY_GEMMA], table, "ref_logprobs") <= TOLERANCE
    assert worst(models[POLICY], table, "policy_logprobs") <= TOLERANCE
    # The two differ: the policy is a perturbed copy, not the reference again.
    ref, policy = (np.concatenate(table.column(c).to_pylist()) for c in ("ref_logprobs", "policy_logprobs"))
    assert np.mean(np.abs(ref - policy)) > 0.1



def test_a_policy_that_fails_the_probe_runs_its_rows_whole_beside_a_reference_that_shares(tmp_path, models,
                                                                                       monkeypatch):
    from klpipe.precompute import sharing

    probed = []
    real = sharing.check_tree
    # Each model is probed once, the first time a chunk's plan runs a tree: the reference first, then the policy.
    monkeypatch.setattr(sharing, "check_tree", lambda model: probed.append(model) or (
        real(model) if len(probed) == 1 else "the probe disagreed"))
    source = agent_rollouts(tmp_path / "agent.parquet", tasks=3, group=3, turns=2)
    pq.write_table(pq.read_table(source).drop_columns(["policy_logprobs"]), tmp_path / "bare.parquet")
    said = []
    config = PrecomputeConfig(inputs=[tmp_path / "bare.parquet"], output=tmp_path / "out.parquet",
                              model=str(TINY_GEMMA), policy=str(POLICY), device="cpu", progress="none", chunk_rows=7)
    summary = precompute(config, log=said.append)
    assert len(probed) == 2 and summary.prefix_sharing == "auto" and summary.forward.tree_rows == summary.rows
    assert [line for line in said if "prefix sharing" in line] == [
        "prefix sharing off: Gemma4ForCausalLM cannot share prefixes exactly (the probe disagreed)"]
    table = pq.read_table(summary.output)
    assert worst(models[TINY_GEMMA], table, "ref_logprobs") <= TOLERANCE
    assert worst(models[POLICY], table, "policy_logprobs") <= TOLERANCE

def test_a_mask_applies_to_both_models(tmp_path, models):
    plain = pq.read_table(TOOL_IDS).drop_columns(["policy_logprobs"]).slice(0, 10)
    pq.write_table(plain, tmp_path / "tools.parquet")
    summary = run(tmp_path, [tmp_path / "tools.parquet"], columns={"response_ids": "completion_ids"})
    table = pq.read_table(summary.output)
    for model, column in ((TINY_GEMMA, "ref_logprobs"), (POLICY, "policy_logprobs")):
        assert worst(models[model], table, column, response="completion_ids", mask="tool_mask") <= TOLERANCE


def test_the_computed_policy_logprobs_are_the_samplers_own(tmp_path):
    # rollouts.parquet was sampled from tiny-gemma4-policy: computed again, its logprobs come back.
    summary = run(tmp_path, [ROLLOUTS], columns={"policy_logprobs": "computed"})
    table = pq.read_table(summary.output)
    sampled = np.concatenate(table.column("policy_logprobs").to_pylist())
    computed = np.concatenate(table.column("computed").to_pylist())
    assert np.max(np.abs(sampled - computed)) < 1e-3  # the sampler's incremental forward against a whole one


def test_an_input_with_policy_logprobs_keeps_them_as_the_samplers(tmp_path):
    # The rollouts' policy_logprobs are the sampler's: the cache keeps them as sampler_logprobs, in their place,
    # and adds the policy's computed ones; the provenance says where each came from.
    summary = run(tmp_path, [ROLLOUTS])
    table = pq.read_table(summary.output)
    source = pq.read_table(ROLLOUTS)
    renamed = [("sampler_logprobs" if c == "policy_logprobs" else c) for c in source.column_names]
    assert table.column_names == [*renamed, "ref_logprobs", "policy_logprobs", *FULL_KL_COLUMNS]
    assert table.column("sampler_logprobs").to_pylist() == source.column("policy_logprobs").to_pylist()
    provenance = read_provenance(summary.output)
    assert provenance.sampler_source == "policy_logprobs" and provenance.policy_model == str(POLICY)
    # klpipe score measures the one against the other: every figure is numpy's over the cache's own columns.
    scored = score(ScoreConfig(inputs=[summary.output], output=tmp_path / "scored.parquet"))
    section = scored.report["mismatch"]
    assert section["trainer_computed_by"] == str(POLICY) and section["kl_from"] == "trainer"
    rows = sampled_logprobs(summary.output)
    assert_mismatch_figures(section["run"], rows)
    for entry in scored.report["steps"]:
        assert_mismatch_figures(entry["mismatch"], [r for r in rows if r["step"] == entry["step"]])
    # The same model sampled them: the gap is float rounding, and no setup mistake is named.
    assert section["mismatch/diagnosis"] == [] and abs(section["run"]["rollout_corr/kl"]) < 1e-4
    # --overwrite-policy-logprobs drops the sampler's instead.
    summary = run(tmp_path, [ROLLOUTS], name="dropped.parquet", overwrite_policy_logprobs=True)
    table = pq.read_table(summary.output)
    assert table.column_names == [c for c in source.column_names if c != "policy_logprobs"] + [
        "ref_logprobs", "policy_logprobs", *FULL_KL_COLUMNS]
    assert not table.column("policy_logprobs").equals(source.column("policy_logprobs"))
    assert read_provenance(summary.output).sampler_source is None


def test_an_input_with_both_policy_and_sampler_columns_is_refused_unless_asked(tmp_path):
    both = tmp_path / "both.parquet"
    table = pq.read_table(ROLLOUTS)
    pq.write_table(table.append_column("sampler_logprobs", table.column("policy_logprobs")), both)
    with pytest.raises(InputError, match=r"both\.parquet: already has a policy_logprobs column; pass "
                                         r"--overwrite-policy-logprobs to replace it"):
        run(tmp_path, [both])
    assert not (tmp_path / "out.parquet").exists()


def test_a_rerun_or_resume_with_another_policy_is_refused_naming_it(tmp_path, monkeypatch):
    bare = without_policy_logprobs(tmp_path)
    run(tmp_path, [bare])
    with pytest.raises(OutputError, match=r"the policy model '.*tiny-gemma4-policy' → '.*tiny-llama'"):
        run(tmp_path, [bare], policy=TINY_LLAMA)
    # A resumable work directory is refused the same way.
    from tests.helpers import crash_at_chunk

    with crash_at_chunk(monkeypatch, index=1):
        run(tmp_path, [bare], name="again.parquet", chunk_rows=16)
    assert (tmp_path / "again.parquet.partial").is_dir()
    with pytest.raises(ProvenanceError, match=r"the policy model '.*tiny-gemma4-policy' → None"):
        run(tmp_path, [bare], name="again.parquet", chunk_rows=16, policy=None)
    # and changed policy weights, as for the reference
    copy = tmp_path / "policy-copy"
    shutil.copytree(POLICY, copy)
    run(tmp_path, [bare], name="copy.parquet", policy=copy)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8] ^= 0x40
    weights.write_bytes(bytes(data))
    with pytest.raises(OutputError, match=r"the weights of the policy .*policy-copy changed"):
        run(tmp_path, [bare], name="copy.parquet", policy=copy)


def test_a_policy_with_another_tokenizer_is_refused_in_one_line(tmp_path):
    other = tmp_path / "other-policy"
    shutil.copytree(POLICY, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["bos_token"] = "<unk>"
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    bare = without_policy_logprobs(tmp_path)
    result = run_cli("precompute", "-m", TINY_GEMMA, "--policy", other, bare, "-o", tmp_path / "out.parquet")
    assert result.returncode == 2 and result.stderr.strip() == (
        f"Error: --policy {other}: its tokenizer differs from the reference's ({TINY_GEMMA}); the two models must "
        "share a tokenizer, or the policy's logprobs would be of other tokens")
    assert not (tmp_path / "out.parquet").exists()


def test_a_policy_with_another_vocabulary_is_refused(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    small = tmp_path / "small-vocab"
    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(small)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(POLICY / name, small / name)
    with pytest.raises(ModelError, match=r"its vocabulary has 300 tokens and the reference's .* 512"):
        run(tmp_path, [without_policy_logprobs(tmp_path)], policy=small)


def text_rows(tmp_path) -> Path:
    """rollouts.parquet as an evaluation set keeps it: prompt and response text in JSON Lines, a score, no ids nor
    logprobs (verl's own rollout dump is decoded text and is refused: tests/precompute/test_trainer_batches.py)."""
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"question": row["prompt"], "answer": row["response"], "score": row["reward"]})
                            + "\n" for row in pq.read_table(ROLLOUTS).to_pylist()))
    return path


def test_text_rows_score_end_to_end_and_the_report_names_the_policy(tmp_path):
    cached = tmp_path / "text.cached.parquet"
    rows = text_rows(tmp_path)
    result = run_cli("precompute", "-m", TINY_GEMMA, "--policy", POLICY, rows, "-o", cached,
                     "--column", "prompt=question", "--column", "response=answer", "--column", "reward=score")
    assert result.returncode == 0, result.stderr
    table = pq.read_table(cached)
    assert {"prompt_ids", "response_ids", "ref_logprobs", "policy_logprobs"} <= set(table.column_names)
    provenance = json.loads(table.schema.metadata[b"klpipe"])
    assert provenance["policy_model"] == str(POLICY) and provenance["policy_revision"].startswith("local:")
    assert provenance["policy_dtype"] == "float32"
    result = run_cli("score", cached, "-o", tmp_path / "scored.parquet", "--report", tmp_path / "report.json")
    assert result.returncode == 0, result.stderr
    assert f"policy logprobs computed by klpipe precompute --policy {POLICY}" in result.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["policy_logprobs"]["computed"] and report["policy_logprobs"]["model"] == str(POLICY)
    scored = pq.read_table(tmp_path / "scored.parquet").to_pylist()
    for row in scored:  # the KL of each row from the two columns, by hand
        d = [p - r for p, r in zip(row["policy_logprobs"], row["ref_logprobs"], strict=True)]
        assert row["kl"] == pytest.approx(max(sum(d) / len(d), 0.0) if d else 0.0, rel=1e-9, abs=1e-12)
    assert [r["score"] for r in scored] == [json.loads(line)["score"] for line in rows.read_text().splitlines()]


def test_policy_options_without_a_policy_are_refused():
    with pytest.raises(InputError, match=r"--policy-device need --policy MODEL"):
        PrecomputeConfig(inputs=[ROLLOUTS], model=str(TINY_GEMMA), policy_device="cpu")


def test_caches_of_two_policies_are_not_scored_together(tmp_path):
    bare = without_policy_logprobs(tmp_path)
    first = run(tmp_path, [bare], name="a.parquet").output
    second = run(tmp_path, [bare], name="b.parquet", policy=TINY_LLAMA).output
    from klpipe.errors import ProvenanceError

    with pytest.raises(ProvenanceError, match=r"caches disagree on policy_model"):
        score(ScoreConfig(inputs=[first, second], output=tmp_path / "scored.parquet"))
