"""What the exact KL costs: `precompute --policy` with `--full-kl` (the default) against `--no-full-kl`.

With --policy, both models run every response position; --full-kl keeps their final hidden states and applies the two
heads together, vocabulary block by block (klpipe/model/joint_head.py): the same two head matmuls, plus the sums over
the logits the heads already make. Two model pairs, a perturbed copy of the reference as the policy:

    llama   the benchmarks' Llama (8 layers x 256, vocabulary 8,192: contenders.build_model)
    e2b     bench_width.py's Gemma 4 of E2B's text width (hidden 1,536, vocabulary 262,144, final-logit softcap), 10
            layers, the last 5 KV-shared: the head's share of the work larger than the full model's (35 layers), so
            the ratio is on the high side

Each contender runs in its own process, on the rows and on a one-row file (its start-up); steady = whole - start-up,
each the fastest of --repeat rounds; peak RSS is the process's own (wait4). The fp32 matmul peak is measured in the
same run.

    python benchmarks/bench_full_kl.py [--repeat 2] [--only llama]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import contenders as bench
import flops
from contenders import ROOT

WORK = ROOT / "build" / "bench" / "full_kl"
PAIRS = {"llama": {"groups": 6, "prompt": (256, 384), "response": (64, 256)},
         "e2b": {"groups": 2, "prompt": (256, 384), "response": (64, 256)}}


def build_pair(name: str) -> tuple[Path, Path]:
    """The reference and its perturbed copy, the policy, built once under build/bench/full_kl."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    reference, policy = WORK / name / "reference", WORK / name / "policy"
    if not (reference / "config.json").exists():
        if name == "llama":
            bench.build_model(reference, max_positions=2048)
        else:
            import bench_width
            from transformers import Gemma4ForCausalLM

            torch.manual_seed(0)
            Gemma4ForCausalLM(bench_width.config()).save_pretrained(reference)
            AutoTokenizer.from_pretrained(ROOT / "sample_data" / "tiny-gemma4").save_pretrained(reference)
    if not (policy / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(reference)
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for _, param in sorted(model.named_parameters()):
                param.add_(torch.randn(param.shape, generator=generator) * param.pow(2).mean().sqrt() * 0.05)
        model.save_pretrained(policy)
        AutoTokenizer.from_pretrained(reference).save_pretrained(policy)
    return reference, policy


def build_rows(name: str, vocab: int) -> tuple[Path, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    shape = PAIRS[name]
    rng = np.random.default_rng(0)
    rows = []
    for group in range(shape["groups"]):
        prompt = rng.integers(3, vocab, int(rng.integers(*shape["prompt"]))).tolist()
        rows += [{"id": f"{group}-{g}", "prompt_ids": prompt,
                  "response_ids": rng.integers(3, vocab, int(rng.integers(*shape["response"]))).tolist()}
                 for g in range(8)]
    table = pa.Table.from_pylist(rows)
    data, one = WORK / name / "rows.parquet", WORK / name / "one.parquet"
    pq.write_table(table, data)
    pq.write_table(table.slice(0, 1), one)
    return data, one


def precompute(path: Path, reference: Path, policy: Path, full: bool) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of one `klpipe precompute --policy` process."""
    out = path.with_name(f"{path.stem}.{'full' if full else 'off'}.cached.parquet")
    out.unlink(missing_ok=True)
    shutil.rmtree(out.with_name(out.name + ".partial"), ignore_errors=True)
    command = [sys.executable, "-m", "klpipe", "precompute", "-m", str(reference), "--policy", str(policy), str(path),
               "-o", str(out), "--progress", "none", "--device", "cpu", "--dtype", "float32",
               "--full-kl" if full else "--no-full-kl"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(bench.threads())}
    started = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    if status:
        sys.exit(f"precompute failed:\n{process.stderr.read().decode()[-3000:]}")
    process.stderr.close()
    return wall, usage.ru_maxrss / 1024


def bench_pair(name: str, repeat: int) -> None:
    """One pair's precompute with --full-kl and without, each contender its best of `repeat`, and its peak RSS."""
    import pyarrow.parquet as pq

    reference, policy = build_pair(name)
    vocab = json.loads((reference / "config.json").read_text()).get("vocab_size") or json.loads(
        (reference / "config.json").read_text())["text_config"]["vocab_size"]
    data, one = build_rows(name, vocab)
    rss: dict[str, float] = {}

    def contender(full: bool, label: str):
        def run():
            startup, _ = precompute(one, reference, policy, full)
            whole, peak = precompute(data, reference, policy, full)
            rss[label] = min(rss.get(label, peak), peak)
            return whole, startup, {}
        return run

    best = bench.fastest({"--no-full-kl": contender(False, "--no-full-kl"),
                          "--full-kl": contender(True, "--full-kl")}, repeat)
    tokens = sum(len(r) for r in pq.read_table(data, columns=["response_ids"]).column(0).to_pylist())
    print(f"\n{name}: {pq.read_metadata(data).num_rows} rows, {tokens:,} response tokens; best of {repeat}, "
          f"each run its own process, {bench.threads()} threads")
    bench.print_steady(best, label_width=14)
    off, full = best["--no-full-kl"], best["--full-kl"]
    print(f"{name}: --full-kl ÷ --no-full-kl: steady {full['steady'] / off['steady']:.3f}x, whole "
          f"{full['whole'] / off['whole']:.3f}x (goal <= 1.15x); peak RSS {rss['--full-kl']:,.0f} MiB against "
          f"{rss['--no-full-kl']:,.0f} MiB ({rss['--full-kl'] / rss['--no-full-kl'] - 1:+.1%}, goal <= +5%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2, help="rounds; each contender keeps its fastest")
    parser.add_argument("--only", nargs="+", choices=list(PAIRS), default=list(PAIRS))
    args = parser.parse_args()
    import torch

    torch.set_num_threads(bench.threads())
    peaks = [flops.matmul_peak(*bench.PEAK_SHAPE)]
    for name in args.only:
        bench_pair(name, args.repeat)
        peaks.append(flops.matmul_peak(*bench.PEAK_SHAPE))
    m, k, n = bench.PEAK_SHAPE
    print(f"\nfp32 matmul peak ({m} x {k} @ {k} x {n}): {max(peaks) / 1e9:.0f} GFLOP/s, the highest of "
          f"{', '.join(f'{p / 1e9:.0f}' for p in peaks)}")


if __name__ == "__main__":
    main()
