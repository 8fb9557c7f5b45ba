"""A reference model larger than its memory cgroup, streamed, against the same model in memory, on the same rows.

The model is tests/model/test_streaming.py's: a Llama of `--layers` layers of 61 MB (hidden 1,024, MLP 4,096, fp32;
48 layers: 2.9 GB), written once under build/bench/stream/. Each run is a fresh `python -m klpipe precompute`
with `--prefix-sharing off` (rows run whole in both; `on`: the tree in both, over GRPO groups):

  streamed   in a v1 (or v2) memory cgroup of `--limit` MiB (default: a third of the model), the model's pages
             dropped from the page cache first, so every layer is read from disk through the cgroup
  in memory  the same command outside any cgroup, its page cache warm (the best case for it)

Printed: wall times (load included), scoring seconds, the bytes streaming read, the share of the read hidden
under compute, and fp32 GFLOP/s (2 x parameters x fed tokens over the scoring seconds) against this machine's
matmul peak at the same thread count (torch.mm of 2,048 x 2,048 fp32). Needs root for the cgroup.

Run: `python benchmarks/bench_stream.py [--layers 48] [--tokens 4096] [--limit MiB] [--chunk-rows N]
[--prefix-sharing on [--group-size 8]]`. Passes are 512 tokens
(`--max-tokens-per-batch 512`), so that one pass's activations fit beside two layers in the cgroup.

Measured (2 CPU cores, matmul peak 276 to 348 GFLOP/s), the defaults, five runs over two days with the passes as
greenlets: streamed scoring 80%, 91%, 95%, 101% and 81% of in memory (median 91%), whole runs 77% to 119%; in memory
alone moved from 21.1 to 26.1 s between runs, so one pair says little. Every run read 7,657 MiB in 3 groups (7,667
since the input embeddings' rows are read too), 98% of it hidden by the clock, the cgroup's peak 545 to 557 MiB.
docs/precompute.md, Weights larger than memory, says where the rest goes.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the test's model and cgroup, so that both measure the same thing

from tests.helpers import with_checkout
from tests.model.test_streaming import big_llama, drop_from_page_cache, memory_cgroup

WORK = ROOT / "build" / "bench" / "stream"


def rows_file(path: Path, tokens: int, vocab: int = 512, group: int = 1) -> int:
    """Rows of a 200-token prompt and a 56-token response until about `tokens` fed tokens, `group` rows a prompt (a
    GRPO group); how many fed, counted row by row."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    count = max(tokens // 255, 1)
    prompts = [rng.integers(3, vocab, 200).tolist() for _ in range(-(-count // group))]
    prompts = [prompts[i // group] for i in range(count)]
    responses = [rng.integers(3, vocab, 56).tolist() for _ in range(count)]
    pq.write_table(pa.table({"id": [str(i) for i in range(count)], "step": [0] * count, "prompt_ids": prompts,
                             "response_ids": responses,
                             "policy_logprobs": [[-1.0] * 56] * count, "reward": [0.0] * count}), path)
    return count * 255


def matmul_peak() -> float:
    """fp32 GFLOP/s of torch.mm at 2,048 x 2,048, at this process's thread count."""
    import torch

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    torch.mm(a, b)
    started, runs = time.perf_counter(), 10
    for _ in range(runs):
        torch.mm(a, b)
    return 2 * 2048**3 * runs / (time.perf_counter() - started) / 1e9


def run(command: list[str], env: dict, procs: Path | None = None) -> tuple[float, str]:
    """(wall seconds, stderr) of `python -m klpipe COMMAND`, in the cgroup whose procs file is `procs` if given."""
    argv = ([sys.executable, "-m", "klpipe", *command] if procs is None else
            ["sh", "-c", f'echo $$ > {procs} && exec "$0" -m klpipe "$@"', sys.executable, *command])
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"klpipe failed ({done.returncode}): {done.stderr.strip()}")
    return time.perf_counter() - started, done.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 48: a third of the model holds the process (632 MiB before the weights with torch 2.13, transformers 5.24,
    # pyarrow 26 and datasets 5.2: 44 layers' third, 852 MiB, fell 6 MiB short of the smallest streamed budget).
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--tokens", type=int, default=4096, help="fed tokens of rows (prompt 200 + response 56 each)")
    parser.add_argument("--limit", type=int, default=None,
                        help="the cgroup's limit, MiB (default: a third of the model)")
    parser.add_argument("--chunk-rows", type=int, default=None,
                        help="rows per chunk (default: klpipe's; fewer: several chunks, each its groups)")
    parser.add_argument("--prefix-sharing", choices=["off", "on"], default="off",
                        help="on: the prefix tree in both runs, over GRPO groups of --group-size rows a prompt")
    parser.add_argument("--group-size", type=int, default=8, help="rows a prompt, with --prefix-sharing on")
    args = parser.parse_args()
    model = WORK / f"llama-{args.layers}"
    if not (model / "model.safetensors").is_file():
        WORK.mkdir(parents=True, exist_ok=True)
        big_llama(model, args.layers)
    size = (model / "model.safetensors").stat().st_size
    parameters = size // 4
    rows = WORK / "rows.parquet"
    fed = rows_file(rows, args.tokens, group=args.group_size if args.prefix_sharing == "on" else 1)
    limit = (args.limit << 20) if args.limit else size // 3
    env = with_checkout({**os.environ, "HF_HUB_OFFLINE": "1"})
    common = ["precompute", str(rows), "--model", str(model), "--progress", "none",
              "--prefix-sharing", args.prefix_sharing,
              "--max-tokens-per-batch", "512", "--overwrite",
              *(["--chunk-rows", str(args.chunk_rows)] if args.chunk_rows else [])]
    import shutil

    for old in [*WORK.glob("streamed.parquet*"), *WORK.glob("memory.parquet*")]:  # a rerun computes again
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    made = memory_cgroup(f"klpipe-bench-{os.getpid()}", limit)
    if made is None:
        print("bench_stream: skipped, no memory cgroup can be made here (needs root and cgroup v1 or v2)")
        return
    group, procs, peak = made
    try:
        drop_from_page_cache(model / "model.safetensors")
        streamed_wall, streamed = run([*common, "--output", str(WORK / "streamed.parquet")], env, procs)
        used = int(peak.read_text())
    finally:
        group.rmdir()
    memory_wall, in_memory = run([*common, "--output", str(WORK / "memory.parquet")], env)
    peak_gflops = matmul_peak()

    def seconds(stderr: str) -> float:
        return float(re.search(r"response tokens in ([\d,.]+)s", stderr).group(1).replace(",", ""))
    print(f"model {size / 2**30:.2f} GiB ({parameters / 1e6:,.0f}M fp32 parameters), cgroup {limit / 2**20:,.0f} MiB "
          f"(peak use {used / 2**20:,.0f} MiB), {fed:,} fed tokens")
    for name, wall, stderr in (("streamed", streamed_wall, streamed), ("in memory", memory_wall, in_memory)):
        scoring = seconds(stderr)
        tree = re.search(r"fed ([\d,]+) tokens where running each row whole", stderr)  # what the tree fed
        gflops = 2 * parameters * (int(tree.group(1).replace(",", "")) if tree else fed) / scoring / 1e9
        print(f"{name:10s} wall {wall:6.1f} s, scoring {scoring:6.1f} s, {gflops:5.1f} GFLOP/s "
              f"({gflops / peak_gflops:.0%} of the {peak_gflops:.0f} GFLOP/s matmul peak)")
    found = re.search(r"weights streamed: ([\d,]+) MiB read in (\d+) layer-major group\(s\), ([\d,]+) MiB each"
                      r"(, \d+ of \d+ layers kept loaded from group to group)?, (\d+)% of the read hidden", streamed)
    if found:
        print(f"streamed: {found.group(1)} MiB read in {found.group(2)} group(s){found.group(4) or ''}, "
              f"{found.group(5)}% of the read hidden "
              f"under compute; speed {seconds(in_memory) / seconds(streamed):.0%} of in memory scoring, "
              f"{memory_wall / streamed_wall:.0%} over the whole run (load included: its checks read the weights "
              "once, their forwards one layer-major group)")


if __name__ == "__main__":
    main()
