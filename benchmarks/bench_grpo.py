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
same numbers. Contenders run in --repeat rounds and keep their fastest. Targets, steady state:
(a) >= 3x (c), (a) >= 4x (d).
"""

from __future__ import annotations

import json
import os
import resource
from pathlib import Path

import contenders  # benchmarks/contenders.py: the contenders and their measuring, shared with bench_agent.py
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "bench" / "grpo"
MODEL_DIR = WORK / "llama-8k"
VOCAB = 8192
GROUP_SIZE = 8
CHECKED_ROWS = 16  # rows whose logprobs every contender must agree on


def rollouts_path(groups: int, one_row: bool = False) -> Path:
    return WORK / f"rollouts-{groups}x{GROUP_SIZE}{'-one-row' if one_row else ''}.parquet"


def build_inputs(groups: int, seed: int = 0) -> None:
    """The model and the rollouts, made once and reused (delete build/bench/grpo to rebuild)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    WORK.mkdir(parents=True, exist_ok=True)
    if not (MODEL_DIR / "model.safetensors").exists():
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                             tie_word_embeddings=False)
        LlamaForCausalLM(config).save_pretrained(MODEL_DIR, safe_serialization=True)
        # klpipe loads a tokenizer beside the model; ids are given, so any tokenizer will do.
        AutoTokenizer.from_pretrained(ROOT / "sample_data" / "tiny-llama").save_pretrained(MODEL_DIR)
    path = rollouts_path(groups)
    if not (path.exists() and rollouts_path(groups, one_row=True).exists()):
        rng = np.random.default_rng(seed)
        prompts, responses, ids = [], [], []
        for g in range(groups):
            prompt = rng.integers(0, VOCAB, int(rng.integers(256, 769))).tolist()
            for k in range(GROUP_SIZE):
                length = int(np.exp(rng.uniform(np.log(16), np.log(256))))
                prompts.append(prompt)
                responses.append(rng.integers(0, VOCAB, length).tolist())
                ids.append(f"g{g:03d}-{k}")
        table = pa.table({
            "id": ids,
            "prompt_ids": pa.array(prompts, pa.list_(pa.int32())),
            "response_ids": pa.array(responses, pa.list_(pa.int32())),
        })
        pq.write_table(table.slice(0, 1), rollouts_path(groups, one_row=True))
        pq.write_table(table, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)


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


def child(name: str, path: Path) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("KLPIPE_BENCH_THREADS", os.cpu_count() or 1)))
    result = CONTENDERS[name](path)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    parser = contenders.parser(__doc__, list(CONTENDERS))
    parser.add_argument("--groups", type=int, default=24)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.path)

    build_inputs(args.groups)
    prompts, responses = contenders.load_rows(rollouts_path(args.groups))
    response_tokens = sum(map(len, responses))
    print(f"{len(prompts)} rows in {args.groups} groups of {GROUP_SIZE}: prompts 256-768 tokens, responses 16-256 "
          f"(log-uniform), {response_tokens:,} response tokens; Llama-style 8 x 256, FFN 1024, vocab {VOCAB:,}, "
          f"fp32, CPU, {os.cpu_count()} threads; each contender in its own process, fastest of {args.repeat} "
          f"round(s)", flush=True)
    best = contenders.measure(__file__, args.only or list(CONTENDERS), rollouts_path(args.groups),
                              rollouts_path(args.groups, one_row=True), args.repeat)
    contenders.print_table(best, LABELS, {"floor": 3.0, "trl": 4.0})


if __name__ == "__main__":
    main()
