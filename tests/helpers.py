"""Shared test plumbing: the oracle, running the CLI, and reading caches back."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parent.parent


def oracle_logprobs(model, prompt_ids, response_ids, temperature: float = 1.0) -> np.ndarray:
    """Naive fp32: one sequence, a full forward pass, log_softmax(logits)[t-1, token_t]."""
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    start = len(prompt_ids)
    return np.array([logprobs[start + i - 1, tok].item() for i, tok in enumerate(response_ids)], dtype=np.float32)


def run_cli(*args: str, env: dict | None = None, timeout: float = 300, cwd: Path | None = None):
    """`python -m klpipe ARGS` in a fresh process, as cron or Slurm would run it."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "klpipe", *args], capture_output=True, text=True, env=full_env,
        timeout=timeout, cwd=cwd or ROOT,
    )


def read_rows(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


WIDE = 20_000  # bytes of a wide pass-through column per row: documents, images, traces


def write_wide_rows(path: Path, rows: int, *, tokens: int = 3, blob_bytes: int = WIDE, random_bytes: int = WIDE,
                    ref_logprobs: bool = False) -> Path:
    """Rollouts (a cache, with `ref_logprobs`) of `tokens`-token prompts and responses and a `blob_bytes` column.

    The first `random_bytes` of each row's blob are random and the rest zeros, which compress
    away: the ratio sets how many bytes on disk stand for how many in memory.
    """
    rng = np.random.default_rng(rows)
    writer = None
    for start in range(0, rows, 500):
        n = min(500, rows - start)
        ids = pa.array(rng.integers(3, 500, n * tokens, dtype=np.int32))
        offsets = pa.array(np.arange(n + 1, dtype=np.int32) * tokens)
        logprobs = [pa.ListArray.from_arrays(offsets, pa.array(-rng.random(n * tokens, dtype=np.float32)))
                    for _ in range(2)]
        blob = np.zeros((n, blob_bytes), dtype=np.uint8)
        blob[:, :random_bytes] = np.frombuffer(rng.bytes(n * random_bytes), np.uint8).reshape(n, random_bytes)
        columns = {
            "id": pa.array([f"r{i}" for i in range(start, start + n)]),
            "step": pa.array(np.arange(start, start + n) // 16),
            "prompt_ids": pa.ListArray.from_arrays(offsets, ids),
            "response_ids": pa.ListArray.from_arrays(offsets, ids),
            "policy_logprobs": logprobs[0],
            "reward": pa.array(rng.random(n)),
            "blob": pa.BinaryArray.from_buffers(
                pa.binary(), n, [None, pa.array(np.arange(n + 1, dtype=np.int32) * blob_bytes).buffers()[1],
                                 pa.py_buffer(blob)]),
        }
        if ref_logprobs:
            columns["ref_logprobs"] = logprobs[1]
        table = pa.table(columns)
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    writer.close()
    return path


# Runs one command and prints the peak RSS of that command alone (KiB on Linux): getrusage's
# RUSAGE_CHILDREN in a fresh wrapper counts no other child, unlike the test process's own.
_PEAK_RSS_WRAPPER = """
import resource, subprocess, sys
code = subprocess.run(sys.argv[1:]).returncode
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, code)
"""


def peak_rss_mib(commands: list[list], env: dict | None = None, timeout: float = 600) -> list[float]:
    """Run each `klpipe ARGS` command in a fresh process, all at once; the peak RSS of each, in MiB.

    A command that fails fails the caller's test: its stderr is in the assertion message.
    """
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    processes = [
        subprocess.Popen([sys.executable, "-c", _PEAK_RSS_WRAPPER, sys.executable, "-m", "klpipe", *map(str, command)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, cwd=ROOT)
        for command in commands
    ]
    peaks = []
    for command, process in zip(commands, processes, strict=True):
        stdout, stderr = process.communicate(timeout=timeout)
        kib, code = stdout.split()[-2:]
        assert process.returncode == 0 and code == "0", f"klpipe {' '.join(map(str, command))}: exit {code}: {stderr}"
        peaks.append(int(kib) / 1024)
    return peaks
