"""Start-up before the first row: klpipe's load and load-time checks, cold and with their verdicts remembered, against
loading the model alone.

    python benchmarks/bench_startup.py                 # the E2B-width model and the tiny Llama
    python benchmarks/bench_startup.py --models tiny   # the tiny Llama alone (seconds)

Models: a random Gemma 4 of E2B's text width (bench_width.py's config: hidden 1536, vocabulary 262,144, per-layer
inputs, 10 layers, 6.0 GB in fp32), built at bench time in a temporary directory that is removed after, and the
committed tiny Llama. Each step is its own process, in this order, on a one-row file of the sample rollouts, with
`--device cpu --dtype float32 --prefix-sharing on` (on: the tree's probe runs before the first row, as a sharing run
pays it once):

  load alone       transformers' from_pretrained, klpipe's fingerprint of the weights, the weights read in (the
                   pages a first forward would fault in: from_pretrained maps the file); its own clock, imports out
  klpipe, first    `klpipe precompute`, no verdict remembered: every check runs
  klpipe, second   the same command again: the verdicts remembered, the short probe alone
  main             klpipe before this (BEFORE, exported from git into build/bench/), the same command, once

Each model runs with its files in the page cache (warm: as just written, or read by the step before) and with them
dropped from it before each timed step (read from disk, as a daily job finds them once other work has had the
machine). One cache directory (KLPIPE_CACHE_DIR) per model and page-cache state, fresh: a first load alone hashes the
weights (not timed), so every timed step finds their digests remembered, as a daily run does. klpipe's own start-up
line gives its start-up (from the stage's start to its first row) and its checks apart, against the load alone's own
clock; main prints none, so every step's whole process less its rows' seconds is printed too, against the load
alone's whole process (imports in both). The goals (issue 61): a first run's start-up at most 2x the load alone, a
second run's at most 1.2x. The machine's fp32 matmul peak is measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEFORE = "0e15f61"  # main before the verdicts were remembered and the checks grouped
BEFORE_DIR = ROOT / "build" / "bench" / "klpipe-before-verdicts"
STARTUP = re.compile(r"start-up ([\d,.]+) s \(load ([\d,.]+), checks ([\d,.]+), verdicts (\w+)")
ROWS = re.compile(r"response tokens in ([\d,.]+)s")


def load_alone(model: str) -> None:
    """In a child process: the load alone, its seconds on stdout (imports excluded)."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT))
    from klpipe.model import ModelSpec, loading

    started = time.perf_counter()
    loaded = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    loading.weights_fingerprint(ModelSpec(model), loaded.config)
    loading.read_in(loaded)
    print(f"LOAD {time.perf_counter() - started:.2f}")


def build_e2b(directory: Path) -> Path:
    """bench_width.py's E2B-width model, saved into `directory`."""
    code = ("import sys, torch; sys.path.insert(0, 'benchmarks'); import bench_width; "
            "from transformers import AutoTokenizer, Gemma4ForCausalLM; torch.manual_seed(0); "
            f"Gemma4ForCausalLM(bench_width.config()).save_pretrained({str(directory)!r}); "
            f"AutoTokenizer.from_pretrained('sample_data/tiny-gemma4').save_pretrained({str(directory)!r})")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True)
    return directory


def one_row(path: Path) -> Path:
    import pyarrow.parquet as pq

    pq.write_table(pq.read_table(ROOT / "sample_data" / "rollouts.parquet").slice(0, 1), path)
    return path


def export_before() -> None:
    if not (BEFORE_DIR / "klpipe").is_dir():
        BEFORE_DIR.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", BEFORE, "klpipe"], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(BEFORE_DIR)], input=archive.stdout, check=True)


def step(argv: list[str], env: dict, cwd: Path) -> tuple[float, str | None]:
    """(wall seconds, stdout + stderr) of one child process, run in `cwd` (`python -m` puts it first on sys.path:
    not the checkout, so that PYTHONPATH says which klpipe runs); (its seconds, None) where it failed, said."""
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, check=False)
    if done.returncode != 0:
        print(f"failed ({done.returncode}): {' '.join(argv)}\n{done.stderr.strip()[-2000:]}", flush=True)
        return time.perf_counter() - started, None
    return time.perf_counter() - started, done.stdout + done.stderr


def drop_pages(model: Path) -> None:
    """The model's files out of the page cache (written to disk first): the next process reads them from disk, as a
    daily job does once other work has had the machine."""
    for path in model.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bench(name: str, model: Path, rows: Path, work: Path, pages: str) -> None:
    """One model's steps with its page cache `pages` (warm, or dropped before each timed step)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "KLPIPE_CACHE_DIR": str(work / f"cache-{name}-{pages}")}
    ours = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    main = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(BEFORE_DIR), os.environ.get("PYTHONPATH")]))}
    alone = [sys.executable, str(Path(__file__).resolve()), "--load-alone", str(model)]
    step(alone, ours, work)  # hashes the weights once: every timed step finds their digests remembered

    def timed(argv: list[str], env_: dict) -> tuple[float, str]:
        if pages == "dropped":
            drop_pages(model)
        return step(argv, env_, work)

    alone_wall, said = timed(alone, ours)
    if said is None:
        return
    load = float(re.search(r"LOAD ([\d.]+)", said).group(1))
    print(f"\n== {name}, page cache {pages}: load alone {load:.1f} s (from_pretrained, the fingerprint, the weights "
          f"read in); its whole process {alone_wall:.1f} s", flush=True)
    command = ["-m", "klpipe", "precompute", str(rows), "-m", str(model), "--device", "cpu", "--dtype", "float32",
               "--prefix-sharing", "on", "--progress", "none"]
    for label, env_, run in (("klpipe, first", ours, 1), ("klpipe, second", ours, 2), ("main", main, 0)):
        wall, said = timed([sys.executable, *command, "-o", str(work / f"{name}-{pages}-{run}.parquet")], env_)
        if said is None:
            continue
        before_rows = wall - float(ROWS.search(said).group(1).replace(",", ""))
        whole = f"whole process less its rows {before_rows:6.1f} s = {before_rows / alone_wall:.2f}x the load alone's"
        found = STARTUP.search(said)
        if found is None:  # main: no start-up line
            print(f"{label:15s} {'':54s}{whole}", flush=True)
            continue
        startup, loaded, checks = (float(found.group(k).replace(",", "")) for k in (1, 2, 3))
        print(f"{label:15s} start-up {startup:6.1f} s (load {loaded:.1f}, checks {checks:5.1f}, {found.group(4):7s}) "
              f"{startup / load:6.2f}x; {whole}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=["e2b", "tiny"], default=["e2b", "tiny"])
    parser.add_argument("--page-cache", nargs="+", choices=["warm", "dropped"], default=["warm", "dropped"],
                        help="warm: the model's files in the page cache, as just written; dropped: out of it before "
                             "each timed step, read from disk")
    parser.add_argument("--load-alone", metavar="MODEL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load_alone:
        return load_alone(args.load_alone)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import flops  # benchmarks/flops.py

    export_before()
    import torch

    print(f"{torch.get_num_threads()} threads of {os.cpu_count()} cores; fp32 matmul peak "
          f"{flops.matmul_peak(m=2048, k=1536, n=6144) / 1e9:.0f} GFLOP/s (2,048 x 1,536 x 6,144)", flush=True)
    work = Path(tempfile.mkdtemp(prefix="klpipe-bench-startup-"))
    try:
        rows = one_row(work / "one.parquet")
        for name in args.models:
            model = build_e2b(work / "e2b-width") if name == "e2b" else ROOT / "sample_data" / "tiny-llama"
            for pages in args.page_cache:
                bench(name, model, rows, work, pages)
            if name == "e2b":
                shutil.rmtree(model)  # 6 GB
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
