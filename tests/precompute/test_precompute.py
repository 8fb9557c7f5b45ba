"""Stage 1 end to end through the library: real tiny models, real parquet files on disk."""

import json
import shutil
import threading
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from klpipe import cache
from klpipe.errors import InputError, OutputError, ProvenanceError
from klpipe.model import loading
from klpipe.precompute import PrecomputeConfig, default_output, precompute
from klpipe.sharding import Shard
from tests.helpers import (
    CONVERSATIONAL,
    ROLLOUTS,
    TINY_GEMMA,
    TINY_LLAMA,
    agent_rollouts,
    crash_at_chunk,
    oracle_logprobs,
    per_row_tokens,
)

TOLERANCE = 1e-4


def run(tmp_path, inputs=(ROLLOUTS,), model=TINY_GEMMA, name="out.parquet", **kwargs):
    config = PrecomputeConfig(inputs=[Path(p) for p in inputs], output=tmp_path / name, model=str(model),
                              device="cpu", progress="none", **kwargs)
    return precompute(config, log=lambda message: None)


@pytest.mark.parametrize("option, value, message", [
    ("temperature", 0.0, "--temperature must be positive"),
    ("chunk_rows", 0, "--chunk-rows must be at least 1"),
    ("max_tokens_per_batch", 0, "--max-tokens-per-batch must be at least 1"),
    ("progress", "fancy", "--progress must be auto, bar, log or none, not 'fancy'"),
    ("columns", {"rewards": "score"}, ("--column rewards=score: unknown role 'rewards'; roles are id, step, prompt, "
                                       "response, prompt_ids, response_ids, policy_logprobs, sampler_logprobs, "
                                       "reward, ref_logprobs, mask, tools")),
])
def test_the_config_refuses_bad_arguments(option, value, message):
    with pytest.raises(InputError) as excinfo:
        PrecomputeConfig(inputs=[ROLLOUTS], model=str(TINY_LLAMA), **{option: value})
    assert str(excinfo.value) == message


def test_default_outputs_of_inputs_that_differ_before_the_suffix_differ(tmp_path):
    # Cut at the first dot, a.v1 and a.v2 both became a.cached.parquet: the second run was refused,
    # or with --overwrite destroyed the first cache. The rule is score's: drop the input suffix only.
    assert default_output([tmp_path / "a.v1.parquet"]) == tmp_path / "a.v1.cached.parquet"
    assert default_output([tmp_path / "a.v2.parquet"]) == tmp_path / "a.v2.cached.parquet"
    assert default_output([tmp_path / "day.2026-11-29.jsonl.gz"]) == tmp_path / "day.2026-11-29.cached.parquet"
    (tmp_path / "saved.v3").mkdir()  # a save_to_disk directory: its whole name is the stem
    assert default_output([tmp_path / "saved.v3"]) == tmp_path / "saved.v3.cached.parquet"


def test_default_output_beside_a_single_input(tmp_path):
    assert default_output([tmp_path / "day1.parquet"]) == tmp_path / "day1.cached.parquet"
    with pytest.raises(InputError, match=r"^--output is required with several inputs$"):
        default_output([tmp_path / "a.parquet", tmp_path / "b.parquet"])
    with pytest.raises(InputError, match=r"^--output DIR is required for a sharded run$"):
        default_output([tmp_path / "a.parquet"], Shard(0, 2))


@pytest.fixture(scope="module")
def models():
    return {path: AutoModelForCausalLM.from_pretrained(path).eval() for path in (TINY_GEMMA, TINY_LLAMA)}


def assert_matches_oracle(model, table: pa.Table, temperature=1.0):
    worst = 0.0
    for row in table.to_pylist():
        expected = oracle_logprobs(model, row["prompt_ids"], row["response_ids"], temperature)
        got = np.asarray(row["ref_logprobs"], dtype=np.float32)
        assert got.shape == expected.shape
        if len(got):
            worst = max(worst, float(np.max(np.abs(got - expected))))
    assert worst <= TOLERANCE


@pytest.mark.parametrize("model_dir", [TINY_GEMMA, TINY_LLAMA], ids=["gemma4", "llama"])
@pytest.mark.parametrize("chunk_rows,max_tokens", [(1, 100_000), (5, 40), (1000, 8192)])
def test_every_chunking_and_batching_path_matches_oracle(tmp_path, models, model_dir, chunk_rows, max_tokens):
    summary = run(tmp_path, model=model_dir, chunk_rows=chunk_rows, max_tokens_per_batch=max_tokens)
    table = pq.read_table(summary.output)
    source = pq.read_table(ROLLOUTS)
    # Every input column passes through untouched, in the original order.
    assert table.drop_columns([cache.REF_LOGPROBS]).equals(source.replace_schema_metadata(None))
    assert table.schema.field(cache.REF_LOGPROBS).type == pa.list_(pa.float32())
    assert_matches_oracle(models[model_dir], table)
    assert summary.rows == source.num_rows
    assert summary.tokens == sum(len(r) for r in source.column("response_ids").to_pylist())
    assert not (tmp_path / "out.parquet.partial").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.parquet"]


def test_temperature_is_applied(tmp_path, models):
    summary = run(tmp_path, temperature=1.5)
    assert_matches_oracle(models[TINY_GEMMA], pq.read_table(summary.output), temperature=1.5)
    assert cache.read_provenance(summary.output).temperature == 1.5


def test_provenance_metadata(tmp_path):
    summary = run(tmp_path)
    provenance = cache.read_provenance(summary.output)
    assert provenance.model == str(TINY_GEMMA)
    assert provenance.dtype == "float32"
    assert provenance.revision.startswith("local:")
    assert len(provenance.tokenizer) == 64
    assert provenance.inputs[0]["name"] == "rollouts.parquet"
    assert provenance.inputs[0]["size"] == ROLLOUTS.stat().st_size
    # The same tokenizer gives the same fingerprint; the two tiny models share one.
    other = run(tmp_path, model=TINY_LLAMA, name="llama.parquet")
    assert cache.read_provenance(other.output).tokenizer == provenance.tokenizer
    assert cache.read_provenance(other.output).revision != provenance.revision


def text_rollouts(tmp_path) -> Path:
    table = pq.read_table(ROLLOUTS).select(["id", "step", "prompt", "response", "policy_logprobs", "reward"])
    path = tmp_path / "text.parquet"
    pq.write_table(table, path)
    return path


def test_text_mode_tokenizes_like_the_reference_tokenizer(tmp_path, models):
    summary = run(tmp_path, inputs=[text_rollouts(tmp_path)])
    table = pq.read_table(summary.output)
    tokenizer = AutoTokenizer.from_pretrained(TINY_GEMMA)
    assert table.column_names == ["id", "step", "prompt", "response", "policy_logprobs", "reward",
                                  "prompt_ids", "response_ids", "ref_logprobs"]
    for row in table.to_pylist():
        assert row["prompt_ids"] == tokenizer(row["prompt"]).input_ids
        assert row["prompt_ids"][0] == tokenizer.bos_token_id  # the prompt gets BOS, once
        assert row["response_ids"] == tokenizer(row["response"], add_special_tokens=False).input_ids
    assert_matches_oracle(models[TINY_GEMMA], table)


def test_text_mode_never_doubles_a_bos_the_text_already_has(tmp_path, models):
    # A prompt rendered by a chat template that writes <bos> (Gemma's, and the sample one): the
    # tokenizer's default BOS in front of it would be a second one.
    tokenizer = AutoTokenizer.from_pretrained(TINY_GEMMA)
    source = pq.read_table(CONVERSATIONAL).slice(0, 4).to_pylist()
    rendered = [{"prompt": tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True),
                 "response": "Canberra.<end_of_turn>\n"} for r in source]
    rendered.append({"prompt": "Hello there!", "response": " Hi."})  # no BOS in the text: the tokenizer adds it
    path = tmp_path / "rendered.parquet"
    pq.write_table(pa.Table.from_pylist(rendered), path)
    table = pq.read_table(run(tmp_path, inputs=[path], model=TINY_LLAMA).output)  # the tokenizer is shared
    for row in table.to_pylist()[:4]:
        assert row["prompt"].startswith("<bos>")
        assert row["prompt_ids"] == tokenizer(row["prompt"], add_special_tokens=False).input_ids
        assert row["prompt_ids"][0] == tokenizer.bos_token_id != row["prompt_ids"][1]
    assert table.column("prompt_ids")[4].as_py() == tokenizer("Hello there!").input_ids
    assert_matches_oracle(models[TINY_LLAMA], table)


def test_jsonl_and_save_to_disk_inputs_match_parquet(tmp_path):
    source = pq.read_table(ROLLOUTS)
    jsonl = tmp_path / "rollouts.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in source.to_pylist()))
    saved = tmp_path / "saved"
    datasets.Dataset(source).save_to_disk(str(saved))
    expected = pq.read_table(run(tmp_path, name="a.parquet").output).column(cache.REF_LOGPROBS).to_pylist()
    from_jsonl = pq.read_table(run(tmp_path, inputs=[jsonl], name="b.parquet").output)
    from_disk = pq.read_table(run(tmp_path, inputs=[saved], name="c.parquet").output)
    assert from_jsonl.column(cache.REF_LOGPROBS).to_pylist() == expected
    assert from_disk.column(cache.REF_LOGPROBS).to_pylist() == expected
    assert from_jsonl.column("id").to_pylist() == source.column("id").to_pylist()


@pytest.mark.slow
def test_directory_of_files_keeps_file_then_row_order(tmp_path):
    source = pq.read_table(ROLLOUTS)
    folder = tmp_path / "day"
    folder.mkdir()
    pq.write_table(source.slice(0, 20), folder / "part-0.parquet")
    pq.write_table(source.slice(20), folder / "part-1.parquet")
    # Chunks of 7 rows straddle the file boundary at row 20; the chunk plan depends on rows only.
    whole = pq.read_table(run(tmp_path, name="whole.parquet", chunk_rows=7).output)
    split = pq.read_table(run(tmp_path, inputs=[folder], name="split.parquet", chunk_rows=7).output)
    assert split.to_pylist() == whole.to_pylist()
    assert cache.read_provenance(tmp_path / "split.parquet").inputs[1]["name"] == "part-1.parquet"


def test_rerun_of_finished_output_is_a_noop_and_different_run_refuses(tmp_path):
    first = run(tmp_path)
    stamp = first.output.stat().st_mtime_ns
    again = run(tmp_path)
    assert again.skipped and first.output.stat().st_mtime_ns == stamp
    different = r"exists and was made by a different run \(temperature 1.0 → 2.0\); pass --overwrite"
    with pytest.raises(OutputError, match=different):
        run(tmp_path, temperature=2.0)
    replaced = run(tmp_path, temperature=2.0, overwrite=True)
    assert not replaced.skipped and cache.read_provenance(replaced.output).temperature == 2.0


def test_crash_then_rerun_resumes_and_gives_identical_output(tmp_path, monkeypatch):
    full = pq.read_table(run(tmp_path, name="full.parquet", chunk_rows=8).output)

    with crash_at_chunk(monkeypatch, 2):
        run(tmp_path, name="resumed.parquet", chunk_rows=8)
    assert not (tmp_path / "resumed.parquet").exists()
    work = tmp_path / "resumed.parquet.partial"
    assert sorted(p.name for p in work.glob("chunk-*.parquet")) == ["chunk-00000000.parquet", "chunk-00000001.parquet"]

    resumed = run(tmp_path, name="resumed.parquet", chunk_rows=8)
    assert resumed.resumed_chunks == 2 and resumed.resumed_rows == 16
    assert resumed.rows == full.num_rows - 16  # only the unfinished rows were scored again
    assert pq.read_table(resumed.output).equals(full)
    assert not work.exists()


def change_one_weight(model_dir: Path, name: str) -> None:
    """Add 1 to the first value of tensor `name`, in place: same size, same header, same first MiB."""
    path = model_dir / "model.safetensors"
    with open(path, "r+b") as fh:
        header_len = int.from_bytes(fh.read(8), "little")
        start = 8 + header_len + json.loads(fh.read(header_len))[name]["data_offsets"][0]
        fh.seek(start)
        value = np.frombuffer(fh.read(4), dtype=np.float32)[0]
        fh.seek(start)
        fh.write(np.float32(value + 1.0).tobytes())


@pytest.mark.slow
def test_changed_weights_are_never_reused(tmp_path, monkeypatch):
    """A model updated in its directory (fine-tuned, LoRA-merged) is another model: an existing output
    and a resumable work directory of the old one are refused, naming the model, never reused."""
    model_dir = tmp_path / "ref"
    shutil.copytree(TINY_LLAMA, model_dir)
    last_layer = "model.layers.1.mlp.down_proj.weight"
    old = pq.read_table(run(tmp_path, model=model_dir, name="done.parquet", chunk_rows=8).output)

    with crash_at_chunk(monkeypatch, 2):
        run(tmp_path, model=model_dir, name="partial.parquet", chunk_rows=8)
    assert len(list((tmp_path / "partial.parquet.partial").glob("chunk-*.parquet"))) == 2

    change_one_weight(model_dir, last_layer)
    changed = f"the weights of {model_dir} changed"
    with pytest.raises(OutputError, match=f"done.parquet exists and was made by a different run \\({changed}"):
        run(tmp_path, model=model_dir, name="done.parquet", chunk_rows=8)
    with pytest.raises(ProvenanceError, match=f"holds work from a different run \\({changed}"):
        run(tmp_path, model=model_dir, name="partial.parquet", chunk_rows=8)
    # With --overwrite both are recomputed, with the new weights throughout.
    redone = pq.read_table(run(tmp_path, model=model_dir, name="done.parquet", chunk_rows=8, overwrite=True).output)
    resumed = pq.read_table(run(tmp_path, model=model_dir, name="partial.parquet", chunk_rows=8, overwrite=True).output)
    assert redone.equals(resumed)
    old, new = (np.asarray(t.column("ref_logprobs").combine_chunks().flatten()) for t in (old, redone))
    assert not np.array_equal(old, new)  # the change moved the numbers
    assert_matches_oracle(AutoModelForCausalLM.from_pretrained(model_dir).eval(), redone)


def test_a_resume_with_other_settings_is_refused_naming_each(tmp_path, monkeypatch):
    with crash_at_chunk(monkeypatch, 2):
        run(tmp_path, model=TINY_LLAMA, chunk_rows=8, max_tokens_per_batch=100)
    made = json.loads((tmp_path / "out.parquet.partial" / "run.json").read_text())["provenance"]
    assert made["device"] == "cpu" and made["max_tokens_per_batch"] == 100 and made["chunk_rows"] == 8
    assert made["prefix_sharing"] == "auto" and set(made["versions"]) == {"torch", "transformers"}
    with pytest.raises(ProvenanceError, match=r"holds work from a different run \(prefix_sharing 'auto' → 'off'; "
                                              r"max_tokens_per_batch 100 → 200\); rerun the original command"):
        run(tmp_path, model=TINY_LLAMA, chunk_rows=8, max_tokens_per_batch=200, prefix_sharing="off")
    resumed = run(tmp_path, model=TINY_LLAMA, chunk_rows=8, max_tokens_per_batch=100)
    assert resumed.resumed_chunks == 2


def test_a_failed_run_stops_its_reader_thread(tmp_path, monkeypatch):
    # The run must close its reader itself, not leave it to the garbage collector: here the test
    # keeps a reference to the stream (as a debugger, or a traceback elsewhere, would), and an
    # unclosed stream keeps a thread alive that has read ahead into a full queue.
    from klpipe.precompute import run as precompute_module
    from klpipe.precompute.workdir import WorkDir

    streams = []

    def kept_prefetch(items, depth=2):
        streams.append(stream := real_prefetch(items, depth))
        return stream

    def disk_full(self, tokenized, *args, **kwargs):
        raise OSError(28, "No space left on device")

    real_prefetch = precompute_module.prefetch
    monkeypatch.setattr(precompute_module, "prefetch", kept_prefetch)
    monkeypatch.setattr(WorkDir, "write_chunk", disk_full)
    with pytest.raises(OSError) as excinfo:
        run(tmp_path, chunk_rows=4)  # 12 chunks: the reader is ahead when the first write fails
    readers = [t for t in threading.enumerate() if t.name == "klpipe-prefetch" and t.is_alive()]
    assert len(streams) == 1 and readers == [] and excinfo.value.errno == 28


def test_the_model_runs_the_next_chunk_while_the_last_is_written(tmp_path, monkeypatch, models):
    """Write behind: chunk 0's write is held until the model has begun chunk 1, which it can only do if the
    write is off the model's thread. Writes stay in order, and the output and counts are those of the rows."""
    from klpipe.precompute import scorer as precompute_module
    from klpipe.precompute.workdir import WorkDir

    chunks = -(-pq.read_metadata(ROLLOUTS).num_rows // 8)
    began = [threading.Event() for _ in range(chunks)]  # chunk i's first forward has begun
    real_run_plan, real_write = precompute_module.run_plan, WorkDir.write_chunk
    calls, written, overlapped = [], [], []

    def run_plan(*args, **kwargs):  # one call per chunk: there is no --policy
        calls.append(threading.current_thread().name)
        began[len(calls) - 1].set()
        return real_run_plan(*args, **kwargs)

    def held_write(self, tokenized, *args, **kwargs):
        if tokenized.chunk.index == 0:
            overlapped.append(began[1].wait(timeout=60))  # a write on the model's thread waits here in vain
        written.append((tokenized.chunk.index, threading.current_thread().name))
        real_write(self, tokenized, *args, **kwargs)

    monkeypatch.setattr(precompute_module, "run_plan", run_plan)
    monkeypatch.setattr(WorkDir, "write_chunk", held_write)
    summary = run(tmp_path, model=TINY_LLAMA, chunk_rows=8)
    assert overlapped == [True]
    assert written == [(i, "klpipe-writer") for i in range(chunks)] and set(calls) == {"MainThread"}
    got, source = pq.read_table(summary.output), pq.read_table(ROLLOUTS)
    assert got.drop_columns([cache.REF_LOGPROBS]).equals(source.replace_schema_metadata(None))
    assert_matches_oracle(models[TINY_LLAMA], got)
    assert summary.rows == source.num_rows  # counted as each chunk was written
    assert summary.tokens == sum(len(r) for r in source.column("response_ids").to_pylist())
    assert not [t for t in threading.enumerate() if t.name == "klpipe-writer"]


def test_work_dir_from_another_run_is_refused(tmp_path):
    work = tmp_path / "out.parquet.partial"
    work.mkdir()
    (work / "run.json").write_text(json.dumps({"chunk_rows": 3}))
    (work / "chunk-00000000.parquet").write_bytes(b"not this run's")
    with pytest.raises(ProvenanceError, match=r"holds work from a different run .*pass --overwrite to start over"):
        run(tmp_path)
    assert (work / "chunk-00000000.parquet").exists()  # refused: nothing touched
    summary = run(tmp_path, overwrite=True)
    assert summary.resumed_chunks == 0 and pq.read_table(summary.output).num_rows == 48
    assert not work.exists()


def test_work_dir_from_another_column_mapping_is_named():
    from klpipe.precompute.workdir import _run_difference

    made = dict(model="m", revision=None, tokenizer="t", dtype="float32", temperature=1.0, klpipe_version="0.1.0")
    current = {"rows": [0, 48], "mode": "ids", "provenance": {**made, "columns": {}}}
    previous = {**current, "provenance": {**made, "columns": {"reward": "score"}}}
    assert _run_difference(previous, current) == "columns {'reward': 'score'} → {}"


@pytest.mark.slow
@pytest.mark.parametrize("model_dir", [TINY_GEMMA, TINY_LLAMA], ids=["gemma4", "llama"])
def test_prefix_sharing_modes_match_oracle_and_count_what_they_fed(tmp_path, models, model_dir):
    source = pq.read_table(agent_rollouts(tmp_path / "agent.parquet"))
    # Chunks of 13 rows split groups and trajectories: a tree is one chunk's, and each chunk runs the
    # system prompt once.
    outputs = {}
    for sharing in ("on", "auto", "off"):
        summary = run(tmp_path, inputs=[tmp_path / "agent.parquet"], model=model_dir, name=f"{sharing}.parquet",
                      chunk_rows=13, prefix_sharing=sharing)
        outputs[sharing] = pq.read_table(summary.output)
        assert_matches_oracle(models[model_dir], outputs[sharing])
        assert summary.prefix_sharing == sharing
        assert summary.forward.per_row_tokens == per_row_tokens(source)
        if sharing == "off":
            assert summary.forward.fed_tokens == per_row_tokens(source) and summary.forward.tree_rows == 0
        else:  # every chunk's system prompt and shared histories once
            assert summary.forward.fed_tokens < per_row_tokens(source) / 2 and summary.forward.tree_rows > 0
    assert outputs["on"].drop_columns(["ref_logprobs"]).equals(outputs["off"].drop_columns(["ref_logprobs"]))



def unique_then_shared(path: Path, shared_chunks: int) -> Path:
    """8 rows of unique prompts (nothing shared but their first token), then `shared_chunks` chunks of 8 rows
    that open with one 60-token system prompt: with chunks of 8, only the later chunks run a tree."""
    rng = np.random.default_rng(3)
    system = rng.integers(3, 512, 60).tolist()
    rows = [{"prompt_ids": [2, 3 + i] + rng.integers(3, 512, 20).tolist(),
             "response_ids": rng.integers(3, 512, 9).tolist()} for i in range(8)]
    rows += [{"prompt_ids": system + rng.integers(3, 512, 5).tolist(), "response_ids": rng.integers(3, 512, 9).tolist()}
             for _ in range(8 * shared_chunks)]
    for i, row in enumerate(rows):
        row["id"] = f"r{i}"
    pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema([
        ("id", pa.string()), ("prompt_ids", pa.list_(pa.int32())), ("response_ids", pa.list_(pa.int32()))])), path)
    return path


def test_auto_probes_the_tree_only_when_a_chunk_would_share_it(tmp_path, monkeypatch):
    # The probe costs about half a second a process: unique prompts, which run whole under auto, never pay
    # for it, and a run pays for it once, however many chunks share.
    from klpipe.precompute import sharing

    probed = []
    real = sharing.check_tree
    monkeypatch.setattr(sharing, "check_tree", lambda model: probed.append(model) or real(model))
    rows = unique_then_shared(tmp_path / "rows.parquet", shared_chunks=2)
    unique = tmp_path / "unique.parquet"
    pq.write_table(pq.read_table(rows).slice(0, 8), unique)
    off = run(tmp_path, inputs=[unique], model=TINY_LLAMA, name="unique-off.parquet", prefix_sharing="off")
    auto = run(tmp_path, inputs=[unique], model=TINY_LLAMA, name="unique-auto.parquet", chunk_rows=8)
    assert probed == [] and auto.prefix_sharing == "auto" and auto.forward.tree_rows == 0
    assert pq.read_table(auto.output).equals(pq.read_table(off.output))
    shared = run(tmp_path, inputs=[rows], model=TINY_LLAMA, name="shared.parquet", chunk_rows=8)
    assert len(probed) == 1 and shared.prefix_sharing == "auto" and shared.forward.tree_rows == 16


def test_a_failed_probe_under_auto_runs_that_chunk_and_the_rest_whole(tmp_path, monkeypatch, models):
    from klpipe.precompute import sharing

    probed = []
    monkeypatch.setattr(sharing, "check_tree", lambda model: probed.append(model) or "the probe disagreed")
    rows = unique_then_shared(tmp_path / "rows.parquet", shared_chunks=2)
    said = []
    config = PrecomputeConfig(inputs=[rows], output=tmp_path / "auto.parquet", model=str(TINY_LLAMA), device="cpu",
                              progress="none", chunk_rows=8)
    summary = precompute(config, log=said.append)
    assert len(probed) == 1 and summary.prefix_sharing == "off" and summary.forward.tree_rows == 0
    assert [line for line in said if "prefix sharing" in line] == [
        "prefix sharing off: LlamaForCausalLM cannot share prefixes exactly (the probe disagreed)"]
    assert summary.forward.fed_tokens == per_row_tokens(pq.read_table(rows))
    off = run(tmp_path, inputs=[rows], model=TINY_LLAMA, name="off.parquet", chunk_rows=8, prefix_sharing="off")
    assert pq.read_table(summary.output).equals(pq.read_table(off.output))
    assert_matches_oracle(models[TINY_LLAMA], pq.read_table(summary.output))

# -- the formats trainers write -------------------------------------------------------------------


@pytest.mark.parametrize("model_dir", [TINY_GEMMA, TINY_LLAMA], ids=["gemma4", "llama"])
def test_conversational_rollouts_are_rendered_with_the_chat_template(tmp_path, models, model_dir):
    # The default --prefix-sharing auto: a group's rows render to identical prompt ids (on Gemma 4 every
    # row goes through the prefix tree); chunks of 5 split groups of 4.
    summary = run(tmp_path, inputs=[CONVERSATIONAL], model=model_dir, chunk_rows=5, max_tokens_per_batch=200)
    table = pq.read_table(summary.output)
    source = pq.read_table(CONVERSATIONAL)
    assert summary.prefix_sharing == "auto"
    assert summary.forward.per_row_tokens == per_row_tokens(table)
    # The mask the roles give: every token the assistant's, since no row holds a tool message.
    assert table.column_names == source.column_names + ["prompt_ids", "response_ids", "mask", "ref_logprobs"]
    assert table.select(source.column_names).equals(source.replace_schema_metadata(None))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for row in table.to_pylist():
        assert row["mask"] == [1] * len(row["response_ids"])
        whole = tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=True,
                                              return_dict=True)["input_ids"]
        alone = tokenizer.apply_chat_template(row["prompt"], tokenize=True, add_generation_prompt=True,
                                              return_dict=True)["input_ids"]
        assert row["prompt_ids"] + row["response_ids"] == whole
        assert row["prompt_ids"] == alone
        assert len(row["policy_logprobs"]) == len(row["response_ids"])  # so klpipe score can pair them
    assert_matches_oracle(models[model_dir], table)
    # The template decides the ids, so it is part of the tokenizer fingerprint (and only here).
    assert cache.read_provenance(summary.output).tokenizer == loading.tokenizer_fingerprint(tokenizer,
                                                                                              chat_template=True)
    assert loading.tokenizer_fingerprint(tokenizer, chat_template=True) != loading.tokenizer_fingerprint(tokenizer)


def test_conversational_jsonl_matches_parquet(tmp_path):
    jsonl = tmp_path / "conversational.jsonl"
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in pq.read_table(CONVERSATIONAL).to_pylist()))
    expected = pq.read_table(run(tmp_path, inputs=[CONVERSATIONAL], model=TINY_LLAMA, name="a.parquet").output)
    from_jsonl = pq.read_table(run(tmp_path, inputs=[jsonl], model=TINY_LLAMA, name="b.parquet").output)
    for column in ("prompt_ids", "response_ids", "ref_logprobs"):
        assert from_jsonl.column(column).to_pylist() == expected.column(column).to_pylist()


def test_trl_standard_prompt_completion_is_the_text_mode(tmp_path, models):
    columns = ["id", "step", "prompt", "completion", "policy_logprobs", "reward"]
    table = pq.read_table(ROLLOUTS).select(["id", "step", "prompt", "response", "policy_logprobs", "reward"])
    table = table.slice(0, 16)  # text mode is tested in full above (with Gemma); this is the alias
    path = tmp_path / "standard.parquet"
    pq.write_table(table.rename_columns(columns), path)
    out = pq.read_table(run(tmp_path, inputs=[path], model=TINY_LLAMA).output)
    assert out.column_names == columns + ["prompt_ids", "response_ids", "ref_logprobs"]
    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA)
    for row in out.to_pylist():
        assert row["prompt_ids"] == tokenizer(row["prompt"]).input_ids
        assert row["response_ids"] == tokenizer(row["completion"], add_special_tokens=False).input_ids
    assert_matches_oracle(models[TINY_LLAMA], out)


# A verl/OpenRLHF-style dump: every role under another name.
DUMP_NAMES = {"id": "uid", "step": "global_step", "prompt_ids": "prompt_token_ids", "response_ids": "completion_ids",
              "policy_logprobs": "old_log_probs", "reward": "score"}


def test_column_mapping_reads_and_writes_the_users_names(tmp_path, models):
    from klpipe.score import ScoreConfig, score

    source = pq.read_table(ROLLOUTS)
    dump = tmp_path / "dump.parquet"
    pq.write_table(source.rename_columns([DUMP_NAMES.get(n, n) for n in source.column_names]), dump)
    columns = {**DUMP_NAMES, "ref_logprobs": "ref_log_prob"}
    mapped = run(tmp_path, inputs=[dump], model=TINY_LLAMA, name="mapped.parquet", columns=columns, chunk_rows=7)
    table = pq.read_table(mapped.output)
    names = [DUMP_NAMES.get(n, n) for n in source.column_names]
    assert table.column_names == names + ["ref_log_prob"]
    # The oracle reads the mapped id columns (`prompt` and `response` text sit in the dump too, but ids win).
    back = table.rename_columns(source.column_names + ["ref_logprobs"])
    assert_matches_oracle(models[TINY_LLAMA], back)
    assert cache.read_provenance(mapped.output).columns == columns
    # The rows were read from the mapped id columns: what they feed is counted from those.
    assert mapped.forward.per_row_tokens == per_row_tokens(back)

    # klpipe score reads the mapping the cache recorded: no --column needed, the user's names kept.
    plain = tmp_path / "plain.parquet"
    pq.write_table(back.replace_schema_metadata(None), plain)
    scored = score(ScoreConfig(inputs=[mapped.output], output=tmp_path / "mapped.scored.parquet"))
    expected = score(ScoreConfig(inputs=[plain], output=tmp_path / "plain.scored.parquet"))
    got, want = pq.read_table(scored.output), pq.read_table(expected.output)
    assert got.column_names == names + ["ref_log_prob", "kl", "kl_coeff", "kl_penalty", "adjusted_reward"]
    for column in ("kl", "kl_coeff", "kl_penalty", "adjusted_reward"):
        assert got.column(column).equals(want.column(column))
    assert scored.report["steps"] == expected.report["steps"]  # `global_step` grouped the rows
    assert len(scored.report["steps"]) == 6

    # A rerun with another mapping is another run, not "already complete".
    with pytest.raises(OutputError, match="exists and was made by a different run"):
        run(tmp_path, inputs=[dump], model=TINY_LLAMA, name="mapped.parquet", columns={**columns, "id": "prompt"},
            chunk_rows=7)


@pytest.mark.parametrize("sharing", ["off", "on"])
def test_chunks_are_planned_in_the_read_ahead_thread_and_match_the_oracle(tmp_path, models, monkeypatch, sharing):
    """Once the mode is settled (off, or the probe passed), a chunk's plan is made while the one before computes."""
    from klpipe.precompute import sharing as module

    threads = []
    real = module.plan_chunk
    monkeypatch.setattr(module, "plan_chunk", lambda *a, **k: threads.append(threading.current_thread().name)
                        or real(*a, **k))
    summary = run(tmp_path, model=TINY_LLAMA, chunk_rows=3, prefix_sharing=sharing)
    chunks = -(-pq.read_metadata(ROLLOUTS).num_rows // 3)
    assert chunks >= 3 and len(threads) >= chunks
    # The first chunks may be read before the probe has run (under on, at load); every later one is planned ahead.
    assert threads.count("klpipe-prefetch") >= chunks - 3, threads
    assert_matches_oracle(models[TINY_LLAMA], pq.read_table(summary.output))
