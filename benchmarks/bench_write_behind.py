"""Write behind: how much of precompute's chunk writing the model's work hides.

precompute writes each finished chunk (parquet, fsync, rename) in a writer thread while the model runs
the next one (klpipe/precompute/run.py). This runs `klpipe.precompute` once, in-process, on rows that
make writing cost something next to the model: a random Llama-style model (hidden 256, 4 layers, a 32k
vocabulary, fp32 on CPU), log-uniform row lengths 16-512, and a pass-through column of incompressible
text per row (`--passthrough-kib`, 64 by default: long agent transcripts, say), `--chunk-rows 16`.

It prints the run's wall time (model loading excluded), the seconds spent writing chunks (timed around
WorkDir.write_chunk, whichever thread runs it) and the seconds the model's thread spent waiting for the
writer. With the write behind, wall time approaches the larger of the model's time and the writing time
instead of their sum. Run it at an older commit (writes on the model's thread) for the before figure.

Run: `python benchmarks/bench_write_behind.py [--tokens 20000] [--passthrough-kib 64]`.
"""

from __future__ import annotations

import argparse
import base64
import os
import shutil
import time
from pathlib import Path

import numpy as np
from bench_precompute import random_rows  # benchmarks/bench_precompute.py

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "bench" / "write_behind"
MODEL_DIR = WORK / "llama-32k-small"
VOCAB = 32_000


def build_model(seed: int = 0) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (MODEL_DIR / "model.safetensors").exists():
        return
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(MODEL_DIR, safe_serialization=True)
    # klpipe needs a tokenizer beside the model; the rows here are token ids, so any will do.
    AutoTokenizer.from_pretrained(ROOT / "sample_data" / "tiny-llama").save_pretrained(MODEL_DIR)


def build_rollouts(path: Path, tokens: int, passthrough_kib: int, seed: int = 0) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    prompts, responses = random_rows(rng, tokens, VOCAB)  # bench_precompute's rows
    # Random bytes as base64 text: parquet's compression cannot shrink them below 3/4 of their size.
    text = [base64.b64encode(rng.bytes(passthrough_kib * 768)).decode() for _ in prompts]
    pq.write_table(pa.table({
        "id": [f"r{i}" for i in range(len(prompts))],
        "prompt_ids": pa.array(prompts, pa.list_(pa.int32())),
        "response_ids": pa.array(responses, pa.list_(pa.int32())),
        "transcript": text,
    }), path)
    return len(prompts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20_000)
    parser.add_argument("--passthrough-kib", type=int, default=64)
    parser.add_argument("--chunk-rows", type=int, default=16)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(int(os.environ.get("KLPIPE_BENCH_THREADS", os.cpu_count() or 1)))
    WORK.mkdir(parents=True, exist_ok=True)
    build_model()
    rollouts = WORK / "rollouts.parquet"
    rows = build_rollouts(rollouts, args.tokens, args.passthrough_kib)

    from transformers import AutoConfig, AutoTokenizer

    AutoConfig.from_pretrained(MODEL_DIR)  # transformers' lazy imports, warm before the clock starts
    AutoTokenizer.from_pretrained(MODEL_DIR)
    import threading

    from klpipe import threads
    from klpipe.precompute import PrecomputeConfig, precompute
    from klpipe.precompute.workdir import WorkDir

    timed = {"write": 0.0, "wait": 0.0}
    writers = set()  # the threads that wrote chunks

    def timer(key, function):
        def run(*a, **k):
            writers.add(threading.current_thread().name) if key == "write" else None
            started = time.perf_counter()
            try:
                return function(*a, **k)
            finally:
                timed[key] += time.perf_counter() - started
        return run

    WorkDir.write_chunk = timer("write", WorkDir.write_chunk)
    background = getattr(threads, "Background", None)  # absent before write behind
    if background is not None:
        background.wait_for_room = timer("wait", background.wait_for_room)

    out = WORK / "cached.parquet"
    shutil.rmtree(WORK / "cached.parquet.partial", ignore_errors=True)
    out.unlink(missing_ok=True)
    started = time.perf_counter()
    summary = precompute(PrecomputeConfig(inputs=[rollouts], output=out, model=str(MODEL_DIR), device="cpu",
                                          dtype="float32", progress="none", chunk_rows=args.chunk_rows,
                                          prefix_sharing="off"), log=lambda m: None)
    wall = time.perf_counter() - started - summary.load_seconds
    chunks = -(-rows // args.chunk_rows)
    print(f"{rows} rows, {summary.tokens:,} scored tokens, {chunks} chunks of {args.chunk_rows} rows, "
          f"{args.passthrough_kib} KiB pass-through per row ({out.stat().st_size / 2**20:.0f} MiB out), "
          f"{torch.get_num_threads()} torch threads on {os.cpu_count()} cores")
    print(f"wall (load excluded) {wall:.2f} s; writing chunks {timed['write']:.2f} s "
          f"(in {', '.join(sorted(writers))}); "
          f"the model's thread waited for the writer {timed['wait']:.2f} s")


if __name__ == "__main__":
    main()
