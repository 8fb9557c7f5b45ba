"""Setup mistakes named (klpipe/score/diagnosis.py): data with exactly one planted fault gets exactly its code,
clean data none. The logprobs are drawn from known softmax distributions (tests/helpers.py mismatch_cache)."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from klpipe.score import ScoreConfig, score
from tests.helpers import mismatch_cache

CODE = {None: [], "temperature": ["temperature"], "top_p": ["truncated_sampling"], "shift": ["misaligned"],
        "placeholder": ["placeholder_values"], "nonfinite": ["nonfinite"]}


def diagnose(tmp_path, cache):
    result = score(ScoreConfig(inputs=[cache], output=tmp_path / "scored.parquet"))
    return result.report["mismatch"]


@pytest.mark.parametrize("fault", list(CODE))
@pytest.mark.parametrize("seed", [0, 1])
def test_each_planted_fault_gets_exactly_its_code(tmp_path, fault, seed):
    section = diagnose(tmp_path, mismatch_cache(tmp_path / "c.parquet", fault=fault, seed=seed))
    assert section["mismatch/diagnosis"] == CODE[fault]
    assert [f["code"] for f in section["findings"]] == CODE[fault]


def test_temperature_gives_the_ratios_direction(tmp_path):
    finding = diagnose(tmp_path, mismatch_cache(tmp_path / "c.parquet", fault="temperature"))["findings"][0]
    ratio = float(finding["evidence"].split("sampler/trainer ≈ ")[1].split(";")[0])
    assert 0.7 <= ratio < 0.95  # the sampler ran at 0.7; the pooled fit is pulled towards 1


def test_placeholders_and_nonfinite_values_are_left_out_and_their_rows_named(tmp_path):
    for fault, key, count in (("placeholder", "placeholder_tokens", 16), ("nonfinite", "nonfinite_tokens", 8)):
        cache = mismatch_cache(tmp_path / f"{fault}.parquet", fault=fault)
        section = diagnose(tmp_path, cache)
        assert section["excluded"][key] == count
        every = 8 if fault == "placeholder" else 16
        assert section["findings"][0]["rows"] == [f"{cache}: row {i} (id 'r{i}')" for i in range(0, 64, every)][:5]
        clean = mismatch_cache(tmp_path / "clean.parquet")
        assert section["run"]["mismatch/tokens"] == diagnose(tmp_path, clean)["run"]["mismatch/tokens"] - count


def test_a_sampler_list_of_another_length_is_misaligned_not_an_error(tmp_path):
    cache = mismatch_cache(tmp_path / "c.parquet")
    table = pq.read_table(cache)
    sampler = table.column("sampler_logprobs").to_pylist()
    sampler[5] = sampler[5][:-1]
    path = tmp_path / "short.parquet"
    pq.write_table(table.set_column(table.schema.get_field_index("sampler_logprobs"), "sampler_logprobs",
                                    pa.array(sampler, pa.list_(pa.float32()))), path)  # float32 as cached
    section = diagnose(tmp_path, path)
    assert section["mismatch/diagnosis"] == ["misaligned"] and section["excluded"]["rows_of_another_length"] == 1
    assert "1 row(s) whose sampler_logprobs list has another length" in section["findings"][0]["evidence"]
    scored = pq.read_table(tmp_path / "scored.parquet").to_pylist()
    assert scored[5]["mismatch_kl"] is None and scored[4]["mismatch_kl"] is not None


def test_a_zero_where_the_trainer_agrees_the_token_is_certain_is_not_a_placeholder(tmp_path):
    cache = mismatch_cache(tmp_path / "c.parquet")
    table = pq.read_table(cache)
    policy = table.column("policy_logprobs").to_pylist()
    sampler = table.column("sampler_logprobs").to_pylist()
    for i in range(0, 64, 8):
        policy[i][0], sampler[i][0] = -1e-7, 0.0  # p ≈ 1 for both: a real logprob of 0.0
    path = tmp_path / "certain.parquet"
    for name, values in (("policy_logprobs", policy), ("sampler_logprobs", sampler)):
        table = table.set_column(table.schema.get_field_index(name), name, pa.array(values, pa.list_(pa.float32())))
    pq.write_table(table, path)
    assert diagnose(tmp_path, path)["mismatch/diagnosis"] == []
    assert np.isfinite(diagnose(tmp_path, path)["run"]["rollout_corr/kl"])
