"""Benchmark the prefix tree on agent-shaped rollouts: a long system prompt in every row, multi-turn histories.

    python benchmarks/bench_agent.py                    # both shapes (what `make bench` runs)
    python benchmarks/bench_agent.py --shape system     # one shape
    python benchmarks/bench_agent.py --only klpipe off  # some contenders

Shapes (random ids, fixed seeds):
  system      a 1,000-token system prompt in every row, then a task of 64-256 tokens, G = 8 responses
              of 16-256 tokens (log-uniform) per task
  multi-turn  a 500-token system prompt; each task (100-200 tokens) has 4 trajectories of 4 turns,
              stored a row per turn: turn k's prompt is turn k-1's prompt + response + a tool result
              (responses and tool results of 32-128 tokens)
Model: a random Llama-style model (8 layers x 256, FFN 1024, vocabulary 8,192; Gemma 4 E2B's
body-to-head FLOPs ratio), fp32 on CPU, as in bench_grpo.py.

Contenders, each in its own process on the same file:
  (a) klpipe       `klpipe.precompute` end to end, --prefix-sharing auto (the default)
  (b) klpipe main  klpipe as it was before the prefix tree (commit BEFORE_TREE, exported from git into
                   build/bench/klpipe-before-tree and imported from there): identical prompts shared
  (c) off          klpipe --prefix-sharing off: every row runs whole
  (d) floor        the per-row minimal-work floor: each row alone, no padding, the head on response
                   positions only
  (e) TRL          TRL's GRPO reference pass (trl 1.16, add_fused_lm_head, batches of 8 in input order;
                   `pip install trl`, for the benchmark only)

Each contender also runs on a one-row file, and its steady-state time is its whole time less that
start-up (see contenders.py); both are printed, and the ratios are of steady-state times. Logprobs
of the first rows are checked across contenders.
Then the FLOPs each contender's method needs (linear, attention over needed pairs, head; flops.py),
its GFLOP/s against the machine's fp32 matmul peak, and klpipe's speed ratios beside the FLOP ratios.
Targets, steady state: (a) >= 8x (c) on `system`, (a) >= 4x (c) on `multi-turn`; (a) / (c) at least
90% of the FLOP ratio.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import contenders  # benchmarks/contenders.py: the contenders and their measuring, shared with bench_grpo.py
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "bench" / "agent"
MODEL_DIR = WORK / "llama-8k"
BEFORE_TREE = "2e43c16"  # the last commit before the prefix tree: whole prompts shared, nothing more
BEFORE_DIR = ROOT / "build" / "bench" / "klpipe-before-tree"
VOCAB = contenders.VOCAB
CHECKED_ROWS = 12


# -- the data ---------------------------------------------------------------------------------------


def system_shape(rng) -> list[tuple[list[int], list[int]]]:
    system = rng.integers(0, VOCAB, 1000).tolist()
    rows = []
    for _ in range(12):
        prompt = system + rng.integers(0, VOCAB, int(rng.integers(64, 257))).tolist()
        for _ in range(8):
            rows.append((prompt, rng.integers(0, VOCAB, int(np.exp(rng.uniform(np.log(16), np.log(256))))).tolist()))
    return rows


def multi_turn_shape(rng) -> list[tuple[list[int], list[int]]]:
    system = rng.integers(0, VOCAB, 500).tolist()
    rows = []
    for _ in range(6):
        task = system + rng.integers(0, VOCAB, int(rng.integers(100, 201))).tolist()
        for _ in range(4):  # trajectories of one task
            history = task
            for _ in range(4):  # turns, a row each
                response = rng.integers(0, VOCAB, int(rng.integers(32, 129))).tolist()
                rows.append((history, response))
                history = history + response + rng.integers(0, VOCAB, int(rng.integers(32, 129))).tolist()
    return rows


SHAPES = {"system": system_shape, "multi-turn": multi_turn_shape}


def data_path(shape: str, one_row: bool = False) -> Path:
    return WORK / f"{shape}{'-one-row' if one_row else ''}.parquet"


def build_inputs(shapes: list[str]) -> None:
    """The model, the rollouts and klpipe before the tree, made once (delete build/bench to rebuild)."""
    WORK.mkdir(parents=True, exist_ok=True)
    contenders.build_model(MODEL_DIR, max_positions=4096)
    for shape in shapes:
        if not data_path(shape).exists():
            rows = SHAPES[shape](np.random.default_rng(1))
            ids = [f"r{i}" for i in range(len(rows))]
            contenders.write_rollouts(data_path(shape), data_path(shape, one_row=True), ids, [p for p, _ in rows],
                                      [r for _, r in rows])
    if not (BEFORE_DIR / "klpipe").is_dir():
        BEFORE_DIR.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", BEFORE_TREE, "klpipe"], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(BEFORE_DIR)], input=archive.stdout, check=True)


# -- the contenders (each runs in a child process) --------------------------------------------------


CONTENDERS = {
    "klpipe": ("(a) klpipe", lambda path: contenders.run_klpipe(MODEL_DIR, path, "auto", CHECKED_ROWS)),
    "main": ("(b) klpipe before the tree", lambda path: contenders.run_klpipe(MODEL_DIR, path, "auto", CHECKED_ROWS)),
    "off": ("(c) klpipe --prefix-sharing off",
            lambda path: contenders.run_klpipe(MODEL_DIR, path, "off", CHECKED_ROWS)),
    "floor": ("(d) per-row minimal-work floor", lambda path: contenders.run_floor(MODEL_DIR, path, CHECKED_ROWS)),
    "trl": ("(e) TRL GRPO reference pass", lambda path: contenders.run_trl(MODEL_DIR, path, CHECKED_ROWS)),
}


def bench_shape(shape: str, names: list[str], repeat: int) -> dict:
    prompts, responses = contenders.load_rows(data_path(shape))
    per_row = sum(len(p) + len(r) - 1 for p, r in zip(prompts, responses, strict=True))
    print(f"\n== {shape}: {len(prompts)} rows, {sum(map(len, responses)):,} response tokens, "
          f"{per_row:,} tokens fed running each row whole", flush=True)

    def env_for(name):
        # klpipe before the tree is imported ahead of the installed one.
        if name != "main":
            return None
        return {"PYTHONPATH": os.pathsep.join([str(BEFORE_DIR), os.environ.get("PYTHONPATH", "")])}

    best = contenders.measure(__file__, names, data_path(shape), data_path(shape, one_row=True), repeat, env_for)
    if "main" in best:
        assert Path(best["main"]["klpipe"]).parent == BEFORE_DIR / "klpipe", best["main"]["klpipe"]
    targets = {"off": {"system": 8.0, "multi-turn": 4.0}[shape]}
    labels = {name: label for name, (label, _) in CONTENDERS.items()}
    contenders.print_table(best, labels, targets)
    contenders.print_flops(best, labels, MODEL_DIR, prompts, responses, shape)
    return best


def main() -> None:
    parser = contenders.parser(__doc__, list(CONTENDERS))
    parser.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    args = parser.parse_args()
    if args.child:
        return contenders.child(CONTENDERS[args.child][1], args.path)
    build_inputs(args.shape)
    print(f"Llama-style 8 x 256, FFN 1024, vocab {VOCAB:,}, fp32, CPU, {contenders.threads()} threads of "
          f"{os.cpu_count()} cores; each contender "
          f"in its own process, fastest of {args.repeat} round(s)")
    for shape in args.shape:
        bench_shape(shape, args.only or list(CONTENDERS), args.repeat)


if __name__ == "__main__":
    main()
