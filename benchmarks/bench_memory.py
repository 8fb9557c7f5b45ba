"""Peak memory of both stages at growing inputs (precompute 1×, 4×, 16×; score 1×, 4×, 8×): it should not grow.

Each run is a fresh `python -m klpipe` process with default settings; its peak RSS comes from
getrusage in a wrapper around it (tests/helpers.py `peak_rss_mib`, which tests/test_memory.py
asserts on). Three shapes, where input bytes dominate everything else a run holds:

  precompute  the tiny Llama under sample_data/, 3-token prompts and responses, a 20 kB
              incompressible pass-through column per row (1× = 6,144 rows, three chunks of the
              default 2,048 rows, 123 MB: enough to fill its pipeline)
  score wide  3-token rows with a 20 kB pass-through column that compresses 7:1
              (1× = 25,000 rows: 500 MB in memory, 74 MB on disk)
  score       40-token rows of random logprobs, no wide column (1× = 200,000 rows, 117 MB)

The last line prints precompute's peak at 1×, 4× and 16× and the ratio of 16× to 1×.

Run: `make bench` or `python benchmarks/bench_memory.py [--scale 0.25] [--stage precompute]`.
Inputs are made under build/bench/memory/ and deleted after each shape.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the test suite's input generator and RSS wrapper, so both measure alike

from tests.helpers import TINY_LLAMA, WIDE, peak_rss_mib, write_wide_rows

WORK = ROOT / "build" / "bench" / "memory"
SIZES = {"precompute": (1, 4, 16), "score wide": (1, 4, 8), "score": (1, 4, 8)}


def shapes(scale: float) -> dict:
    """name → (rows at 1×, input writer, klpipe arguments for an input path)."""
    return {
        "precompute": (
            int(6_144 * scale),
            lambda path, rows: write_wide_rows(path, rows),
            lambda path: ["precompute", "-m", TINY_LLAMA, path, "-o", f"{path}.out", "--device", "cpu",
                          "--progress", "none"],
        ),
        "score wide": (
            int(25_000 * scale),
            lambda path, rows: write_wide_rows(path, rows, random_bytes=WIDE // 10, ref_logprobs=True),
            lambda path: ["score", path, "-o", f"{path}.out"],
        ),
        "score": (
            int(200_000 * scale),
            lambda path, rows: write_wide_rows(path, rows, tokens=40, blob_bytes=0, random_bytes=0,
                                               ref_logprobs=True),
            lambda path: ["score", path, "-o", f"{path}.out"],
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every 1× size (smaller: faster, rougher)")
    parser.add_argument("--stage", choices=list(SIZES), action="append", help="run only these shapes (repeatable)")
    args = parser.parse_args()
    print(f"| {'stage':10} | {'size':4} | {'rows':>9} | {'input MB':>8} | {'peak RSS MiB':>12} | {'vs 1×':>5} "
          f"| {'seconds':>7} |")
    print(f"|{'-' * 12}|{'-' * 6}|{'-' * 11}|{'-' * 10}|{'-' * 14}|{'-' * 7}|{'-' * 9}|")
    precompute = {}
    for name, (rows, write, command) in shapes(args.scale).items():
        if args.stage and name not in args.stage:
            continue
        first = None
        for size in SIZES[name]:
            shutil.rmtree(WORK, ignore_errors=True)
            WORK.mkdir(parents=True)
            path = write(WORK / f"input-{size}x.parquet", rows * size)
            started = time.perf_counter()
            (peak,) = peak_rss_mib([command(path)])  # one at a time: nothing else competes for memory
            seconds = time.perf_counter() - started
            first = first or peak
            if name == "precompute":
                precompute[size] = peak
            print(f"| {name:10} | {size:3}× | {rows * size:9,} | {path.stat().st_size / 1e6:8,.0f} | {peak:12,.0f} "
                  f"| {peak / first:4.2f}× | {seconds:7.1f} |", flush=True)
    shutil.rmtree(WORK, ignore_errors=True)
    if precompute:
        print("precompute peak RSS: " + ", ".join(f"{size}× {peak:,.0f} MiB" for size, peak in precompute.items())
              + f"; 16× / 1× = {precompute[16] / precompute[1]:.2f}")


if __name__ == "__main__":
    main()
