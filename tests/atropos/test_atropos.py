"""Atropos groups through both stages, without atroposlib: the sample groups (sample_data/atropos_groups.jsonl,
built by atroposlib's ManagedServer and written with its writer: sample_data/generate_atropos.py) read, scored
and written back; groups klpipe must refuse; the group line filled in byte for byte. tests/atropos_server holds the same
against atroposlib's own code and API server (make test-atropos)."""

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from klpipe.atropos import reader
from klpipe.atropos.groups import PLACEHOLDER, fill_line, split_group
from klpipe.errors import InputError
from klpipe.precompute import PrecomputeConfig, precompute
from klpipe.score import ScoreConfig, score
from klpipe.score.controller import ControllerConfig
from tests.helpers import SAMPLE, TINY_GEMMA, free_ports, make_rows, oracle_logprobs, run_cli, write_cache

GROUPS = SAMPLE / "atropos_groups.jsonl"
TOLERANCE = 1e-4
FILLED = ("ref_logprobs", "scores", "overrides")  # the fields score sets; every other one comes back as it came
COEFF = 0.2


def lines(path: Path) -> list[str]:
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def trained(mask: list[int]) -> list[int]:
    return [p for p, m in enumerate(mask) if m != -100]


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    """Precompute (3-row chunks, so groups span chunks) and score with a fixed coefficient, on the sample."""
    out = tmp_path_factory.mktemp("atropos")
    cached = out / "groups.cached.parquet"
    precompute(PrecomputeConfig(inputs=[GROUPS], output=cached, model=str(TINY_GEMMA), device="cpu",
                                progress="none", chunk_rows=3), log=lambda message: None)
    scored = out / "groups.scored.jsonl"
    result = score(ScoreConfig(inputs=[cached], output=scored,
                               controller=ControllerConfig(controller="fixed", kl_coeff=COEFF)))
    return cached, scored, result


@pytest.fixture(scope="module")
def oracle():
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TINY_GEMMA, dtype=torch.float32).eval()

    def logprobs(tokens: list[int]) -> np.ndarray:
        """log p_ref(tokens[p] | tokens[:p]) for every p >= 1, the naive one-row forward."""
        return oracle_logprobs(model, tokens[:1], tokens[1:])

    return logprobs


def test_the_cache_holds_one_row_per_completion_named_by_group_and_index(stages):
    cached, _, _ = stages
    table = pq.read_table(cached)
    groups = [json.loads(line) for line in lines(GROUPS)]
    expected_ids = [f"{GROUPS.name}:{n}:{i}" for n, group in enumerate(groups, 1) for i in range(len(group["tokens"]))]
    assert table.column("id").to_pylist() == expected_ids
    completions = [(group, i) for group in groups for i in range(len(group["tokens"]))]
    for row, (group, i) in enumerate(completions):
        tokens, mask = group["tokens"][i], group["masks"][i]
        first = trained(mask)[0]
        assert table.column("prompt_ids")[row].as_py() == tokens[:first]
        assert table.column("response_ids")[row].as_py() == tokens[first:]
        assert table.column("mask")[row].as_py() == [int(m != -100) for m in mask[first:]]
        assert table.column("policy_logprobs")[row].as_py() == group["inference_logprobs"][i][first:]
        assert table.column("reward")[row].as_py() == group["scores"][i]
    # The multi-turn groups: a tool's suffix inside the response, masked out.
    assert any(0 in mask for mask in table.column("mask").to_pylist())


def test_written_groups_hold_reference_logprobs_at_the_oracle_and_placeholders_elsewhere(stages, oracle):
    _, scored, _ = stages
    worst = 0.0
    for before, after in zip(lines(GROUPS), lines(scored), strict=True):
        group, out = json.loads(before), json.loads(after)
        for tokens, mask, ref in zip(group["tokens"], group["masks"], out["ref_logprobs"], strict=True):
            assert len(ref) == len(tokens)
            expected = oracle(tokens)  # expected[p - 1] is position p's
            for p, m in enumerate(mask):
                if m == -100:
                    assert ref[p] == PLACEHOLDER
                else:
                    worst = max(worst, abs(ref[p] - float(expected[p - 1])))
    assert worst <= TOLERANCE


def test_scores_are_penalised_and_overrides_record_what_was_applied(stages, oracle):
    _, scored, _ = stages
    for before, after in zip(lines(GROUPS), lines(scored), strict=True):
        group, out = json.loads(before), json.loads(after)
        for i, tokens in enumerate(group["tokens"]):
            positions = trained(group["masks"][i])
            expected_ref = oracle(tokens)
            k1 = np.mean([group["inference_logprobs"][i][p] - expected_ref[p - 1] for p in positions])
            kl = max(float(k1), 0.0)  # k1, mean over the trained tokens, clamped at 0 (score's defaults)
            assert out["overrides"][i]["klpipe_raw_score"] == group["scores"][i]
            assert out["overrides"][i]["klpipe_kl_coeff"] == COEFF
            assert out["overrides"][i]["klpipe_kl"] == pytest.approx(kl, abs=1e-4)
            assert out["scores"][i] == pytest.approx(group["scores"][i] - COEFF * kl, abs=COEFF * 1e-4)


def test_every_other_field_comes_back_byte_for_byte_in_order(stages):
    _, scored, _ = stages
    before_lines, after_lines = lines(GROUPS), lines(scored)
    assert len(before_lines) == len(after_lines)
    for before, after in zip(before_lines, after_lines, strict=True):
        group, out = json.loads(before), json.loads(after)
        assert list(out) == list(group)  # the same fields, in the same order
        for key, value in group.items():
            if key not in FILLED:
                # The writer's own text of the field (jsonlines: ", " and ": "), found verbatim in the output.
                text = f"{json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}"
                assert text in before and text in after, key


def test_precompute_fills_reference_logprobs_alone(stages, tmp_path):
    _, scored, _ = stages
    output = tmp_path / "groups.ref.jsonl"
    precompute(PrecomputeConfig(inputs=[GROUPS], output=output, model=str(TINY_GEMMA), device="cpu",
                                progress="none", output_format="atropos"), log=lambda message: None)
    for before, after, penalised in zip(lines(GROUPS), lines(output), lines(scored), strict=True):
        group, out = json.loads(before), json.loads(after)
        # The same logprobs as the scored groups' (another chunking: batched differently, so to the tolerance).
        for ours, theirs in zip(out["ref_logprobs"], json.loads(penalised)["ref_logprobs"], strict=True):
            assert np.allclose(ours, theirs, rtol=0, atol=TOLERANCE)
        assert {key: value for key, value in out.items() if key != "ref_logprobs"} == \
            {key: value for key, value in group.items() if key != "ref_logprobs"}
        assert after.replace(json.dumps(out["ref_logprobs"]), "null") == before  # the rest, byte for byte


def test_split_group_takes_the_prompt_up_to_the_first_trained_token():
    group = {"tokens": [[5, 6, 7, 8, 9, 10]], "masks": [[-100, -100, 7, -100, 9, 10]], "scores": [0.5],
             "inference_logprobs": [[1.0, 1.0, -0.5, 1.0, -0.25, -2.0]]}
    (row,) = split_group(group, "g.jsonl: line 1")
    assert row.prompt.tolist() == [5, 6] and row.response.tolist() == [7, 8, 9, 10]
    assert row.mask.tolist() == [1, 0, 1, 1]
    assert row.policy.tolist() == [-0.5, 1.0, -0.25, -2.0] and row.reward == 0.5


@pytest.mark.parametrize(("change", "message"), [
    (lambda g: g["masks"][1].__setitem__(4, 99), ("line 2, completion 1, position 4: masks holds 99 where tokens "
                                                  "holds 9; a trained position's mask is its token id")),
    (lambda g: g["masks"][0].pop(), "line 2, completion 0: masks holds 5 values and tokens 6"),
    (lambda g: g.__setitem__("scores", [1.0]), "line 2: scores must hold one entry per completion (2, as tokens)"),
    (lambda g: g["inference_logprobs"][0].pop(), "line 2, completion 0: inference_logprobs holds 5 values"),
])
def test_a_bad_group_is_named_with_its_line_completion_and_position(tmp_path, change, message):
    good = {"tokens": [[5, 6, 7, 8, 9, 10]] * 2, "masks": [[-100, -100, 7, 8, 9, 10]] * 2, "scores": [1.0, 0.0],
            "inference_logprobs": [[1.0, 1.0, -0.5, -0.5, -0.5, -0.5]] * 2}
    bad = json.loads(json.dumps(good))
    change(bad)
    path = tmp_path / "groups.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(InputError) as caught:
        reader.scan(path)
    assert str(caught.value) == f"{path}: {message}" or str(caught.value).startswith(f"{path}: {message}")


def test_the_cli_refuses_a_bad_group_in_one_line_before_the_model_loads(tmp_path):
    path = tmp_path / "groups.jsonl"
    path.write_text(json.dumps({"tokens": [[5, 6, 7]], "masks": [[-100, 6, 8]], "scores": [1.0]}) + "\n")
    result = run_cli("precompute", "-m", "no/such-model", str(path))
    assert result.returncode == 2
    assert result.stderr == (f"Error: {path}: line 1, completion 0, position 2: masks holds 8 where tokens holds 7; "
                             "a trained position's mask is its token id, an untrained one's -100\n")


def test_rollout_format_atropos_refuses_rows_that_are_not_groups(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt_ids": [1, 2], "response_ids": [3], "reward": 1.0}) + "\n")
    result = run_cli("precompute", "-m", "no/such-model", str(path), "--rollout-format", "atropos")
    assert result.returncode == 2
    assert result.stderr == (f"Error: {path}: line 1 is not an Atropos group (needs tokens, masks and scores; found "
                             "prompt_ids, response_ids, reward)\n")
    parquet = run_cli("precompute", "-m", "no/such-model", str(SAMPLE / "rollouts.parquet"), "--rollout-format",
                      "atropos")
    assert parquet.returncode == 2
    assert parquet.stderr.startswith(f"Error: {SAMPLE / 'rollouts.parquet'}: --rollout-format atropos reads JSON "
                                     "Lines of Atropos groups")


def test_score_refuses_to_write_groups_from_a_cache_of_plain_rows(tmp_path):
    cache = write_cache(tmp_path / "plain.parquet", make_rows(4))
    result = run_cli("score", str(cache), "-o", str(tmp_path / "x.jsonl"))
    assert result.returncode == 2
    assert "not made from Atropos groups (no atropos_group column)" in result.stderr
    assert not (tmp_path / "x.jsonl").exists()


def test_a_server_that_is_down_is_one_line_and_a_non_zero_exit(stages, tmp_path):
    cached, _, _ = stages
    (port,) = free_ports(1)  # nothing listens there
    output = tmp_path / "out.jsonl"
    result = run_cli("score", str(cached), "-o", str(output), "--atropos-api", f"http://127.0.0.1:{port}")
    assert result.returncode == 69
    lines_out = result.stderr.strip().splitlines()
    assert lines_out[-1].startswith(f"Error: http://127.0.0.1:{port}/scored_data_list: cannot post groups 1 to 4 "
                                    "after 4 tries (")
    assert "rerun the same command" in lines_out[-1]
    assert output.exists() and not (tmp_path / "out.jsonl.posted.json").exists()


def test_fill_line_changes_only_the_values_it_is_given():
    line = ('{"tokens":[[1,2]],  "scores" : [1.0, 2e-05],"messages":[{"role":"user","content":"é \\"x\\""}],'
            '"overrides":null}')
    filled = fill_line(line, {"scores": [0.5, -1.25], "overrides": [{"a": 1}], "ref_logprobs": [[1.0, -0.5]]})
    assert filled == ('{"tokens":[[1,2]],  "scores" : [0.5,-1.25],"messages":[{"role":"user","content":"é \\"x\\""}],'
                      '"overrides":[{"a":1}],"ref_logprobs":[[1.0,-0.5]]}')
    spaced = fill_line('{"tokens": [[1]], "scores": [1]}', {"scores": [0.0], "ref_logprobs": [[1.0]]})
    assert spaced == '{"tokens": [[1]], "scores": [0.0], "ref_logprobs": [[1.0]]}'
