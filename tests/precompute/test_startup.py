"""Where a run's start-up goes (precompute/startup.py): load, checks and whether the verdicts were reused, in the
summary and in --progress's log, and a streamed model's bytes read before its first row."""

import re

import numpy as np
import pyarrow.parquet as pq

from klpipe import process_memory
from klpipe.precompute import PrecomputeConfig, budget, precompute
from tests.helpers import ROLLOUTS, TINY_LLAMA, run_cli

LINE = re.compile(r"start-up (\d+\.\d) s \(load (\d+\.\d), checks (\d+\.\d), verdicts (checked|reused)(, ([\d,]+) MiB "
                  r"of weights read)?\)")


def test_the_summary_and_the_progress_log_say_where_the_start_up_went(tmp_path):
    said = []
    for run in ("first", "second"):
        result = run_cli("precompute", str(ROLLOUTS), "-m", str(TINY_LLAMA), "-o", str(tmp_path / f"{run}.parquet"),
                         "--device", "cpu", "--progress", "log")
        assert result.returncode == 0, result.stderr
        lines = result.stderr.splitlines()
        logged = [m for line in lines if (m := LINE.fullmatch(line))]  # the progress log's own line, before any row
        summary = LINE.search(lines[-1])  # and the summary's, at its end
        assert len(logged) == 1 and summary is not None and lines[-1].endswith(summary.group(0))
        assert lines.index(logged[0].group(0)) < len(lines) - 1 and lines[-1].startswith("wrote ")
        startup, load, checks = (float(logged[0].group(k)) for k in (1, 2, 3))
        assert abs(load + checks - startup) <= 0.15  # each rounded to a tenth
        said.append(logged[0].group(4))
    assert said == ["checked", "reused"]


def test_without_progress_the_log_has_no_start_up_line_and_the_summary_keeps_it(tmp_path):
    result = run_cli("precompute", str(ROLLOUTS), "-m", str(TINY_LLAMA), "-o", str(tmp_path / "out.parquet"),
                     "--device", "cpu", "--progress", "none")
    assert result.returncode == 0, result.stderr
    assert [line for line in result.stderr.splitlines() if LINE.search(line)] == result.stderr.splitlines()[-1:]


def tied_llama(directory):
    """A tiny Llama whose head is its input embeddings (loaded resident, once) and whose layers hold most of its
    bytes: what it reads beyond its file is a decoder layer read twice."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.architectures import COMMON, save_spread

    torch.manual_seed(0)
    config = LlamaConfig(**{**COMMON, "num_hidden_layers": 4, "tie_word_embeddings": True})
    return save_spread(AutoModelForCausalLM.from_config(config), directory)


def test_a_streamed_run_reads_its_weights_once_before_its_first_row(tmp_path, monkeypatch):
    # The checks' probes, the model's own forwards and klpipe's rows alike, are one layer-major group: each decoder
    # layer read once before the first row, beside what loading reads (the rest of the file, once).
    from safetensors import safe_open

    from klpipe.model import ModelSpec, streamed_load

    model = tied_llama(tmp_path / "tied")
    footprint = 900 << 20
    monkeypatch.setattr(process_memory, "resident", lambda: footprint)
    sizes = streamed_load.measure(ModelSpec(str(model), dtype="float32", device="cpu"), 256)
    smallest = footprint + budget.GROWTH + sizes.resident + 2 * sizes.largest_layer + sizes.activations
    summaries = []
    for run in ("cold", "remembered"):
        config = PrecomputeConfig(inputs=[ROLLOUTS], output=tmp_path / f"{run}.parquet", model=str(model),
                                  device="cpu", progress="none", max_tokens_per_batch=256, max_memory=str(smallest),
                                  prefix_sharing="off")
        summaries.append(precompute(config, log=lambda line: None))
    with safe_open(str(model / "model.safetensors"), framework="numpy") as weights:
        stored = {key: weights.get_tensor(key).nbytes for key in weights.keys()}  # noqa: SIM118 - safe_open is no mapping
    layer = max(sum(n for key, n in stored.items() if f".layers.{k}." in key) for k in range(4))
    assert [s.verdicts for s in summaries] == ["checked", "reused"]
    for summary in summaries:
        assert summary.streamed is not None  # it streamed
        assert sum(stored.values()) - layer < summary.startup_bytes_read <= sum(stored.values())
    got, expected = (pq.read_table(tmp_path / f"{run}.parquet").column("ref_logprobs").to_pylist()
                     for run in ("cold", "remembered"))
    assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(got, expected, strict=True))
