"""Trainers' padded batches in `klpipe precompute`: verl's batch keys (parquet, JSON Lines, a datasets directory,
DataProto.save_to_disk), OpenRLHF's experience fields, ids that carry pads, mask-like columns, and verl's
rollout dump (refused).

verl's rows are built as verl 0.9.1's agent loop builds them: `_agent_loop_postprocess` pads each row's prompt
on the left and its response and mask on the right with `tokenizer.pad(..., padding="max_length")`,
`response_mask = mask * attention_mask`, and `_postprocess` stacks them under the batch keys. verl's module
imports ray, hydra and its rollout servers at import, so the same calls are made here on the same tokenizer;
the DataProto file is saved by verl's own `DataProto` (`make test-trl`, which installs the wheel).
"""

import json
import os
import pickle
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from klpipe.cli import app
from klpipe.errors import InputError
from klpipe.precompute import PrecomputeConfig, precompute
from klpipe.precompute.rollouts import iter_chunks, open_rollouts
from klpipe.precompute.tokenize import ChunkTokenizer
from tests.helpers import ROOT, TINY_GEMMA, oracle_logprobs

TOLERANCE = 1e-4
PROMPT_WIDTH, RESPONSE_WIDTH = 12, 18
VERL_DIR = ROOT / ".venv" / "verl"  # make test-trl's --target install of the wheel


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_GEMMA)


@pytest.fixture(scope="module")
def oracle():
    return AutoModelForCausalLM.from_pretrained(TINY_GEMMA, dtype=torch.float32).eval()


def trajectories(seed: int = 0, rows: int = 5) -> list[dict]:
    """Unpadded rows: a prompt (BOS first), a response whose middle rows hold a tool's result (mask 0) between two
    sampled turns, each turn ending in the EOS the policy sampled, and the sampler's logprobs."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(rows):
        prompt = [2] + rng.integers(5, 500, size=2 + i).tolist()
        first = rng.integers(5, 500, size=2 + i).tolist() + [1]
        tool = rng.integers(5, 500, size=3).tolist() if i % 2 else []
        second = rng.integers(5, 500, size=2).tolist() + [1] if i % 2 else []
        response = first + tool + second
        mask = [1] * len(first) + [0] * len(tool) + [1] * len(second)
        logprobs = (rng.normal(size=len(response)) - 2).astype(np.float32)
        logprobs[np.asarray(mask) == 0] = 0.0  # the sampler never saw a tool's tokens
        out.append({"prompt": prompt, "response": response, "mask": mask, "logprobs": logprobs.tolist(),
                    "score": float(rng.random())})
    return out


def verl_batch(tokenizer, rows: list[dict]) -> dict[str, list]:
    """The rows as verl's agent loop pads and stacks them (`_agent_loop_postprocess`, `_postprocess`)."""
    def pad(tokens, width, side, attention):
        # verl's _pad_token_ids, call for call
        tokenizer.padding_side = side
        padded = tokenizer.pad({"input_ids": tokens}, padding="max_length", max_length=width, return_tensors="pt",
                               return_attention_mask=attention)
        if padded["input_ids"].dim() == 1:
            padded["input_ids"] = padded["input_ids"].unsqueeze(0)
            if attention:
                padded["attention_mask"] = padded["attention_mask"].unsqueeze(0)
        return padded

    batch = {key: [] for key in ("prompts", "responses", "response_mask", "attention_mask", "input_ids",
                                 "rollout_log_probs", "old_log_probs", "token_level_scores", "uid")}
    for i, row in enumerate(rows):
        prompt = pad(row["prompt"], PROMPT_WIDTH, "left", True)
        response = pad(row["response"], RESPONSE_WIDTH, "right", True)
        mask = pad(row["mask"], RESPONSE_WIDTH, "right", False)
        response_mask = mask["input_ids"] * response["attention_mask"]
        attention = torch.cat([prompt["attention_mask"], response["attention_mask"]], dim=1)
        padded_logprobs = row["logprobs"] + [0.0] * (RESPONSE_WIDTH - len(row["logprobs"]))
        scores = torch.zeros(RESPONSE_WIDTH)
        scores[len(row["response"]) - 1] = row["score"]  # rm_scores: the score at the last response token
        batch["prompts"].append(prompt["input_ids"][0].tolist())
        batch["responses"].append(response["input_ids"][0].tolist())
        batch["response_mask"].append(response_mask[0].tolist())
        batch["attention_mask"].append(attention[0].tolist())
        batch["input_ids"].append(torch.cat([prompt["input_ids"], response["input_ids"]], dim=1)[0].tolist())
        batch["rollout_log_probs"].append(padded_logprobs)
        batch["old_log_probs"].append([v + 0.01 if v else 0.0 for v in padded_logprobs])  # the trainer's
        batch["token_level_scores"].append(scores.tolist())
        batch["uid"].append(f"task-{i // 2}")
    return batch


def klpipe(*args):
    """The command line in this process (a fresh one would load torch again: seconds a call on a busy machine)."""
    result = CliRunner().invoke(app, [str(a) for a in args], env={"KLPIPE_PROGRESS": "none", "HF_HUB_OFFLINE": "1"})
    result.returncode = result.exit_code
    return result


def run(tmp_path, inputs, name="cached.parquet", **kwargs):
    config = PrecomputeConfig(inputs=[Path(p) for p in inputs], output=tmp_path / name, model=str(TINY_GEMMA),
                              device="cpu", progress="none", **kwargs)
    return precompute(config, log=lambda message: None)


def tokenize(tokenizer, path):
    """The file's rows as precompute reads them (one chunk), without loading the model: for what is refused."""
    rollouts = open_rollouts([path])
    chunk = next(iter_chunks(rollouts, chunk_rows=64))
    return ChunkTokenizer(rollouts, tokenizer, vocab_size=len(tokenizer), max_positions=None, end_ids=[1])(chunk)


def assert_ids(rows: list[dict], tokenized) -> None:
    for i, row in enumerate(rows):
        prompt, response = tokenized.row(i)
        assert prompt.tolist() == row["prompt"] and response.tolist() == row["response"]
        assert tokenized.row_mask(i).astype(int).tolist() == row["mask"]


def assert_rows(oracle, rows: list[dict], cached: pa.Table) -> None:
    """ids and mask equal to the unpadded rows; reference logprobs at the oracle where the mask is 1, null at 0."""
    got = cached.to_pylist()
    assert len(got) == len(rows)
    for row, out in zip(rows, got, strict=True):
        assert out["prompt_ids"] == row["prompt"] and out["response_ids"] == row["response"]
        assert out["mask"] == row["mask"]
        expected = oracle_logprobs(oracle, row["prompt"], row["response"])
        for value, want, keep in zip(out["ref_logprobs"], expected, row["mask"], strict=True):
            if keep:
                assert abs(value - want) <= TOLERANCE
            else:
                assert value is None


def test_verls_batch_keys_are_read_whole_without_a_pad(tmp_path, tokenizer, oracle):
    rows = trajectories()
    batch = verl_batch(tokenizer, rows)
    assert sum(row.count(0) for row in batch["prompts"]) > 0  # the batch really is padded, with the pad id 0
    path = tmp_path / "batch.parquet"
    pq.write_table(pa.table(batch), path)
    result = klpipe("precompute", "-m", str(TINY_GEMMA), str(path), "-o", str(tmp_path / "cached.parquet"))
    assert result.returncode == 0, result.stderr
    cached = pq.read_table(tmp_path / "cached.parquet")
    assert_rows(oracle, rows, cached)
    out = cached.to_pylist()
    for row, got in zip(rows, out, strict=True):
        assert got["policy_logprobs"] == pytest.approx([v + 0.01 if v else 0.0 for v in row["logprobs"]], abs=1e-6)
        assert got["sampler_logprobs"] == pytest.approx(row["logprobs"], abs=1e-6)
        assert got["reward"] == pytest.approx(row["score"], abs=1e-6)
    assert cached.column("uid").to_pylist() == batch["uid"]  # every other key passes through
    tools = sum(row["mask"].count(0) for row in rows)
    pads = PROMPT_WIDTH * len(rows) - sum(len(r["prompt"]) for r in rows) + \
        RESPONSE_WIDTH * len(rows) - sum(len(r["response"]) for r in rows)
    scored = sum(sum(r["mask"]) for r in rows)
    assert f" {scored} response tokens in " in result.stderr
    assert f" tokens/s), besides {tools} tool tokens read as context and {pads} pads left out, " in result.stderr
    # score reads the cache's unpadded columns: KL over the sampled tokens only, against the trainer's logprobs
    scored_path = tmp_path / "scored.parquet"
    result = klpipe("score", str(tmp_path / "cached.parquet"), "-o", str(scored_path))
    assert result.returncode == 0, result.stderr
    for got in pq.read_table(scored_path).to_pylist():
        d = [p - r for p, r, m in zip(got["policy_logprobs"], got["ref_logprobs"], got["mask"], strict=True) if m]
        assert got["kl"] == pytest.approx(max(sum(d) / len(d), 0.0), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("form", ["jsonl", "datasets"])
def test_verls_batch_from_json_lines_and_a_datasets_directory(tmp_path, tokenizer, form):
    rows = trajectories(seed=1, rows=3)
    batch = verl_batch(tokenizer, rows)
    if form == "jsonl":
        path = tmp_path / "batch.jsonl"
        path.write_text("".join(json.dumps(dict(zip(batch, values, strict=True))) + "\n"
                                for values in zip(*batch.values(), strict=True)))
    else:
        import datasets

        path = tmp_path / "batch"
        datasets.Dataset.from_dict(batch).save_to_disk(str(path))
    # Read as the parquet batch is (whose logprobs the test above holds to the oracle): the same ids and mask.
    assert_ids(rows, tokenize(tokenizer, path))


def test_the_issues_mapping_of_verls_padded_prompts_is_refused(tmp_path, tokenizer):
    path = tmp_path / "batch.parquet"
    pq.write_table(pa.table(verl_batch(tokenizer, trajectories(rows=2))), path)
    result = klpipe("precompute", "-m", str(TINY_GEMMA), str(path), "-o", str(tmp_path / "out.parquet"),
                     "--column", "prompt_ids=prompts", "--column", "response_ids=responses")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        (f"Error: {path}: holds verl's batch (prompts, responses, attention_mask), which klpipe reads by its keys "
         "and unpads: drop --column prompt_ids=prompts")]
    assert not (tmp_path / "out.parquet").exists()
    # The issue's second form: the same keys beside unpadded prompt_ids, response_mask left unmapped.
    rows = trajectories(rows=2)
    table = pa.table(verl_batch(tokenizer, rows)).append_column("prompt_ids", pa.array([r["prompt"] for r in rows]))
    pq.write_table(table, path)
    with pytest.raises(InputError, match=r"holds verl's batch \(prompts, responses, attention_mask\) and a prompt_ids "
                                         r"column too; klpipe writes prompt_ids from the batch's keys"):
        open_rollouts([path])


def test_a_pad_attended_in_verls_batch_is_refused(tmp_path, tokenizer):
    batch = verl_batch(tokenizer, trajectories(rows=2))
    batch["response_mask"][1][-1] = 1  # the mask scores a pad after the response's last attended token
    path = tmp_path / "batch.parquet"
    pq.write_table(pa.table(batch), path)
    with pytest.raises(InputError, match=r"row 1: response_mask is 1 at a pad \(response position 17, after the "
                                         r"last attended token\)$"):
        tokenize(tokenizer, path)
    batch = verl_batch(tokenizer, trajectories(rows=2))
    batch["attention_mask"][0][PROMPT_WIDTH - 2] = 0  # a hole inside the prompt
    pq.write_table(pa.table(batch), path)
    with pytest.raises(InputError, match=r"row 0: attention_mask has a 0 inside the prompt"):
        tokenize(tokenizer, path)


def test_unpadded_ids_with_verls_response_mask_read_it_by_name(tmp_path, oracle):
    # The issue's second form without the padded keys: the mask is found by its name, never left unread.
    rows = trajectories(seed=2, rows=3)
    path = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"prompt_ids": [r["prompt"] for r in rows], "response_ids": [r["response"] for r in rows],
                             "response_mask": [r["mask"] for r in rows]}), path)
    summary = run(tmp_path, [path])
    table = pq.read_table(summary.output)
    assert_rows(oracle, rows, table.rename_columns([c if c != "response_mask" else "mask"
                                                    for c in table.column_names]))
    assert summary.tool_tokens == sum(r["mask"].count(0) for r in rows) and summary.pads == 0
    from klpipe import cache

    assert cache.read_provenance(summary.output).columns == {"mask": "response_mask"}  # score reads it too


@pytest.mark.parametrize("column, message", [
    ("labels", (r"column labels holds -100 where no loss is taken, over the whole sequence; klpipe would leave it "
                r"unread: give the response's mask \(1 where the policy sampled the token\) with --column mask=NAME$")),
    ("attention_mask", r"column attention_mask marks pads, which klpipe reads only in a trainer's whole batch"),
    ("tool_mask", (r"columns tool_mask and response_mask could each be the mask; name the one to use with "
                   r"--column mask=tool_mask$")),
])
def test_a_mask_like_column_is_never_left_unread(tmp_path, column, message):
    rows = trajectories(rows=2)
    columns = {"prompt_ids": [r["prompt"] for r in rows], "response_ids": [r["response"] for r in rows],
               column: [r["mask"] for r in rows]}
    if column == "tool_mask":
        columns["response_mask"] = columns[column]
    path = tmp_path / "ids.parquet"
    pq.write_table(pa.table(columns), path)
    with pytest.raises(InputError, match=message):
        open_rollouts([path])


def test_pads_in_ids_are_refused_or_left_out(tmp_path, tokenizer, oracle):
    rows = trajectories(seed=3, rows=2)
    prompts, responses = [r["prompt"] for r in rows], [r["response"] for r in rows]
    path = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"prompt_ids": [[0, 0] + prompts[0], prompts[1]], "response_ids": responses}), path)
    with pytest.raises(InputError, match=r"ids.parquet: row 0: prompt_ids starts with 2 pad tokens \(id 0\): left "
                                         r"padding would be fed as context the policy never saw"):
        tokenize(tokenizer, path)
    pq.write_table(pa.table({"prompt_ids": prompts, "response_ids": [responses[0], responses[1] + [0, 0]]}), path)
    with pytest.raises(InputError, match=r"row 1: response_ids ends with 2 pad tokens \(id 0\) and no mask: they "
                                         r"would be scored as sampled"):
        tokenize(tokenizer, path)
    # A mask that holds 0 at them: never fed nor scored, counted as pads and not as a tool's tokens.
    masks = [r["mask"] for r in rows]
    pq.write_table(pa.table({"prompt_ids": prompts, "response_ids": [responses[0], responses[1] + [0, 0]],
                             "mask": [masks[0], masks[1] + [0, 0]]}), path)
    summary = run(tmp_path, [path], name="c.parquet")
    assert summary.pads == 2 and summary.tool_tokens == sum(m.count(0) for m in masks)
    out = pq.read_table(summary.output).to_pylist()
    assert out[1]["ref_logprobs"][-2:] == [None, None]
    assert_rows(oracle, rows, pa.Table.from_pylist([{**o, "response_ids": o["response_ids"][:len(r["response"])],
                                                     "mask": o["mask"][:len(r["response"])],
                                                     "ref_logprobs": o["ref_logprobs"][:len(r["response"])]}
                                                    for o, r in zip(out, rows, strict=True)]))


def openrlhf_experience(tokenizer, rows: list[dict]) -> dict[str, list]:
    """The rows as OpenRLHF's Experience holds them: `sequences` (prompt left-padded, response right-padded),
    `attention_mask` over it, `action_mask` and `action_log_probs` over its last num_actions positions."""
    out = {key: [] for key in ("sequences", "attention_mask", "action_mask", "action_log_probs")}
    for row in rows:
        left = PROMPT_WIDTH - len(row["prompt"])
        right = RESPONSE_WIDTH - len(row["response"])
        out["sequences"].append([tokenizer.pad_token_id] * left + row["prompt"] + row["response"]
                                + [tokenizer.pad_token_id] * right)
        out["attention_mask"].append([0] * left + [1] * (len(row["prompt"]) + len(row["response"])) + [0] * right)
        out["action_mask"].append(row["mask"] + [0] * right)
        out["action_log_probs"].append(row["logprobs"] + [0.0] * right)
    return out


def test_openrlhfs_experience_fields_are_read_whole(tmp_path, tokenizer, oracle):
    rows = trajectories(seed=4, rows=3)
    path = tmp_path / "experience.parquet"
    pq.write_table(pa.table(openrlhf_experience(tokenizer, rows)), path)
    summary = run(tmp_path, [path])
    cached = pq.read_table(summary.output)
    assert_rows(oracle, rows, cached)
    for row, got in zip(rows, cached.to_pylist(), strict=True):
        assert got["policy_logprobs"] == pytest.approx(row["logprobs"], abs=1e-6)
    experience = openrlhf_experience(tokenizer, rows)
    experience["action_mask"][2][-1] = 1  # an action at a pad
    pq.write_table(pa.table(experience), path)
    with pytest.raises(InputError, match=r"row 2: action_mask is 1 at a pad"):
        tokenize(tokenizer, path)


def test_openrlhfs_unpadded_layout_is_read_exactly(tmp_path, tokenizer, oracle):
    # OpenRLHF's sample maker of late (experience.py's `action_mask: (B, A)` with A = T - 1): `sequences` is
    # prompt + response unpadded and right-padded in the batch, `action_mask` the full sequence's mask less its first
    # position (0 over the prompt). The masked run before the first action is the prompt: context, never scored, and
    # not counted as a tool's tokens. The sampled tokens' logprobs are the oracle's all the same.
    rows = trajectories(seed=6, rows=3)
    width = max(len(r["prompt"]) + len(r["response"]) for r in rows) + 2
    experience = {key: [] for key in ("sequences", "attention_mask", "action_mask", "action_log_probs")}
    for row in rows:
        sequence = row["prompt"] + row["response"]
        right = width - len(sequence)
        full_mask = [0] * len(row["prompt"]) + row["mask"]
        experience["sequences"].append(sequence + [tokenizer.pad_token_id] * right)
        experience["attention_mask"].append([1] * len(sequence) + [0] * right)
        experience["action_mask"].append(full_mask[1:] + [0] * right)
        experience["action_log_probs"].append([0.0] * (len(row["prompt"]) - 1) + row["logprobs"] + [0.0] * right)
    path = tmp_path / "experience.parquet"
    pq.write_table(pa.table(experience), path)
    summary = run(tmp_path, [path])
    for row, got in zip(rows, pq.read_table(summary.output).to_pylist(), strict=True):
        first = row["mask"].index(1)  # a response opening on a tool's tokens: those are context too
        assert got["prompt_ids"] == row["prompt"] + row["response"][:first]
        assert got["response_ids"] == row["response"][first:] and got["mask"] == row["mask"][first:]
        expected = oracle_logprobs(oracle, row["prompt"], row["response"])[first:]
        for value, want, keep in zip(got["ref_logprobs"], expected, got["mask"], strict=True):
            assert (abs(value - want) <= TOLERANCE) if keep else value is None
        assert got["policy_logprobs"] == pytest.approx(row["logprobs"][first:], abs=1e-6)
    assert summary.tool_tokens == sum(row["mask"][row["mask"].index(1):].count(0) for row in rows)


def test_verls_rollout_dump_is_refused_in_one_line(tmp_path, tokenizer):
    # As ray_trainer's _log_rollout_data and _write_generations write it: batch_decode(skip_special_tokens=True).
    rows = trajectories(rows=3)
    batch = verl_batch(tokenizer, rows)
    inputs = tokenizer.batch_decode(torch.tensor(batch["prompts"]), skip_special_tokens=True)
    outputs = tokenizer.batch_decode(torch.tensor(batch["responses"]), skip_special_tokens=True)
    scores = torch.tensor(batch["token_level_scores"]).sum(-1).tolist()
    path = tmp_path / "3.jsonl"
    path.write_text("".join(json.dumps({"input": i, "output": o, "gts": None, "score": s, "step": 3}) + "\n"
                            for i, o, s in zip(inputs, outputs, scores, strict=True)))
    for mapping in ([], ["--column", "prompt=input", "--column", "response=output"]):
        result = klpipe("precompute", "-m", str(TINY_GEMMA), str(path), "-o", str(tmp_path / "out.parquet"),
                         *mapping)
        assert result.returncode == 2
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"Error: {path}: is verl's rollout dump "
                                                       "(trainer.rollout_data_dir: input, output, score, step)")
        assert "special tokens skipped and tool results unmasked" in lines[0]
        assert not (tmp_path / "out.parquet").exists()


class Payload:
    """Unpickled by pickle, it would create a file: klpipe must refuse it unrun."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_is_no_dataproto_is_refused_unrun(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "gen_batch.dp"
    path.write_bytes(pickle.dumps(Payload(marker)))
    result = klpipe("precompute", "-m", str(TINY_GEMMA), str(path), "-o", str(tmp_path / "out.parquet"))
    assert result.returncode == 2 and not marker.exists()
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"Error: {path}: a pickle holding posix.system, which klpipe does not load "
                               "(unpickling runs code from the file)")


@pytest.mark.trl
def test_a_dataproto_saved_by_verl_is_read(tmp_path, tokenizer, oracle):
    # verl's own DataProto (the wheel make test-trl installs; its protocol module needs tensordict, ray, omegaconf).
    if not VERL_DIR.exists():
        pytest.skip("make test-trl installs verl")
    sys.path.insert(0, str(VERL_DIR))
    try:
        protocol = pytest.importorskip("verl.protocol")
    finally:
        sys.path.remove(str(VERL_DIR))
    rows = trajectories(seed=5, rows=4)
    batch = verl_batch(tokenizer, rows)
    tensors = {key: torch.tensor(values) for key, values in batch.items() if key != "uid"}
    extras = np.empty(len(rows), dtype=object)
    extras[:] = [{"turns": i} if i % 2 else None for i in range(len(rows))]
    proto = protocol.DataProto.from_dict(tensors=tensors, non_tensors={"uid": np.array(batch["uid"], dtype=object),
                                                                       "extras": extras},
                                         meta_info={"metrics": [{}]})
    path = tmp_path / "gen_batch.dp"
    proto.save_to_disk(str(path))
    cached = pq.read_table(run(tmp_path, [path]).output)
    assert_rows(oracle, rows, cached)
    assert cached.column("uid").to_pylist() == batch["uid"]
    assert cached.column("rollout_log_probs").type == pa.list_(pa.float32())
