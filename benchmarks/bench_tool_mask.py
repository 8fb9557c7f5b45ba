"""What the mask saves in `klpipe precompute`: no LM head on a tool's tokens, nothing fed after the last 1.

Tool-calling trajectories in one row each, as TRL's GRPOTrainer(tools=...) stores them: a system
prompt in every row, groups of 8 responses per task, a completion of the model's call, a long tool
result (mask 0) and the model's answer. Two contenders, each its own `klpipe precompute` process on
the same rows:

    mask     the rows with their `tool_mask`: the head runs on the policy's tokens only
    no mask  the same rows with the mask column renamed, so klpipe does not read it: the head runs
             on every completion token (what klpipe did before it knew masks)

Each also runs on a one-row file; its steady-state time is the whole less that start-up. The model is
the benchmarks' Llama (contenders.build_model: 8 layers × 256, vocabulary 8,192, Gemma 4 E2B's
body-to-head FLOPs ratio), so the head's share of a token's work is Gemma's.

    python benchmarks/bench_tool_mask.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import contenders
from contenders import ROOT, VOCAB, build_model

WORK = ROOT / "build" / "bench_tool_mask"
SYSTEM, TASKS, GROUP = 512, 12, 8
CALL, RESULT, ANSWER = 48, 192, 64  # completion: the call (1s), the tool's result and header (0s), the answer (1s)


def build_inputs() -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    WORK.mkdir(parents=True, exist_ok=True)
    build_model(WORK / "model", max_positions=2048)
    rng = np.random.default_rng(0)
    system = rng.integers(3, VOCAB, SYSTEM).tolist()
    rows = []
    for task in range(TASKS):
        prompt = system + rng.integers(3, VOCAB, int(rng.integers(16, 64))).tolist()
        for g in range(GROUP):
            call, result, answer = (int(rng.integers(n // 2, n)) for n in (CALL, RESULT, ANSWER))
            completion = rng.integers(3, VOCAB, call + result + answer).tolist()
            rows.append({"id": f"t{task}-g{g}", "prompt_ids": prompt, "completion_ids": completion,
                         "tool_mask": [1] * call + [0] * result + [1] * answer})
    schema = pa.schema([("id", pa.string()), ("prompt_ids", pa.list_(pa.int32())),
                        ("completion_ids", pa.list_(pa.int32())), ("tool_mask", pa.list_(pa.int8()))])
    table = pa.Table.from_pylist(rows, schema=schema)
    unmasked = table.rename_columns(["id", "prompt_ids", "completion_ids", "unread_mask"])
    paths = {}
    for name, data in (("mask", table), ("no mask", unmasked)):
        stem = name.replace(" ", "_")
        paths[name] = WORK / f"{stem}.parquet"
        paths[name + " one row"] = WORK / f"{stem}.one.parquet"
        pq.write_table(data, paths[name])
        pq.write_table(data.slice(0, 1), paths[name + " one row"])
    return paths


def run_once(path: Path, startup: bool = False) -> float:
    """Wall seconds of one `klpipe precompute` process on `path` (a start-up run: contenders.startup_args)."""
    out = WORK / (path.stem + ".cached.parquet")
    command = [sys.executable, "-m", "klpipe", "precompute", "-m", str(WORK / "model"), str(path), "-o", str(out),
               "--column", "response_ids=completion_ids", "--progress", "none"] + contenders.startup_args(startup)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    # A finished output of the same run would make the rerun a no-op, a killed one's work directory a resume.
    out.unlink(missing_ok=True)
    shutil.rmtree(out.with_name(out.name + ".partial"), ignore_errors=True)
    started = time.perf_counter()
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs per contender; the fastest whole and start-up count")
    args = parser.parse_args()
    paths = build_inputs()
    import pyarrow.parquet as pq

    masks = pq.read_table(paths["mask"]).column("tool_mask").to_pylist()
    tokens = sum(len(m) for m in masks)
    policy = sum(sum(m) for m in masks)
    print(f"{len(masks)} rows, {tokens:,} completion tokens, {policy:,} the policy's ({policy / tokens:.0%}); "
          f"best of {args.repeat}, each contender its own process")
    runs = {name: (lambda name=name: (run_once(paths[name]), run_once(paths[name + " one row"], startup=True), {}))
            for name in ("mask", "no mask")}
    best = contenders.fastest(runs, args.repeat)
    contenders.print_steady(best)
    masked, plain = best["mask"], best["no mask"]
    print(f"no mask ÷ mask: steady {plain['steady'] / masked['steady']:.2f}x, "
          f"whole {plain['whole'] / masked['whole']:.2f}x")


if __name__ == "__main__":
    main()
