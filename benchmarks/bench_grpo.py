"""Benchmark prefix sharing on GRPO-shaped rollouts: groups of 8 rows that share one prompt.

    python benchmarks/bench_grpo.py                  # 24 groups x 8 rows (what `make bench` runs)
    python benchmarks/bench_grpo.py --groups 8       # a quicker look

Data: prompts of 256-768 tokens (uniform), responses of 16-256 tokens (log-uniform), random ids.
Model: a random Llama-style model (8 layers x 256, FFN 1024, vocabulary 8,192), fp32 on CPU, whose
body-to-head FLOPs ratio (~3.8:1) is close to Gemma 4 E2B's. Each contender runs in its own process,
one after the other, on the same file, and again on a one-row file: its steady-state time is the
whole less that start-up (see contenders.py). Both are printed; ratios are of steady-state times.

  (a) klpipe         `klpipe.precompute` end to end, --prefix-sharing auto (the default)
  (b) klpipe off     the same with --prefix-sharing off: every row runs its whole prompt
  (c) floor          the per-row minimal-work floor: each row alone (no padding), the model body over
                     prompt + response, the LM head on response positions only
  (d) TRL            TRL's GRPO reference pass (trl 1.16 GRPOTrainer._get_per_token_logps_and_entropies
                     with trl.trainer.utils.add_fused_lm_head): prompts left-padded and completions
                     right-padded over the whole generation batch, forwarded in batches of 8 in
                     input order. Needs `pip install trl` (benchmark only; never a klpipe dependency).

Every contender's logprobs for the first rows are checked against (c)'s, so the times compare the
same numbers. Contenders run in --repeat rounds and keep their fastest. Then the FLOPs each method
needs (flops.py), GFLOP/s against the machine's fp32 matmul peak, and klpipe's speed ratios beside
the FLOP ratios. Targets, steady state: (a) >= 3x (c), (a) >= 4x (d); (a) / (b) at least 90% of the
FLOP ratio.
"""

from __future__ import annotations

import os
from pathlib import Path

import contenders  # benchmarks/contenders.py: the contenders and their measuring, shared with bench_agent.py
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "bench" / "grpo"
MODEL_DIR = WORK / "llama-8k"
VOCAB = contenders.VOCAB
GROUP_SIZE = 8
CHECKED_ROWS = 16  # rows whose logprobs every contender must agree on


def rollouts_path(groups: int, one_row: bool = False) -> Path:
    return WORK / f"rollouts-{groups}x{GROUP_SIZE}{'-one-row' if one_row else ''}.parquet"


def build_inputs(groups: int, seed: int = 0) -> None:
    """The model and the rollouts, made once and reused (delete build/bench/grpo to rebuild)."""
    WORK.mkdir(parents=True, exist_ok=True)
    contenders.build_model(MODEL_DIR, max_positions=2048, seed=seed)
    if rollouts_path(groups).exists():
        return
    rng = np.random.default_rng(seed)
    prompts, responses, ids = [], [], []
    for g in range(groups):
        prompt = rng.integers(0, VOCAB, int(rng.integers(256, 769))).tolist()
        for k in range(GROUP_SIZE):
            length = int(np.exp(rng.uniform(np.log(16), np.log(256))))
            prompts.append(prompt)
            # From 1: a response ending in id 0, the tokenizer's pad, is refused unless a mask says it was sampled.
            responses.append(rng.integers(1, VOCAB, length).tolist())
            ids.append(f"g{g:03d}-{k}")
    contenders.write_rollouts(rollouts_path(groups), rollouts_path(groups, one_row=True), ids, prompts, responses)


CONTENDERS = {
    "klpipe": lambda path: contenders.run_klpipe(MODEL_DIR, path, "auto", CHECKED_ROWS),
    "klpipe-off": lambda path: contenders.run_klpipe(MODEL_DIR, path, "off", CHECKED_ROWS),
    "floor": lambda path: contenders.run_floor(MODEL_DIR, path, CHECKED_ROWS),
    "trl": lambda path: contenders.run_trl(MODEL_DIR, path, CHECKED_ROWS),
}
LABELS = {
    "klpipe": "(a) klpipe",
    "klpipe-off": "(b) klpipe --prefix-sharing off",
    "floor": "(c) per-row minimal-work floor",
    "trl": "(d) TRL GRPO reference pass",
}


def main() -> None:
    parser = contenders.parser(__doc__, list(CONTENDERS))
    parser.add_argument("--groups", type=int, default=24)
    args = parser.parse_args()
    if args.child:
        return contenders.child(CONTENDERS[args.child], args.path)

    build_inputs(args.groups)
    prompts, responses = contenders.load_rows(rollouts_path(args.groups))
    response_tokens = sum(map(len, responses))
    print(f"{len(prompts)} rows in {args.groups} groups of {GROUP_SIZE}: prompts 256-768 tokens, responses 16-256 "
          f"(log-uniform), {response_tokens:,} response tokens; Llama-style 8 x 256, FFN 1024, vocab {VOCAB:,}, "
          f"fp32, CPU, {contenders.threads()} threads of {os.cpu_count()} cores; each contender in its own process, "
          f"fastest of {args.repeat} round(s)", flush=True)
    best = contenders.measure(__file__, args.only or list(CONTENDERS), rollouts_path(args.groups),
                              rollouts_path(args.groups, one_row=True), args.repeat)
    contenders.print_table(best, LABELS, {"floor": 3.0, "trl": 4.0})
    contenders.print_flops(best, LABELS, MODEL_DIR, prompts, responses, f"GRPO, {args.groups} prompts x {GROUP_SIZE}")


if __name__ == "__main__":
    main()
