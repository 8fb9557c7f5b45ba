"""Benchmark `klpipe score` against the original controller's Python loop and a bare pyarrow read+write.

    python benchmarks/bench_score.py            # 200k rows × ~200 tokens, ~1000-row steps
    python benchmarks/bench_score.py --rows 20000
    python benchmarks/bench_score.py --mismatch --skip-original   # the cost of the sampler-against-trainer section

The cache is generated once under build/bench/ and reused. Every contender reads the same file and
writes parquet with pyarrow's default settings (snappy, dictionary on), so the ratios compare work,
not codecs. The original controller's loop writes the same four scored columns as klpipe; the bare baselines copy
the input columns only, and unlike klpipe they neither fsync nor rename atomically.
Contenders run interleaved and the best of --repeat runs counts, because the machine is shared.
Targets: original/klpipe ≥ 2×, klpipe/bare ≤ 1.5×.

`--mismatch` scores a second cache that also holds the sampler's logprobs (`sampler_logprobs`: the trainer's with
the noise of a bf16 engine) and 32-token prompts shared by groups of 8 rows, so `klpipe score` writes the whole
mismatch section (figures, breakdowns, the correction sweep with its GRPO groups, the diagnosis, four per-row
columns) against a bare read+write of that same file.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the original controller's loader of the test suite: one way to import it

from klpipe.cache import POLICY_LOGPROBS, PROMPT_IDS, REF_LOGPROBS, REWARD, SAMPLER_LOGPROBS, STEP
from klpipe.score import ScoreConfig, score
from tests.helpers import CACHE_SCHEMA, load_seed, seed_missing

BUILD = ROOT / "build" / "bench"

ROWS_PER_STEP = 1000
MEAN_TOKENS = 200
ROWS_PER_WRITE = 20_000  # generation chunk, and so the cache's row-group size


def make_cache(rows: int) -> Path:
    """A synthetic cache: list<float32> logprobs of 150–250 tokens, float64 reward, int64 step, string id."""
    path = BUILD / f"cache-{rows}.parquet"
    if path.exists():
        return path
    BUILD.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    schema = CACHE_SCHEMA
    tmp = path.with_suffix(".tmp")
    with pq.ParquetWriter(tmp, schema) as writer:
        for start in range(0, rows, ROWS_PER_WRITE):
            n = min(ROWS_PER_WRITE, rows - start)
            lengths = rng.integers(MEAN_TOKENS - 50, MEAN_TOKENS + 51, n)
            offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
            policy = (-rng.exponential(0.8, offsets[-1])).astype(np.float32)
            ref = (policy - rng.normal(0.01, 0.15, offsets[-1])).astype(np.float32)
            index = np.arange(start, start + n)
            writer.write_table(
                pa.table(
                    [
                        pa.array([f"r{i:07d}" for i in index]),
                        pa.array(index // ROWS_PER_STEP),
                        pa.ListArray.from_arrays(pa.array(offsets), pa.array(policy)),
                        pa.ListArray.from_arrays(pa.array(offsets), pa.array(ref)),
                        pa.array(rng.normal(0, 1, n)),
                    ],
                    schema=schema,
                )
            )
    tmp.rename(path)
    return path


def make_mismatch_cache(rows: int) -> Path:
    """make_cache's rows plus sampler_logprobs (policy with bf16-sized noise) and prompt_ids (groups of 8)."""
    path = BUILD / f"cache-mismatch-{rows}.parquet"
    if path.exists():
        return path
    plain = pq.ParquetFile(make_cache(rows))
    rng = np.random.default_rng(1)
    tmp = path.with_suffix(".tmp")
    writer = None
    start = 0
    for table in (plain.read_row_group(g) for g in range(plain.num_row_groups)):
        policy = table.column(POLICY_LOGPROBS).combine_chunks()
        values = policy.values.to_numpy()
        sampler = (values + rng.normal(0, 2**-9, len(values)) * np.abs(values)).astype(np.float32)
        n = table.num_rows
        groups = (np.arange(start, start + n) // 8).astype(np.int32)
        prompt = np.repeat(groups, 32)
        table = table.append_column(SAMPLER_LOGPROBS, pa.ListArray.from_arrays(policy.offsets, pa.array(sampler)))
        table = table.append_column(PROMPT_IDS, pa.ListArray.from_arrays(
            pa.array(np.arange(0, 32 * n + 1, 32, dtype=np.int32)), pa.array(prompt)))
        if writer is None:
            writer = pq.ParquetWriter(tmp, table.schema)
        writer.write_table(table)
        start += n
    writer.close()
    tmp.rename(path)
    return path


def run_klpipe(cache: Path, out: Path) -> None:
    score(ScoreConfig(inputs=[cache], output=out))


def run_klpipe_cli(cache: Path, out: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "klpipe", "score", str(cache), "--output", str(out)],
        check=True,
        stderr=subprocess.DEVNULL,
    )


def run_seed(seed, cache: Path, out: Path) -> None:
    """The original controller's own loop: Python lists per step through get_batch_penalty_from_logprobs."""
    controller = seed.KLControllerBase(seed.KLConfig(reference_model_name="bench"))
    table = pq.read_table(cache)
    steps = table.column(STEP).to_pylist()
    rewards = table.column(REWARD).to_pylist()
    kls, coeffs, penalties = [], [], []
    start = 0
    while start < len(steps):
        end = start
        while end < len(steps) and steps[end] == steps[start]:
            end += 1
        policy = table.column(POLICY_LOGPROBS).slice(start, end - start).to_pylist()
        ref = table.column(REF_LOGPROBS).slice(start, end - start).to_pylist()
        coeff = controller.kl_coeff
        step_penalties, _ = controller.get_batch_penalty_from_logprobs(policy, ref)
        kls += controller._kl_history[-(end - start) :]  # the original controller keeps every row's KL there
        coeffs += [coeff] * (end - start)
        penalties += step_penalties
        start = end
    adjusted = [r - p for r, p in zip(rewards, penalties, strict=True)]
    for name, values in (("kl", kls), ("kl_coeff", coeffs), ("kl_penalty", penalties), ("adjusted_reward", adjusted)):
        table = table.append_column(name, pa.array(values, pa.float64()))
    pq.write_table(table, out)


def run_bare(cache: Path, out: Path) -> None:
    pq.write_table(pq.read_table(cache), out)


def run_bare_fresh(cache: Path, out: Path) -> None:
    """The bare read+write in a new process: the fair baseline for the CLI row (same start-up, cold memory)."""
    code = "import sys, pyarrow.parquet as pq; pq.write_table(pq.read_table(sys.argv[1]), sys.argv[2])"
    subprocess.run([sys.executable, "-c", code, str(cache), str(out)], check=True)


def run_bare_streamed(cache: Path, out: Path) -> None:
    reader = pq.ParquetFile(cache)
    with pq.ParquetWriter(out, reader.schema_arrow) as writer:
        for batch in reader.iter_batches(batch_size=10_000):
            writer.write_batch(batch)


def print_gaps(ours_path: Path, theirs_path: Path) -> None:
    """The largest difference between klpipe's scored columns and the original controller's."""
    columns = ["kl", "kl_coeff", "kl_penalty", "adjusted_reward"]
    ours = pq.read_table(ours_path, columns=columns)
    theirs = pq.read_table(theirs_path, columns=columns)
    gaps = {c: float(np.max(np.abs(ours.column(c).to_numpy() - theirs.column(c).to_numpy()))) for c in columns}
    print("klpipe vs the original controller's output, max |difference|: "
          + ", ".join(f"{c} {g:.1e}" for c, g in gaps.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3, help="runs per contender, interleaved; the best counts")
    parser.add_argument("--skip-original", action="store_true", help="skip the original controller's slow loop")
    parser.add_argument("--mismatch", action="store_true",
                        help="also score a cache with the sampler's logprobs, against a bare read+write of it")
    args = parser.parse_args()

    cache = make_cache(args.rows)
    tokens = pq.ParquetFile(cache).metadata.num_rows * MEAN_TOKENS
    print(
        f"cache: {cache.relative_to(ROOT)} ({cache.stat().st_size / 1e6:.0f} MB, {args.rows:,} rows, "
        f"~{tokens / 1e6:.0f}M tokens per logprob column); best of {args.repeat}, interleaved"
    )
    out = BUILD / "out"
    out.mkdir(exist_ok=True)
    if not args.skip_original and seed_missing():
        print(f"{seed_missing()}: the original controller's loop is left out")
        args.skip_original = True
    seed = None if args.skip_original else load_seed()

    contenders = {
        "bare pyarrow: read_table + write_table": run_bare,
        "bare pyarrow: iter_batches + ParquetWriter": run_bare_streamed,
        "klpipe score (library call)": run_klpipe,
        "bare pyarrow: read_table + write_table, fresh process": run_bare_fresh,
        "klpipe score (CLI, fresh process)": run_klpipe_cli,
    }
    if not args.skip_original:
        contenders["original Python loop"] = lambda c, o: run_seed(seed, c, o)
    if args.mismatch:
        mismatch = make_mismatch_cache(args.rows)
        print(f"mismatch cache: {mismatch.relative_to(ROOT)} ({mismatch.stat().st_size / 1e6:.0f} MB)")
        contenders["bare pyarrow: read_table + write_table, with sampler"] = lambda c, o: run_bare(mismatch, o)
        contenders["klpipe score with the mismatch section"] = lambda c, o: run_klpipe(mismatch, o)
    outputs = {name: out / f"{i}.parquet" for i, name in enumerate(contenders)}
    run_bare(cache, out / "warmup.parquet")  # page cache and lazy imports, for everyone
    runs: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.repeat):  # interleaved, so a noisy moment hurts every contender alike
        for name, fn in contenders.items():
            started = time.perf_counter()
            fn(cache, outputs[name])
            runs[name].append(time.perf_counter() - started)
    best = {name: min(values) for name, values in runs.items()}

    if not args.skip_original:
        print_gaps(outputs["klpipe score (library call)"], outputs["original Python loop"])

    library = best["klpipe score (library call)"]
    bare = best["bare pyarrow: read_table + write_table"]
    print()
    print(f"| {'contender':54} | {'seconds':>7} | {'rows/s':>9} | {'s per M rows':>12} | {'vs klpipe':>9} |")
    print(f"|{'-' * 56}|{'-' * 9}|{'-' * 11}|{'-' * 14}|{'-' * 11}|")
    for name, seconds in best.items():
        print(
            f"| {name:54} | {seconds:7.2f} | {args.rows / seconds:9,.0f} | {seconds / args.rows * 1e6:12.2f} "
            f"| {seconds / library:8.2f}× |"
        )
    print()
    cli, bare_fresh = (
        best["klpipe score (CLI, fresh process)"],
        best["bare pyarrow: read_table + write_table, fresh process"],
    )
    print(f"klpipe / bare pyarrow read+write: {library / bare:.2f}×  (target ≤ 1.5×; in-process, warm)")
    print(f"klpipe CLI / bare, both fresh:    {cli / bare_fresh:.2f}×  (start-up and cold memory on both sides)")
    if args.mismatch:
        with_section = best["klpipe score with the mismatch section"]
        bare_sampler = best["bare pyarrow: read_table + write_table, with sampler"]
        print(f"klpipe with the mismatch section / bare read+write of the same file: {with_section / bare_sampler:.2f}×"
              "  (target ≤ 1.5×)")
    if not args.skip_original:
        print(f"original loop / klpipe:           {best['original Python loop'] / library:.2f}×  (target ≥ 2×)")
    print(
        "all runs (s): "
        + "; ".join(f"{name}: {', '.join(f'{v:.2f}' for v in values)}" for name, values in runs.items())
    )


if __name__ == "__main__":
    main()
