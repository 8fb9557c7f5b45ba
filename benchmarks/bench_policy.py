"""What one pass over two models saves: `precompute --policy` against two separate runs of precompute.

Rollouts without sampler logprobs (an evaluation set, offline trajectories): the reference's and the policy's
logprobs of every response token are wanted. Two contenders, on the same agent-shaped rows:

    one pass   `klpipe precompute -m REF --policy POLICY`: one read, one tokenization, one plan (prefix
               tree and batches) per chunk, both models resident, run one after the other
    two runs   `klpipe precompute -m REF`, then `klpipe precompute -m POLICY` (its ref_logprobs are the
               policy's): everything twice

Each process also runs on a one-row file; steady state is the whole less that start-up (two
start-ups for two runs). The models are the benchmarks' Llama (contenders.build_model) and a
perturbed copy of it as the policy.

    python benchmarks/bench_policy.py [--repeat 3]
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
import contenders as bench
from contenders import ROOT, VOCAB, build_model

WORK = ROOT / "build" / "bench_policy"
SYSTEM, TASKS, GROUP = 512, 12, 8


def build_inputs() -> tuple[Path, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    WORK.mkdir(parents=True, exist_ok=True)
    build_model(WORK / "reference", max_positions=2048)
    if not (WORK / "policy" / "model.safetensors").exists():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()

        policy = AutoModelForCausalLM.from_pretrained(WORK / "reference")
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for _, param in sorted(policy.named_parameters()):
                param.add_(torch.randn(param.shape, generator=generator) * param.pow(2).mean().sqrt() * 0.1)
        policy.save_pretrained(WORK / "policy", safe_serialization=True)
        AutoTokenizer.from_pretrained(WORK / "reference").save_pretrained(WORK / "policy")
    rng = np.random.default_rng(0)
    system = rng.integers(3, VOCAB, SYSTEM).tolist()
    rows = []
    for task in range(TASKS):
        prompt = system + rng.integers(3, VOCAB, int(rng.integers(16, 64))).tolist()
        rows += [{"id": f"t{task}-g{g}", "prompt_ids": prompt,
                  "response_ids": rng.integers(3, VOCAB, int(rng.integers(64, 192))).tolist()} for g in range(GROUP)]
    schema = pa.schema([("id", pa.string()), ("prompt_ids", pa.list_(pa.int32())),
                        ("response_ids", pa.list_(pa.int32()))])
    table = pa.Table.from_pylist(rows, schema=schema)
    data, one = WORK / "rows.parquet", WORK / "one.parquet"
    pq.write_table(table, data)
    pq.write_table(table.slice(0, 1), one)
    return data, one


def precompute(path: Path, *models: str, startup: bool = False) -> float:
    """Wall seconds of one `klpipe precompute` process (a start-up run: contenders.startup_args)."""
    model, *policy = models
    out = WORK / f"{path.stem}.{Path(model).name}.cached.parquet"
    command = [sys.executable, "-m", "klpipe", "precompute", "-m", model, str(path), "-o", str(out),
               "--progress", "none"] + (["--policy", policy[0]] if policy else []) + bench.startup_args(startup)
    # A finished output of the same run would make the rerun a no-op, a killed one's work directory a resume.
    out.unlink(missing_ok=True)
    shutil.rmtree(out.with_name(out.name + ".partial"), ignore_errors=True)
    started = time.perf_counter()
    subprocess.run(command, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)},
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs per contender; the fastest whole and start-up count")
    args = parser.parse_args()
    data, one = build_inputs()
    ref, policy = str(WORK / "reference"), str(WORK / "policy")
    contenders = {
        "one pass": lambda path, startup=False: precompute(path, ref, policy, startup=startup),
        "two runs": lambda path, startup=False: (precompute(path, ref, startup=startup)
                                                 + precompute(path, policy, startup=startup)),
    }
    runs = {name: (lambda run=run: (run(data), run(one, startup=True), {})) for name, run in contenders.items()}
    best = bench.fastest(runs, args.repeat)
    print(f"{TASKS * GROUP} rows, a {SYSTEM}-token system prompt; best of {args.repeat}, each run its own process")
    bench.print_steady(best)
    one, two = best["one pass"], best["two runs"]
    print(f"two runs ÷ one pass: steady {two['steady'] / one['steady']:.2f}x, whole {two['whole'] / one['whole']:.2f}x")


if __name__ == "__main__":
    main()
