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

from klpipe.rollouts import Chunk, TokenizedChunk

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


def tokenized_chunk(rows) -> TokenizedChunk:
    """A chunk of (prompt ids, response ids) rows, flattened as ChunkTokenizer hands it to the model."""

    def flat(lists):
        offsets = np.zeros(len(lists) + 1, dtype=np.int64)
        np.cumsum([len(x) for x in lists], out=offsets[1:])
        values = np.concatenate([np.asarray(x, dtype=np.int64) for x in lists]) if lists else np.zeros(0, np.int64)
        return values, offsets

    prompts, prompt_offsets = flat([p for p, _ in rows])
    responses, response_offsets = flat([r for _, r in rows])
    n = len(rows)
    chunk = Chunk(0, 0, pa.table({"x": list(range(n))}), np.zeros(n, np.int64), np.arange(n))
    return TokenizedChunk(chunk, chunk.table, prompts, prompt_offsets, responses, response_offsets)
