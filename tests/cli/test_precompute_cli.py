"""`klpipe precompute` as a user runs it: options, environment, help, and every bad-input message."""

import gzip
import json
import re
import shutil
from contextlib import contextmanager

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from klpipe.cli import app
from tests.helpers import (
    CONVERSATIONAL,
    ROLLOUTS,
    TINY_GEMMA,
    TINY_LLAMA,
    agent_rollouts,
    per_row_tokens,
    run_cli,
)

runner = CliRunner()


def precompute(*args, env=None):
    return runner.invoke(app, ["precompute", *map(str, args)], env={"KLPIPE_PROGRESS": "none", **(env or {})})


def write(tmp_path, name, columns: dict | pa.Table) -> str:
    path = tmp_path / name
    pq.write_table(columns if isinstance(columns, pa.Table) else pa.table(columns), path)
    return str(path)


def assert_bad_input(result, message, tmp_path):
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == f"Error: {message}"
    assert "Traceback" not in result.output
    # Nothing is left under any output name, and no work directory either.
    assert not [p.name for p in tmp_path.iterdir() if "out" in p.name]


def test_help_shows_examples():
    result = runner.invoke(app, ["precompute", "--help"])
    assert result.exit_code == 0
    assert "Examples:" in result.output and "klpipe precompute --model google/gemma-4-E2B" in result.output


def test_version():
    from klpipe import __version__

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output == f"klpipe {__version__}\n"


def test_every_command_has_help():
    for command in ("precompute", "score"):
        result = runner.invoke(app, [command, "--help"])
        assert result.exit_code == 0 and "Example" in result.output


def test_python_dash_m_and_environment_variables(tmp_path):
    out = tmp_path / "env.parquet"
    result = run_cli("precompute", str(ROLLOUTS),
                     env={"KLPIPE_MODEL": str(TINY_LLAMA), "KLPIPE_OUTPUT": str(out), "KLPIPE_DEVICE": "cpu",
                          "KLPIPE_TEMPERATURE": "1.25"})
    assert result.returncode == 0, result.stderr
    metadata = json.loads(pq.read_schema(out).metadata[b"klpipe"])
    assert metadata["model"] == str(TINY_LLAMA) and metadata["temperature"] == 1.25
    # Under a non-terminal (cron, Slurm) the summary is a plain line on stderr; stdout stays clean.
    assert result.stdout == ""
    assert "wrote" in result.stderr and "tokens/s" in result.stderr and "padding efficiency" in result.stderr


def test_log_lines_instead_of_a_bar_without_a_terminal(tmp_path):
    result = run_cli("precompute", "-m", str(TINY_GEMMA), str(ROLLOUTS), "-o", str(tmp_path / "o.parquet"),
                     "--chunk-rows", "4", "--log-interval", "0")
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("progress: ")]
    assert len(lines) == 12  # one per 4-row chunk of 48 rows
    assert lines[-1].startswith("progress: 48/48 rows (100.0%)")
    assert "\r" not in result.stderr  # no bar redraws in a log file


def test_default_output_name_beside_the_input(tmp_path):
    source = tmp_path / "day1.parquet"
    shutil.copy(ROLLOUTS, source)
    result = precompute("-m", TINY_LLAMA, source)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "day1.cached.parquet").is_file()


def test_output_that_is_also_the_input_is_refused_even_with_overwrite(tmp_path):
    source = tmp_path / "day.parquet"
    shutil.copy(ROLLOUTS, source)
    result = precompute("-m", TINY_LLAMA, source, "-o", source, "--overwrite")
    assert_bad_input(result, f"{source}: is also an input; pass another --output", tmp_path)
    assert source.read_bytes() == ROLLOUTS.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["day.parquet"]


@contextmanager
def killed_while_merging(monkeypatch):
    """Within the block, a precompute run is interrupted as it merges: every chunk done and no output, as a kill
    there leaves it."""
    from klpipe.precompute.workdir import WorkDir

    def merge_into(self, output):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(WorkDir, "merge_into", merge_into)
        yield


def test_a_rerun_that_finds_every_chunk_done_says_it_resumed(tmp_path, monkeypatch):
    out = tmp_path / "cached.parquet"
    with killed_while_merging(monkeypatch):
        assert precompute("-m", TINY_LLAMA, ROLLOUTS, "-o", out, "--chunk-rows", "8").exit_code == 130
    rerun = precompute("-m", TINY_LLAMA, ROLLOUTS, "-o", out, "--chunk-rows", "8")
    assert rerun.exit_code == 0, rerun.output
    work = tmp_path / "cached.parquet.partial"
    assert rerun.stderr.splitlines()[0] == f"resuming: 6 of 6 chunks already done in {work}"
    assert rerun.stderr.splitlines()[1].startswith(
        f"wrote {out}: all 6 chunks (48 rows) finished by an earlier run, nothing left to compute; peak memory rss ")
    assert pq.read_table(out).num_rows == 48 and not work.exists()


def test_work_dir_moves_the_checkpoints_of_a_local_output(tmp_path, monkeypatch):
    """--work-dir (KLPIPE_WORK_DIR): the chunks go there, named by the output and a hash of its path; the
    output is still written beside itself, so a work directory on another filesystem costs no copy."""
    out, scratch = tmp_path / "out" / "cached.parquet", tmp_path / "scratch"
    with killed_while_merging(monkeypatch):
        first = precompute("-m", TINY_LLAMA, ROLLOUTS, "-o", out, "--chunk-rows", "8",
                           env={"KLPIPE_WORK_DIR": str(scratch)})
        assert first.exit_code == 130
    (work,) = scratch.iterdir()
    assert re.fullmatch(r"cached\.parquet\.[0-9a-f]{12}\.partial", work.name)
    assert len(list(work.glob("chunk-*.parquet"))) == 6 and not out.parent.exists()
    rerun = precompute("-m", TINY_LLAMA, ROLLOUTS, "-o", out, "--chunk-rows", "8", "--work-dir", scratch)
    assert rerun.exit_code == 0, rerun.output
    assert rerun.stderr.splitlines()[0] == f"resuming: 6 of 6 chunks already done in {work}"
    assert pq.read_table(out).num_rows == 48
    assert list(scratch.iterdir()) == [] and [p.name for p in out.parent.iterdir()] == ["cached.parquet"]
    refused = precompute("-m", TINY_LLAMA, ROLLOUTS, "-o", out, "--work-dir", "s3://bucket/work")
    assert refused.exit_code == 2
    assert refused.stderr.strip() == ("Error: --work-dir s3://bucket/work: the work directory holds the checkpoints "
                                      "a rerun resumes from and must be on local disk")


def test_missing_columns(tmp_path):
    path = write(tmp_path, "in.parquet", {"id": ["a"], "prompt_ids": [[2, 5]]})
    result = precompute("-m", TINY_GEMMA, path, "-o", tmp_path / "out.parquet")
    assert_bad_input(result, f"{path}: missing columns: needs prompt_ids and response_ids (token ids), "
                             "or prompt and response or completion (text, or TRL conversational messages); "
                             "found id, prompt_ids", tmp_path)
    mapped = precompute("-m", TINY_GEMMA, path, "-o", tmp_path / "out.parquet", "--column", "response=answer",
                        "--column", "response_ids=answer_ids")
    assert_bad_input(mapped, f"{path}: --column response=answer: no column 'answer'; found id, prompt_ids", tmp_path)


def test_wrong_column_type(tmp_path):
    path = write(tmp_path, "in.parquet", {"prompt_ids": [["a"]], "response_ids": [[1]]})
    result = precompute("-m", TINY_GEMMA, path, "-o", tmp_path / "out.parquet")
    assert_bad_input(result, (f"{path}: column prompt_ids must be a list of integer token ids, "
                              "found list<element: string>"), tmp_path)


def test_empty_prompt_in_token_id_mode(tmp_path):
    path = write(tmp_path, "in.parquet", {"id": ["a", "b"], "prompt_ids": [[2, 7], []], "response_ids": [[5], [6]]})
    result = precompute("-m", TINY_GEMMA, path, "-o", tmp_path / "out.parquet")
    assert_bad_input(result, f"{path}: row 1 (id 'b'): prompt_ids is empty "
                             "(a response needs at least one prompt token)", tmp_path)


def test_empty_prompt_in_text_mode(tmp_path):
    path = write(tmp_path, "in.parquet", {"prompt": ["hello", ""], "response": ["a", "b"]})
    result = precompute("-m", TINY_GEMMA, path, "-o", tmp_path / "out.parquet")
    assert_bad_input(result, f"{path}: row 1: prompt is empty", tmp_path)


def test_token_id_out_of_vocabulary(tmp_path):
    path = write(tmp_path, "in.parquet", {"id": ["a", "b", "c"], "prompt_ids": [[2, 7], [2, 8], [2, 9]],
                                          "response_ids": [[5], [6, 99999], [7]]})
    result = precompute("-m", TINY_GEMMA, path, "-o", tmp_path / "out.parquet")
    assert_bad_input(result, f"{path}: row 1 (id 'b'): token id 99999 in response_ids is outside "
                             "the model's vocabulary (0..511)", tmp_path)


def test_null_inside_a_token_list(tmp_path):
    path = write(tmp_path, "in.parquet", {"id": ["a", "b", "c"], "prompt_ids": [[2, 7], [2, 8], [2, 9]],
                                          "response_ids": [[5], [6, None, 7], [7]]})
    result = precompute("-m", TINY_GEMMA, path, "-o", tmp_path / "out.parquet")
    assert_bad_input(result, f"{path}: row 1 (id 'b'): response_ids holds a null", tmp_path)


def test_row_longer_than_context(tmp_path):
    path = write(tmp_path, "in.parquet", {"prompt_ids": [[2] * 10, [2] * 500], "response_ids": [[5], [6] * 20]})
    result = precompute("-m", TINY_GEMMA, path, "-o", tmp_path / "out.parquet")
    assert_bad_input(result, f"{path}: row 1: 520 tokens (prompt + response) exceed the model's context of 512",
                     tmp_path)


def test_corrupt_input_file(tmp_path):
    path = tmp_path / "in.parquet"
    path.write_bytes(b"PAR1 this is not parquet at all")
    result = precompute("-m", TINY_GEMMA, path, "-o", tmp_path / "out.parquet")
    assert result.exit_code == 2
    assert result.stderr.startswith(f"Error: {path}: not a readable parquet file (")
    assert_bad_input(result, result.stderr.strip().removeprefix("Error: "), tmp_path)


def test_truncated_input_file(tmp_path):
    path = tmp_path / "in.parquet"
    path.write_bytes(ROLLOUTS.read_bytes()[:-100])
    result = precompute("-m", TINY_GEMMA, path, "-o", tmp_path / "out.parquet")
    assert result.exit_code == 2 and result.stderr.startswith(f"Error: {path}: not a readable parquet file (")


def test_malformed_json_lines_name_the_line(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt_ids": [2, 5], "response_ids": [6]}\n'
                    '{"prompt_ids": [2, 7], "response_ids": [8]}\n'
                    '{"prompt_ids": [2, 5] "response_ids": [6]}\n')
    result = precompute("-m", TINY_GEMMA, path, "-o", tmp_path / "out.parquet")
    assert_bad_input(result, f"{path}: line 3 is not valid JSON (Expecting ',' delimiter at column 23)", tmp_path)


def test_json_lines_with_a_line_that_is_not_an_object(tmp_path):
    path = tmp_path / "in.jsonl.gz"
    with gzip.open(path, "wt") as fh:
        fh.write('{"prompt_ids": [2, 5], "response_ids": [6]}\n\n[2, 5, 6]\n')
    result = precompute("-m", TINY_GEMMA, path, "-o", tmp_path / "out.parquet")
    assert_bad_input(result, f"{path}: line 3 is not a JSON object (one row per line)", tmp_path)


def test_empty_input_file(tmp_path):
    path = tmp_path / "in.parquet"
    path.write_bytes(b"")
    result = precompute("-m", TINY_GEMMA, path, "-o", tmp_path / "out.parquet")
    assert_bad_input(result, f"{path}: file is empty (0 bytes)", tmp_path)


def test_input_with_no_rows(tmp_path):
    path = write(tmp_path, "in.parquet", {"prompt_ids": pa.array([], pa.list_(pa.int32())),
                                          "response_ids": pa.array([], pa.list_(pa.int32()))})
    result = precompute("-m", TINY_GEMMA, path, "-o", tmp_path / "out.parquet")
    assert_bad_input(result, f"{path}: file has no rows", tmp_path)


def test_missing_input_file(tmp_path):
    result = precompute("-m", TINY_GEMMA, tmp_path / "nope.parquet", "-o", tmp_path / "out.parquet")
    assert_bad_input(result, f"{tmp_path / 'nope.parquet'}: no such file or directory", tmp_path)


def test_model_path_that_does_not_exist(tmp_path, monkeypatch):
    # No network: a local-looking path must fail before any hub call, even with the hub allowed.
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    result = precompute("-m", tmp_path / "no-such-model", ROLLOUTS, "-o", tmp_path / "out.parquet")
    assert_bad_input(result, f"{tmp_path / 'no-such-model'}: model directory does not exist", tmp_path)


def test_checkpoint_with_missing_weights_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken-model"
    shutil.copytree(TINY_LLAMA, broken)
    weights = load_file(broken / "model.safetensors")
    dropped = sorted(k for k in weights if "layers.0.mlp" in k)
    save_file({k: v for k, v in weights.items() if k not in dropped}, broken / "model.safetensors",
              metadata={"format": "pt"})
    result = precompute("-m", broken, ROLLOUTS, "-o", tmp_path / "out.parquet")
    assert_bad_input(result, f"{broken}: 3 missing keys loading it as LlamaForCausalLM "
                             f"({', '.join(dropped)}); the checkpoint does not match the model class, "
                             "refusing to run with random weights", tmp_path)


def test_pickle_weights_are_never_loaded(tmp_path):
    import torch
    from safetensors.torch import load_file

    pickled = tmp_path / "pickled-model"
    shutil.copytree(TINY_LLAMA, pickled)
    torch.save(load_file(pickled / "model.safetensors"), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    result = precompute("-m", pickled, ROLLOUTS, "-o", tmp_path / "out.parquet")
    assert result.exit_code == 2
    assert result.stderr.startswith(f"Error: {pickled}: cannot load the model (")
    assert len(result.stderr.splitlines()) == 1
    assert not (tmp_path / "out.parquet").exists() and not (tmp_path / "out.parquet.partial").exists()


def test_remote_code_needs_the_flag(tmp_path):
    custom = tmp_path / "custom-model"
    shutil.copytree(TINY_LLAMA, custom)
    config = json.loads((custom / "config.json").read_text())
    config.update(model_type="klpipe_custom", auto_map={"AutoConfig": "configuration_custom.CustomConfig",
                                                         "AutoModelForCausalLM": "modeling_custom.CustomModel"})
    (custom / "config.json").write_text(json.dumps(config))
    (custom / "configuration_custom.py").write_text("raise SystemExit('remote code ran')\n")
    result = precompute("-m", custom, ROLLOUTS, "-o", tmp_path / "out.parquet")
    assert_bad_input(result, f"{custom}: the checkpoint ships its own model code; "
                             "klpipe runs it only with --trust-remote-code", tmp_path)


def test_concurrent_run_on_the_same_output_refuses(tmp_path):
    import fcntl

    work = tmp_path / "out.parquet.partial"
    work.mkdir()
    with open(work / "lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        result = precompute("-m", TINY_GEMMA, ROLLOUTS, "-o", tmp_path / "out.parquet")
    assert result.exit_code == 2
    assert result.stderr.strip() == (f"Error: another klpipe run is writing {tmp_path / 'out.parquet'} "
                                     f"(lock held on {work / 'lock'})")
    assert not (tmp_path / "out.parquet").exists()


def test_a_refused_run_names_the_run_that_holds_the_output(tmp_path):
    """The lock score takes beside its state (klpipe/storage/lock.py) keeps a precompute output too: its holder
    writes who it is, and the refusal names it."""
    import os
    import socket

    from klpipe.storage.lock import RunLock

    held = RunLock(tmp_path / "out.parquet.partial" / "lock")
    assert held.acquire()
    try:
        result = precompute("-m", TINY_GEMMA, ROLLOUTS, "-o", tmp_path / "out.parquet")
    finally:
        held.release()
    assert result.exit_code == 2
    assert result.stderr.strip() == (f"Error: another klpipe run is writing {tmp_path / 'out.parquet'} (lock held on "
                                     f"{held.path} by pid {os.getpid()} on host {socket.gethostname()})")


def test_float16_on_cpu_is_refused(tmp_path):
    result = precompute("-m", TINY_GEMMA, ROLLOUTS, "-o", tmp_path / "out.parquet", "--device", "cpu",
                        "--dtype", "float16")
    assert_bad_input(result, "--dtype float16 on CPU is extremely slow; use bfloat16 or float32", tmp_path)


def test_real_entry_point_prints_one_line_and_no_traceback(tmp_path):
    result = run_cli("precompute", "-m", str(TINY_GEMMA), str(tmp_path / "missing.parquet"))
    assert result.returncode == 2
    assert result.stderr == f"Error: {tmp_path / 'missing.parquet'}: no such file or directory\n"
    debug = run_cli("precompute", "-m", str(TINY_GEMMA), str(tmp_path / "missing.parquet"),
                    env={"KLPIPE_DEBUG": "1"})
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_inputs_with_different_columns(tmp_path):
    first = write(tmp_path, "a.parquet", {"id": ["a"], "prompt_ids": [[2, 5]], "response_ids": [[6]]})
    second = write(tmp_path, "b.parquet", {"prompt_ids": [[2, 5]], "response_ids": [[6]], "reward": [1.0]})
    result = precompute("-m", TINY_GEMMA, first, second, "-o", tmp_path / "out.parquet")
    assert_bad_input(result, f"{second}: columns differ from {first} (no id, extra reward); "
                             "inputs of one run must share a schema", tmp_path)


def test_prefix_sharing_option_environment_and_summary(tmp_path):
    agent = agent_rollouts(tmp_path / "agent.parquet")
    per_row = per_row_tokens(pq.read_table(agent))
    result = precompute("-m", TINY_LLAMA, agent, "-o", tmp_path / "auto.parquet", "--device", "cpu")
    assert result.exit_code == 0, result.output
    fed = int(re.search(r"fed ([\d,]+) tokens where running each row whole feeds ([\d,]+) \(([\d.]+)x fewer\)",
                        result.stderr).group(1).replace(",", ""))
    assert f"where running each row whole feeds {per_row:,} ({per_row / fed:.1f}x fewer)" in result.stderr
    assert fed < per_row / 2  # the system prompt and the histories once per chunk
    result = precompute("-m", TINY_LLAMA, agent, "-o", tmp_path / "off.parquet", "--device", "cpu",
                        env={"KLPIPE_PREFIX_SHARING": "off"})
    assert result.exit_code == 0, result.output
    assert f"fed {per_row:,} tokens where running each row whole feeds {per_row:,} (1.0x fewer)" in result.stderr


def test_prefix_sharing_bad_value(tmp_path):
    result = precompute("-m", TINY_LLAMA, ROLLOUTS, "-o", tmp_path / "out.parquet", "--prefix-sharing", "yes")
    assert_bad_input(result, "--prefix-sharing must be auto, on or off, not 'yes'", tmp_path)


def test_a_model_that_cannot_share_falls_back_under_auto_and_fails_under_on(tmp_path, monkeypatch):
    from klpipe.precompute import sharing as precompute_sharing

    monkeypatch.setattr(precompute_sharing, "check_tree", lambda model: "the probe disagreed")
    result = precompute("-m", TINY_LLAMA, ROLLOUTS, "-o", tmp_path / "auto.parquet", "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert "prefix sharing off: LlamaForCausalLM cannot share prefixes exactly (the probe disagreed)" in result.stderr
    assert "(1.0x fewer)" in result.stderr
    result = precompute("-m", TINY_LLAMA, ROLLOUTS, "-o", tmp_path / "out.parquet", "--device", "cpu",
                        "--prefix-sharing", "on")
    assert result.exit_code == 2
    assert result.stderr.strip() == ("Error: --prefix-sharing on: LlamaForCausalLM cannot share prefixes exactly "
                                     "(the probe disagreed)")
    assert not (tmp_path / "out.parquet").exists() and not (tmp_path / "out.parquet.partial").exists()


def test_column_mapping_from_the_environment(tmp_path):
    source = pq.read_table(ROLLOUTS).select(["id", "prompt_ids", "response_ids", "reward"])
    path = write(tmp_path, "dump.parquet", source.rename_columns(["uid", "input_ids", "completion_ids", "score"]))
    out = tmp_path / "cached.parquet"
    # One variable holds every mapping, separated by spaces, as click splits a repeatable option.
    result = precompute("-m", TINY_LLAMA, path, "-o", out,
                        env={"KLPIPE_COLUMN": "prompt_ids=input_ids response_ids=completion_ids id=uid"})
    assert result.exit_code == 0, result.output
    table = pq.read_table(out)
    assert table.column_names == ["uid", "input_ids", "completion_ids", "score", "ref_logprobs"]
    assert json.loads(pq.read_schema(out).metadata[b"klpipe"])["columns"] == {
        "prompt_ids": "input_ids", "response_ids": "completion_ids", "id": "uid"}
    # Messages name rows and columns as the user's file does.
    bad = write(tmp_path, "bad.parquet", {"uid": ["a", "b"], "input_ids": [[2, 7], []], "completion_ids": [[5], [6]]})
    result = precompute("-m", TINY_LLAMA, bad, "-o", tmp_path / "out.parquet",
                        env={"KLPIPE_COLUMN": "prompt_ids=input_ids response_ids=completion_ids id=uid"})
    assert_bad_input(result, f"{bad}: row 1 (id 'b'): input_ids is empty (a response needs at least one prompt token)",
                     tmp_path)


def test_bad_column_options(tmp_path):
    result = precompute("-m", TINY_GEMMA, ROLLOUTS, "-o", tmp_path / "out.parquet", "--column", "rewards=score")
    assert_bad_input(result, "--column rewards=score: unknown role 'rewards'; roles are id, step, prompt, response, "
                             "prompt_ids, response_ids, policy_logprobs, sampler_logprobs, reward, ref_logprobs, mask, "
                             "tools", tmp_path)
    result = precompute("-m", TINY_GEMMA, ROLLOUTS, "-o", tmp_path / "out.parquet", "--column", "reward")
    assert_bad_input(result, "--column reward: expected ROLE=NAME, e.g. --column reward=score", tmp_path)
    result = precompute("-m", TINY_GEMMA, ROLLOUTS, "-o", tmp_path / "out.parquet", "--column", "reward=score")
    assert_bad_input(result, f"{ROLLOUTS}: --column reward=score: no column 'score'; found id, step, group_id, prompt, "
                             "response, prompt_ids, response_ids, policy_logprobs, reward", tmp_path)
    result = precompute("-m", TINY_GEMMA, ROLLOUTS, "-o", tmp_path / "out.parquet", "--column", "ref_logprobs=reward")
    assert_bad_input(result, f"{ROLLOUTS}: already has a reward column; is this a cache? precompute reads rollouts",
                     tmp_path)


def test_conversational_rollouts_need_a_chat_template(tmp_path):
    plain = tmp_path / "no-template-model"
    shutil.copytree(TINY_LLAMA, plain)
    (plain / "chat_template.jinja").unlink()
    result = precompute("-m", plain, CONVERSATIONAL, "-o", tmp_path / "out.parquet")
    assert_bad_input(result, f"{CONVERSATIONAL}: row 0 (id 'c0-g0'): prompt holds chat messages, but the tokenizer "
                             "has no chat template to render them with; use a tokenizer that has one, or give "
                             "prompt_ids and response_ids", tmp_path)


def test_conversational_prompt_with_a_text_completion(tmp_path):
    source = pq.read_table(CONVERSATIONAL).slice(0, 2)
    path = write(tmp_path, "in.parquet", source.set_column(source.column_names.index("completion"), "completion",
                                                           pa.array(["a", "b"])))
    result = precompute("-m", TINY_GEMMA, path, "-o", tmp_path / "out.parquet")
    assert_bad_input(result, f"{path}: column completion must be a list of chat messages like the other, found "
                             "string; TRL's conversational format has both as messages", tmp_path)


@pytest.mark.slow
def test_a_cache_written_into_the_input_directory_is_not_read_as_rollouts(tmp_path):
    rollouts = tmp_path / "day"
    rollouts.mkdir()
    shutil.copy(ROLLOUTS, rollouts / "rollouts.parquet")
    args = ["precompute", "-m", str(TINY_LLAMA), str(rollouts), "-o", str(rollouts / "cached.parquet"),
            "--progress", "none"]
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr
    made = (rollouts / "cached.parquet").read_bytes()
    again = run_cli(*args)  # the cache is now in the directory: it is skipped, and the run is the same one
    assert again.returncode == 0, again.stderr
    assert f"skipping 1 klpipe output(s) found in an input directory, not rollouts: {rollouts / 'cached.parquet'}" \
        in again.stderr
    assert "is already complete" in again.stderr and (rollouts / "cached.parquet").read_bytes() == made
    other = run_cli(*args[:-3], str(rollouts / "other.parquet"), "--progress", "none")
    assert other.returncode == 0, other.stderr
    assert pq.read_table(rollouts / "other.parquet").num_rows == pq.read_table(ROLLOUTS).num_rows
