"""Counts that predict the GPU, measured on CPU: attention pairs executed ÷ needed per layer kind, and pads fed.

    python benchmarks/bench_pairs.py            # GRPO and agent rows of 1–8k tokens, tree off and on (`make bench`)
    python benchmarks/bench_pairs.py --quick    # shorter rows, a smoke test

What a kernel executes is read from each call's own arguments (klpipe/model/attention/pairs.py: every SDPA and cascade
kernel call inside the forward, its query and key lengths, causal or masked); what is needed is counted here from
the rows alone: a query sees itself and every earlier position of its own row, within the window on a sliding
layer. With the tree on, "needed" is what the tree computes once (benchmarks/flops.py's segments: each node's
tokens over its path), so the ratio is of the kernel's work to the tree's own minimum, not to rows run whole.
Pads are the tokens a forward is fed beyond each row's (or node's) own: ForwardStats.padded − fed.

Models: random, tiny in width (the counts do not depend on it), in two layouts: Gemma 4 E2B's layer pattern (4
sliding layers of window 512 to one full layer of head size 512, KV-shared layers at the end) and a Llama (full
attention only). Rows: GRPO groups of 8 (prompts 1–6k tokens, responses 16–2k) and agent trajectories (a
1.5k-token system prompt, tasks, turns, rows of 2–8k).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import flops  # benchmarks/flops.py: causal_pairs and the tree's segments
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "bench" / "pairs"
VOCAB = 2048
WINDOW = 512


def build_models() -> dict[str, Path]:
    """Two random tiny models saved once (delete build/bench/pairs to rebuild)."""
    import torch
    from transformers import AutoTokenizer, Gemma4ForCausalLM, Gemma4TextConfig, LlamaConfig, LlamaForCausalLM

    configs = {
        "gemma4-pattern": (Gemma4ForCausalLM, Gemma4TextConfig(
            vocab_size=VOCAB, hidden_size=64, hidden_size_per_layer_input=8, intermediate_size=128,
            num_hidden_layers=10, layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32, global_head_dim=512, num_kv_shared_layers=4,
            final_logit_softcapping=30.0, sliding_window=WINDOW, max_position_embeddings=16384,
            tie_word_embeddings=True)),
        "llama": (LlamaForCausalLM, LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=16384, tie_word_embeddings=False)),
    }
    paths = {}
    for name, (cls, config) in configs.items():
        path = WORK / name
        paths[name] = path
        if (path / "config.json").exists():
            continue
        torch.manual_seed(0)
        cls(config).eval().save_pretrained(path, safe_serialization=True)
        AutoTokenizer.from_pretrained(ROOT / "sample_data" / "tiny-llama").save_pretrained(path)
    return paths


def grpo_rows(rng, quick: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    rows = []
    for _ in range(2):
        prompt = rng.integers(0, VOCAB, int(rng.integers(1000, 1500 if quick else 6000)))
        for _ in range(8):
            length = int(np.exp(rng.uniform(np.log(16), np.log(256 if quick else 2048))))
            rows.append((prompt, rng.integers(0, VOCAB, length)))
    return rows


def agent_rows(rng, quick: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    system = rng.integers(0, VOCAB, 1500)
    rows = []
    for _ in range(2):
        task = np.concatenate([system, rng.integers(0, VOCAB, int(rng.integers(100, 400)))])
        for _ in range(2):  # trajectories of a task
            history = task
            for _ in range(2 if quick else 4):  # turns, a row each
                response = rng.integers(0, VOCAB, int(rng.integers(64, 600)))
                rows.append((history, response))
                history = np.concatenate([history, response, rng.integers(0, VOCAB, int(rng.integers(64, 800)))])
    return rows


def needed_pairs(config, segments: list[flops.Segment]) -> dict[str, int]:
    """Pairs per layer kind that `segments` need, as flops.ModelFlops counts them (a skippable layer runs a
    segment that needs only its last position on that position alone)."""
    text = config.get_text_config()
    types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    shared = getattr(text, "num_kv_shared_layers", 0) or 0
    first_shared = len(types) - shared
    total = {"full": 0, "sliding": 0}
    for index, kind in enumerate(types):
        window = text.sliding_window if kind == "sliding_attention" else None
        for s in segments:
            if index >= first_shared and s.only_last:
                total["sliding" if window else "full"] += flops.causal_pairs(s.context + s.length - 1, 1, window)
            else:
                total["sliding" if window else "full"] += flops.causal_pairs(s.context, s.length, window)
    return {kind: int(value) for kind, value in total.items() if value}


def measure(path: Path, rows, sharing: str) -> dict:
    from klpipe.model import ModelSpec, ReferenceModel
    from klpipe.model.attention.pairs import PairCount
    from klpipe.precompute.logprobs import ForwardStats, packs_passes, plan_stats, run_plan
    from klpipe.precompute.sharing import Sharing

    reference = ReferenceModel.load(ModelSpec(str(path), dtype="float32", device="cpu"))
    lines = []
    plan = Sharing(reference, sharing, 1 << 14, lines.append).plan(rows, 16384, None)
    stats = ForwardStats()
    plan_stats(plan, stats, packs_passes(reference))
    started = time.perf_counter()
    with PairCount(reference.model) as count:
        run_plan(reference, plan, rows, 1.0)
    seconds = time.perf_counter() - started
    prompts, responses = [p for p, _ in rows], [r for _, r in rows]
    skips = reference.prefill_skips_layers
    segments = flops.tree(prompts, responses, sharing=sharing, skips_layers=skips) if plan.tree is not None else \
        flops.per_row(prompts, responses)
    return {"executed": dict(count.executed), "needed": needed_pairs(reference.model.config, segments),
            "fed": stats.fed_tokens, "padded": stats.padded_tokens, "tree_rows": stats.tree_rows,
            "rows": "packed" if reference.packed else f"padded: {reference.padded_why}", "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter rows: a smoke test")
    parser.add_argument("--model", nargs="+", choices=["gemma4-pattern", "llama"], default=["gemma4-pattern", "llama"])
    parser.add_argument("--shape", nargs="+", choices=["GRPO", "agent"], default=["GRPO", "agent"])
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    paths = {name: path for name, path in build_models().items() if name in args.model}
    shapes = {"GRPO": grpo_rows(np.random.default_rng(0), args.quick),
              "agent": agent_rows(np.random.default_rng(1), args.quick)}
    shapes = {name: rows for name, rows in shapes.items() if name in args.shape}
    from transformers import AutoConfig

    print("| model | rows | sharing | rows run whole | kind | pairs executed ÷ needed | pads ÷ tokens fed | s |")
    print("|---|---|---|---|---|---|---|---|")
    for model, path in paths.items():
        config = AutoConfig.from_pretrained(path)
        for shape, rows in shapes.items():
            lengths = [len(p) + len(r) - 1 for p, r in rows]
            for sharing in ("off", "auto"):
                got = measure(path, rows, sharing)
                pads = (got["padded"] - got["fed"]) / got["padded"] if got["padded"] else 0.0
                label = f"{len(rows)} rows of {min(lengths):,}–{max(lengths):,}"
                for kind, needed in sorted(got["needed"].items()):
                    ratio = got["executed"].get(kind, 0) / needed
                    print(f"| {model} | {shape}: {label} | {sharing} | {got['rows']} | {kind} | {ratio:.3f} | "
                          f"{pads:.3f} | {got['seconds']:.1f} |", flush=True)
                if got["executed"].get("other"):
                    print(f"  (and {got['executed']['other']:,} pairs outside any attention module)")
        del config


if __name__ == "__main__":
    main()
