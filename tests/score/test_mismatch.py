"""The sampler against the trainer (klpipe/score/mismatch.py through `klpipe score`): every figure of the report's
mismatch section, per step and for the run, and every per-row column, against numpy written here from the cache's
own columns."""

import itertools
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from klpipe.errors import InputError
from klpipe.score import ScoreConfig, score
from tests.helpers import assert_mismatch_figures as assert_figures
from tests.helpers import assert_quantile, mismatch_cache, order_statistic, run_cli
from tests.helpers import sampled_logprobs as sampled


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clean")
    cache = mismatch_cache(tmp / "clean.parquet")
    result = score(ScoreConfig(inputs=[cache], output=tmp / "scored.parquet", report=tmp / "report.json",
                               metrics_jsonl=tmp / "metrics.jsonl", tensorboard=tmp / "tb", per_token=True))
    return cache, result, tmp


def test_the_run_figures_are_verls_definitions_over_the_sampled_tokens(clean_run):
    cache, _result, tmp = clean_run
    section = json.loads((tmp / "report.json").read_text())["mismatch"]
    assert section["sampler_logprobs"] == "sampler_logprobs" and section["trainer_logprobs"] == "policy_logprobs"
    assert section["kl_from"] == "trainer"
    rows = sampled(cache)
    assert_figures(section["run"], rows)
    # Tool results (mask 0) are never counted: fewer tokens than the responses hold.
    total = sum(len(r["response_ids"]) for r in pq.read_table(cache).to_pylist())
    assert section["run"]["mismatch/tokens"] < total
    assert section["mismatch/diagnosis"] == [] and section["excluded"] == {
        "nonfinite_tokens": 0, "placeholder_tokens": 0, "rows_of_another_length": 0}


def test_each_step_has_its_own_figures(clean_run):
    cache, result, _ = clean_run
    rows = sampled(cache)
    steps = result.report["steps"]
    assert [s["step"] for s in steps] == sorted({r["step"] for r in rows})
    for entry in steps:
        assert_figures(entry["mismatch"], [r for r in rows if r["step"] == entry["step"]])


def test_breakdowns_count_every_sampled_token_once_in_its_bucket(clean_run):
    cache, result, _ = clean_run
    tables = result.report["mismatch"]["breakdowns"]
    rows = sampled(cache)
    sampler = np.concatenate([r["s"] for r in rows])
    p = np.exp(sampler)
    by_probability = [np.sum(p < 1e-3), np.sum((p >= 1e-3) & (p < 1e-2)), np.sum((p >= 1e-2) & (p < 0.1)),
                      np.sum((p >= 0.1) & (p < 0.5)), np.sum((p >= 0.5) & (p < 0.9)), np.sum(p >= 0.9)]
    assert [b["tokens"] for b in tables["sampler_probability"]] == [int(n) for n in by_probability]
    # Positions count every response token, tool results included; mask runs split on the tool results.
    positions, after = [], []
    for row in pq.read_table(cache).to_pylist():
        last_zero = None
        for index, bit in enumerate(row["mask"]):
            if bit == 0:
                last_zero = index
                continue
            positions.append(index)
            after.append(-1 if last_zero is None else index - last_zero - 1)
    positions, after = np.array(positions), np.array(after)
    edges = [0, 1, 4, 16, 64, 256, 1024, 10**9]
    assert [b["tokens"] for b in tables["position"]] == [
        int(np.sum((positions >= lo) & (positions < hi))) for lo, hi in itertools.pairwise(edges)]
    assert [b["tokens"] for b in tables["mask_run"]] == [
        int(np.sum(after < 0)), int(np.sum((after >= 0) & (after < 4))), int(np.sum(after >= 4))]
    assert tables["mask_run"][1]["tokens"] > 0
    # A bucket's quantiles are of its own tokens.
    ratio = np.concatenate([r["t"] - r["s"] for r in rows])
    top = tables["sampler_probability"][5]
    assert_quantile(top["log_ratio"]["p50"], order_statistic(ratio[p >= 0.9], 0.5))


def test_per_row_columns_and_per_token_log_ratio(clean_run):
    cache, _result, tmp = clean_run
    scored = pq.read_table(tmp / "scored.parquet").to_pylist()
    for row, expected in zip(scored, sampled(cache), strict=True):
        ratio = expected["t"] - expected["s"]
        assert row["mismatch_kl"] == pytest.approx(np.mean(-ratio), rel=1e-9, abs=1e-15)
        assert row["log_ppl_diff"] == pytest.approx(np.mean(expected["s"]) - np.mean(expected["t"]), rel=1e-9,
                                                    abs=1e-15)
        assert row["sequence_weight"] == pytest.approx(np.exp(np.sum(ratio)), rel=1e-9)
        assert row["geometric_weight"] == pytest.approx(np.exp(np.mean(ratio)), rel=1e-9)
        keep = np.array(row["mask"], bool)
        per_token = row["log_ratio_per_token"]
        assert len(per_token) == len(keep) and all(v is None for v, k in zip(per_token, keep, strict=True) if not k)
        np.testing.assert_allclose([v for v in per_token if v is not None], ratio, rtol=0, atol=0)


def test_metrics_files_carry_the_step_figures_under_verls_names(clean_run):
    _, result, tmp = clean_run
    records = [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]
    names = ("rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/training_ppl", "rollout_corr/rollout_ppl",
             "rollout_corr/log_ppl_diff", "rollout_corr/ppl_ratio", "rollout_corr/chi2_token", "rollout_corr/chi2_seq",
             "mismatch/log_ratio_p99", "mismatch/ess_sequence_is")
    for record, entry in zip(records, result.report["steps"], strict=True):
        for name in names:
            assert record[name] == entry["mismatch"][name]
    accumulator = EventAccumulator(str(tmp / "tb"), size_guidance={"scalars": 0})
    accumulator.Reload()
    for name in names:
        points = [(e.step, e.value) for e in accumulator.Scalars(name)]
        assert points == [(r["step"], pytest.approx(r[name], rel=1e-6)) for r in records]
    assert "klpipe/kl" in accumulator.Tags()["scalars"]


def test_kl_from_sampler_reads_the_samplers_logprobs(tmp_path):
    cache = mismatch_cache(tmp_path / "clean.parquet", rows=32)
    trainer = score(ScoreConfig(inputs=[cache], output=tmp_path / "a.parquet"))
    sampler = score(ScoreConfig(inputs=[cache], output=tmp_path / "b.parquet", kl_from="sampler"))
    assert trainer.report["config"]["kl_from"] == "trainer" and sampler.report["config"]["kl_from"] == "sampler"
    for name, source in (("a.parquet", "policy_logprobs"), ("b.parquet", "sampler_logprobs")):
        for row in pq.read_table(tmp_path / name).to_pylist():
            keep = np.array(row["mask"], bool)
            diff = (np.array(row[source], np.float64) - np.array(row["ref_logprobs"], np.float64))[keep]
            assert row["kl"] == pytest.approx(max(np.mean(diff), 0.0), rel=1e-9, abs=1e-15)


def test_kl_from_sampler_without_the_samplers_logprobs_is_refused(tmp_path):
    from tests.helpers import make_rows, provenance, write_cache

    # precompute --policy computed these policy_logprobs, and nothing kept the sampler's.
    cache = write_cache(tmp_path / "c.parquet", make_rows(4),
                        provenance=provenance(policy_model="policy-dir", policy_revision="local:1",
                                              policy_dtype="float32"))
    with pytest.raises(InputError, match="--kl-from sampler: the caches hold no sampler_logprobs column"):
        score(ScoreConfig(inputs=[cache], output=tmp_path / "o.parquet", kl_from="sampler"))
    assert not (tmp_path / "o.parquet").exists()


def test_a_cache_without_a_sampler_column_has_no_mismatch_section(tmp_path):
    from tests.helpers import make_rows, write_cache

    cache = write_cache(tmp_path / "c.parquet", make_rows(4))
    result = score(ScoreConfig(inputs=[cache], output=tmp_path / "o.parquet"))
    assert result.report["mismatch"] is None
    assert "mismatch_kl" not in pq.read_schema(tmp_path / "o.parquet").names


def test_the_cli_prints_the_headline_and_takes_kl_from(tmp_path):
    cache = mismatch_cache(tmp_path / "top_p.parquet", fault="top_p", rows=32)
    result = run_cli("score", str(cache), "-o", str(tmp_path / "o.parquet"), "--kl-from", "sampler")
    assert result.returncode == 0, result.stderr
    assert "sampler against trainer (sampler_logprobs vs policy_logprobs" in result.stderr
    assert "KL from the sampler's logprobs" in result.stderr
    assert "mismatch diagnosis: truncated_sampling" in result.stderr
    bad = run_cli("score", str(cache), "-o", str(tmp_path / "p.parquet"), "--kl-from", "engine")
    assert bad.returncode == 2 and "engine" in bad.stderr
