"""Atropos groups against atroposlib 0.4.0's own code: its ManagedServer builds the groups, its JSON Lines writer saves
them, its `ScoredData` model validates what klpipe writes back, and its API server (`run-api`, started here on
127.0.0.1) takes the scored groups from klpipe and hands them to a trainer through `/register` and `/batch`.

`make test-atropos` installs atroposlib (a test-only dependency, never klpipe's) and runs this directory.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from atroposlib.api.server import ScoredData

from klpipe.atropos.post import ApiError, post_groups
from sample_data import generate_atropos
from tests.helpers import SAMPLE, TINY_GEMMA, free_ports, oracle_logprobs, run_cli

GROUPS = SAMPLE / "atropos_groups.jsonl"
TOLERANCE = 1e-4
FILLED = ("ref_logprobs", "scores", "overrides")


def lines(path: Path) -> list[str]:
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Fresh groups from ManagedServer (another seed than the sample's), saved with atroposlib's writer."""
    import torch

    torch.manual_seed(1)
    groups = asyncio.run(generate_atropos.build_groups(generate_atropos.PolicySampler(seed=1)))
    path = tmp_path_factory.mktemp("built") / "groups.jsonl"
    generate_atropos.write_groups(groups, path)
    return path


@pytest.fixture(scope="module")
def stages(built):
    """`klpipe precompute` and `klpipe score` on the built groups, as docs/formats.md runs them."""
    cached, scored = built.with_name("groups.cached.parquet"), built.with_name("groups.scored.jsonl")
    for args in (("precompute", "-m", str(TINY_GEMMA), str(built), "-o", str(cached)),
                 ("score", str(cached), "-o", str(scored))):
        result = run_cli(*args)
        assert result.returncode == 0, result.stderr
    return built, cached, scored


@pytest.fixture
def api_server(tmp_path):
    """atroposlib's `run-api` on 127.0.0.1 and a free port; stopped by its pid."""
    (port,) = free_ports(1)
    run_api = Path(sys.executable).with_name("run-api")
    log = open(tmp_path / "run-api.log", "w")  # noqa: SIM115 - the server writes into it until the finally below
    process = subprocess.Popen([str(run_api), "--host", "127.0.0.1", "--port", str(port)], stdout=log,
                               stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(url + "/", timeout=2) as response:
                    assert json.loads(response.read()) == {"message": "AtroposLib API"}
                break
            except OSError:
                assert process.poll() is None, (tmp_path / "run-api.log").read_text()
                assert time.monotonic() < deadline, "run-api did not answer within 60 s"
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def call(url: str, path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def register_trainer(url: str, batch_size: int) -> None:
    """What atroposlib's example trainer posts before it asks for batches."""
    call(url, "/register", {"wandb_group": "test", "wandb_project": "klpipe", "batch_size": batch_size,
                            "max_token_len": 4096, "checkpoint_dir": "checkpoints", "save_checkpoint_interval": 10,
                            "starting_step": 0, "num_steps": 1})


def test_the_sample_is_what_managed_server_builds_and_its_writer_writes(tmp_path):
    import torch

    torch.manual_seed(0)
    groups = asyncio.run(generate_atropos.build_groups(generate_atropos.PolicySampler()))
    generate_atropos.write_groups(groups, tmp_path / "again.jsonl")
    # Every field as committed; the sampler's logprobs to fp32 rounding, which moves with the CPU's kernels (the
    # committed file was made on a machine whose fp32 matmuls round otherwise: 7th digit).
    again = [json.loads(line) for line in (tmp_path / "again.jsonl").read_text().splitlines()]
    committed = [json.loads(line) for line in GROUPS.read_text().splitlines()]
    assert len(again) == len(committed)
    for new, old in zip(again, committed, strict=True):
        assert {k: v for k, v in new.items() if k != "inference_logprobs"} == \
            {k: v for k, v in old.items() if k != "inference_logprobs"}
        for ours, theirs in zip(new["inference_logprobs"], old["inference_logprobs"], strict=True):
            assert ours == pytest.approx(theirs, rel=0, abs=1e-5)
    # Single turn: the prompt masked; multi-turn: a tool's suffix masked between two trained turns.
    masks = [mask for group in groups for mask in group["masks"]]
    runs = [np.flatnonzero(np.diff((np.array(mask) != -100).astype(int))).size for mask in masks]
    assert 1 in runs and 3 in runs
    for group in groups:
        for mask, logprobs in zip(group["masks"], group["inference_logprobs"], strict=True):
            assert all(value == 1.0 for m, value in zip(mask, logprobs, strict=True) if m == -100)


def test_both_stages_on_managed_server_groups(stages):
    built, _, scored = stages
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TINY_GEMMA, dtype=torch.float32).eval()
    worst = 0.0
    for before, after in zip(lines(built), lines(scored), strict=True):
        group, out = json.loads(before), json.loads(after)
        ScoredData(**out)  # atroposlib's own model takes the group as klpipe wrote it
        assert list(out) == list(group)
        for key, value in group.items():
            if key not in FILLED:  # byte for byte: the writer's text of the field, found verbatim in the output
                assert f"{json.dumps(key)}: {json.dumps(value, ensure_ascii=False)}" in after, key
        for tokens, mask, ref in zip(group["tokens"], group["masks"], out["ref_logprobs"], strict=True):
            expected = oracle_logprobs(model, tokens[:1], tokens[1:])  # expected[p - 1]: position p's
            for p, m in enumerate(mask):
                if m == -100:
                    assert ref[p] == 1.0
                else:
                    worst = max(worst, abs(ref[p] - float(expected[p - 1])))
        for i, score in enumerate(out["scores"]):
            overrides = out["overrides"][i]
            assert overrides["klpipe_raw_score"] == group["scores"][i]
            assert score == pytest.approx(group["scores"][i] - overrides["klpipe_kl_coeff"] * overrides["klpipe_kl"])
    assert worst <= TOLERANCE


def test_precompute_alone_writes_groups_scored_data_takes(stages, tmp_path):
    built, _, _ = stages
    output = tmp_path / "groups.ref.jsonl"
    result = run_cli("precompute", "-m", str(TINY_GEMMA), str(built), "--output-format", "atropos", "-o", str(output))
    assert result.returncode == 0, result.stderr
    for before, after in zip(lines(built), lines(output), strict=True):
        out = ScoredData(**json.loads(after))
        assert out.ref_logprobs is not None and len(out.ref_logprobs) == len(json.loads(before)["tokens"])
        assert after.replace(json.dumps(json.loads(after)["ref_logprobs"]), "null") == before


def test_the_trainer_gets_klpipe_reference_logprobs_and_scores_from_the_api_server(stages, api_server, tmp_path):
    _, cached, _ = stages
    completions = sum(len(json.loads(line)["tokens"]) for line in lines(stages[0]))
    register_trainer(api_server, batch_size=completions)
    output = tmp_path / "posted.jsonl"
    result = run_cli("score", str(cached), "-o", str(output), "--atropos-api", api_server)
    assert result.returncode == 0, result.stderr
    assert f"Posted 4 group(s) to {api_server}" in result.stderr
    assert call(api_server, "/status")["queue_size"] == 4
    batch = call(api_server, "/batch")["batch"]
    written = [json.loads(line) for line in lines(output)]
    assert [group["tokens"] for group in batch] == [group["tokens"] for group in written]  # in order
    assert [group["ref_logprobs"] for group in batch] == [group["ref_logprobs"] for group in written]
    assert [group["scores"] for group in batch] == [group["scores"] for group in written]
    assert [group["overrides"] for group in batch] == [group["overrides"] for group in written]
    # A rerun of the same command writes the same groups, and the server has them all: nothing is posted twice.
    again = run_cli("score", str(cached), "-o", str(output), "--atropos-api", api_server)
    assert again.returncode == 0, again.stderr
    assert "Posted 0 group(s)" in again.stderr
    assert call(api_server, "/status")["queue_size"] == 0


def test_a_server_that_was_down_gets_every_group_on_the_rerun(stages, tmp_path):
    _, cached, _ = stages
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    output = tmp_path / "late.jsonl"
    down = run_cli("score", str(cached), "-o", str(output), "--atropos-api", url)
    assert down.returncode == 69 and down.stderr.strip().splitlines()[-1].startswith(f"Error: {url}/scored_data_list")
    run_api = Path(sys.executable).with_name("run-api")
    process = subprocess.Popen([str(run_api), "--host", "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            try:
                call(url, "/")
                break
            except OSError:
                time.sleep(0.2)
        register_trainer(url, batch_size=8)
        rerun = run_cli("score", str(cached), "-o", str(output), "--atropos-api", url)
        assert rerun.returncode == 0, rerun.stderr
        assert "Posted 4 group(s)" in rerun.stderr
        assert len(call(url, "/batch")["batch"]) == 4
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_a_refused_group_stops_the_posting_and_a_rerun_sends_only_what_was_not_taken(stages, api_server, tmp_path):
    _, _, scored = stages
    groups = [json.loads(line) for line in lines(scored)]
    groups[2]["messages"] = [[{"role": "user"}]] * len(groups[2]["tokens"])  # no content: ScoredData refuses it
    path = tmp_path / "refused.jsonl"
    path.write_text("".join(json.dumps(group) + "\n" for group in groups))
    register_trainer(api_server, batch_size=100)
    with pytest.raises(ApiError, match=r"refused group 3: HTTP 422"):
        post_groups(path, api_server, per_request=1)
    assert json.loads((tmp_path / "refused.jsonl.posted.json").read_text())["groups"] == 2
    assert call(api_server, "/status")["queue_size"] == 2
    with pytest.raises(ApiError, match=r"refused group 3: HTTP 422"):
        post_groups(path, api_server, per_request=1)  # starts at group 3: groups 1 and 2 are not sent again
    assert call(api_server, "/status")["queue_size"] == 2
