"""The load-time checks' verdicts remembered between runs (precompute/verdict_key.py, storage/verdicts.py,
model/checks.py): a later run with the same key reuses them, bit for bit the cold run's numbers; any part of the key
changed, --recheck, an unreadable entry, or a short probe that disagrees runs every check again.

Each run is the stage itself on real tiny models and real parquet files; the verdicts live in the test's own
KLPIPE_CACHE_DIR (tests/conftest.py).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from klpipe import cache
from klpipe.model import checks, runtime
from klpipe.precompute import PrecomputeConfig, precompute
from klpipe.storage.fingerprint import cache_dir
from tests.architectures import FAST, save_tiny
from tests.helpers import ROOT, TINY_LLAMA, agent_rollouts, oracle_logprobs, with_checkout

TOLERANCE = 1e-4


def config(tmp_path, model, name: str, rows: Path, **options) -> PrecomputeConfig:
    return PrecomputeConfig(inputs=[rows], output=tmp_path / name, model=str(model), device="cpu", progress="none",
                            **options)


def run(tmp_path, model, name: str, rows: Path, lines: list | None = None, **options):
    """(the summary, the ref_logprobs written, whether every check ran) of one precompute run."""
    ran = []
    full = checks._all

    def counted(*args, **kwargs):
        ran.append(1)
        return full(*args, **kwargs)

    checks._all = counted
    try:
        summary = precompute(config(tmp_path, model, name, rows, **options),
                             log=lines.append if lines is not None else lambda line: None)
    finally:
        checks._all = full
    return summary, pq.read_table(tmp_path / name).column(cache.REF_LOGPROBS).to_pylist(), bool(ran)


def entries() -> list[Path]:
    return sorted((cache_dir() / "verdicts").glob("*.json"))


def identical(a: list, b: list) -> bool:
    """Bit for bit, NaNs in the same places."""
    return len(a) == len(b) and all(np.array_equal(np.array(x, dtype=np.float32).view(np.int32),
                                                   np.array(y, dtype=np.float32).view(np.int32))
                                    for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def agent(tmp_path_factory) -> Path:
    return agent_rollouts(tmp_path_factory.mktemp("rows") / "agent.parquet", tasks=3, group=3, turns=2)


@pytest.mark.parametrize("family", FAST)
def test_a_remembered_verdict_gives_the_cold_runs_numbers_bit_for_bit(tmp_path, family, agent):
    model = save_tiny(family, tmp_path / family)
    cold, cold_values, checked = run(tmp_path, model, "cold.parquet", agent)
    assert checked and cold.verdicts == "checked" and len(entries()) == 1
    written = json.loads(entries()[0].read_text())
    assert written["verdict"]["tree_probed"]  # the tree ran under auto, and its probe joined the verdict
    lines = []
    warm, warm_values, checked = run(tmp_path, model, "warm.parquet", agent, lines)
    assert not checked and warm.verdicts == "reused"
    assert sum("verdicts of an earlier run" in line and "reused" in line for line in lines) == 1
    assert identical(cold_values, warm_values)
    assert (cold.prefix_sharing, cold.forward.fed_tokens) == (warm.prefix_sharing, warm.forward.fed_tokens)
    assert json.loads(entries()[0].read_text()) == written  # nothing new to remember


def test_the_same_key_reuses_and_recheck_runs_every_check(tmp_path, agent):
    run(tmp_path, TINY_LLAMA, "a.parquet", agent)
    assert not run(tmp_path, TINY_LLAMA, "b.parquet", agent)[2]
    summary, _, checked = run(tmp_path, TINY_LLAMA, "c.parquet", agent, recheck=True)
    assert checked and summary.verdicts == "checked"


def _faked_versions(monkeypatch, tmp_path):
    real = runtime.library_versions
    monkeypatch.setattr(runtime, "library_versions", lambda: {**real(), "torch": "99.0.0"})


def _other_device(monkeypatch, tmp_path):
    real = runtime.device_identity
    monkeypatch.setattr(runtime, "device_identity", lambda device: {**real(device), "name": "another CPU"})


def _eager_attention(monkeypatch, tmp_path):
    from klpipe.model import loading

    real = loading.load_model

    def eager(spec):
        model, *rest = real(spec)
        model.set_attn_implementation("eager")
        return model, *rest

    monkeypatch.setattr(loading, "load_model", eager)


@pytest.mark.parametrize("change", ["torch version", "device name", "dtype", "attention implementation",
                                    "adapter bytes", "compile"])
def test_each_part_of_the_key_changed_runs_every_check(tmp_path, monkeypatch, agent, change):
    options = {"policy": str(_adapter(tmp_path))} if change == "adapter bytes" else {}
    _, _, checked = run(tmp_path, TINY_LLAMA, "first.parquet", agent, compile="off", **options)
    assert checked
    if change == "dtype":
        options["dtype"] = "bfloat16"
    elif change == "compile":
        options["compile"] = "auto"  # compiles nothing on CPU, as off does: the option alone is in the key
    elif change == "adapter bytes":
        weights = Path(options["policy"]) / "adapter_model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-3] ^= 0x01  # one bit of a LoRA B value
        weights.write_bytes(bytes(data))
    else:
        {"torch version": _faked_versions, "device name": _other_device,
         "attention implementation": _eager_attention}[change](monkeypatch, tmp_path)
    second, values, checked = run(tmp_path, TINY_LLAMA, "second.parquet", agent, **{"compile": "off", **options})
    assert checked and second.verdicts == "checked"
    assert len(entries()) == 2  # each key its own entry
    if change != "dtype":
        assert max_error(agent, values) <= TOLERANCE


def _adapter(tmp_path) -> Path:
    from tests.model.test_lora import save_adapter

    return save_adapter(TINY_LLAMA, tmp_path / "adapter")


def max_error(rows_path: Path, values: list) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(TINY_LLAMA).eval()
    table = pq.read_table(rows_path)
    worst = 0.0
    for prompt, response, got in zip(table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist(),
                                     values, strict=True):
        if response:
            worst = max(worst, float(np.max(np.abs(np.array(got) - oracle_logprobs(model, prompt, response)))))
    return worst


@pytest.mark.parametrize("damage", ["cut short", "not JSON", "another key", "a field of another type"])
def test_an_unreadable_entry_is_one_warning_and_is_written_anew(tmp_path, agent, damage):
    _, cold_values, _ = run(tmp_path, TINY_LLAMA, "cold.parquet", agent)
    (entry,) = entries()
    whole = entry.read_text()
    written = json.loads(whole)
    if damage == "cut short":
        entry.write_text(whole[: len(whole) // 2])
    elif damage == "not JSON":
        entry.write_bytes(b"\xff\xfe garbage")
    elif damage == "another key":
        entry.write_text(json.dumps({**written, "key": {**written["key"], "torch": "0.1"}}))
    else:
        entry.write_text(json.dumps({**written, "verdict": {**written["verdict"], "packed": "yes"}}))
    lines = []
    summary, values, checked = run(tmp_path, TINY_LLAMA, "again.parquet", agent, lines)
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 1 and str(entry) in warnings[0] and "unreadable" in warnings[0], lines
    assert checked and summary.verdicts == "checked" and identical(values, cold_values)
    assert json.loads(entry.read_text()) == written  # written anew, whole
    assert not run(tmp_path, TINY_LLAMA, "then.parquet", agent)[2]


def test_a_remembered_verdict_its_model_disagrees_with_runs_every_check(tmp_path, monkeypatch, agent):
    # A change the key cannot see (here klpipe's chunked head made wrong in this process alone): the short probe run
    # on every load catches it, and the checks drop the wrong head for the model's own.
    from klpipe.model import head

    run(tmp_path, TINY_LLAMA, "cold.parquet", agent)
    right = head.HeadView.transform
    monkeypatch.setattr(head.HeadView, "transform", lambda self, logits, t: right(self, logits, t).mul_(1.25))
    lines = []
    summary, values, checked = run(tmp_path, TINY_LLAMA, "again.parquet", agent, lines)
    assert checked and summary.verdicts == "checked"
    assert [line for line in lines if "remembered verdicts" in line] == [
        next(line for line in lines if line.startswith("LlamaForCausalLM: the remembered verdicts were not taken: they "
                                                       "disagree with its own forward on the short probe (max |Δ "
                                                       "logprob| = "))]
    assert any("klpipe's chunked LM head disagrees with the model's own logits" in line for line in lines)
    assert max_error(agent, values) <= TOLERANCE


def test_two_runs_racing_on_one_entry_both_finish_with_the_right_numbers(tmp_path, agent):
    env = with_checkout({**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                         "KLPIPE_CACHE_DIR": str(tmp_path / "shared-cache")})
    outputs = []
    for round_ in ("cold", "warm"):  # both write the same entry at once, then both read it at once
        names = [tmp_path / f"{round_}-{k}.parquet" for k in range(2)]
        racers = [subprocess.Popen([sys.executable, "-m", "klpipe", "precompute", str(agent), "-m", str(TINY_LLAMA),
                                    "-o", str(name), "--device", "cpu", "--progress", "none"], env=env, cwd=ROOT,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for name in names]
        said = []
        for racer in racers:
            _, stderr = racer.communicate(timeout=600)
            assert racer.returncode == 0, stderr
            said.append(stderr.splitlines()[-1].rsplit("verdicts ", 1)[1])
        # Cold, the first to finish its checks may have written the entry before the other looked: one checked at least.
        assert said == ["reused)"] * 2 if round_ == "warm" else "checked)" in said, said
        outputs += [pq.read_table(name).column(cache.REF_LOGPROBS).to_pylist() for name in names]
    assert all(identical(outputs[0], other) for other in outputs[1:])
    assert max_error(agent, outputs[0]) <= TOLERANCE
    (entry,) = (tmp_path / "shared-cache" / "verdicts").glob("*.json")
    assert json.loads(entry.read_text())["verdict"]["packed"] is True  # one whole entry
