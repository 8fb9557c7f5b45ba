"""The prefix tree against `--prefix-sharing off` at Gemma 4 E2B's width, on CPU: the share of the FLOP ratio reached.

    python benchmarks/bench_width.py                 # 2 GRPO groups of 8, prompts ~1,900 tokens
    python benchmarks/bench_width.py --groups 1      # a quicker look

Model: a random Gemma 4 of E2B's text width (hidden 1536, vocabulary 262,144, 8 query heads of 256 and one KV
head, head size 512 on the full layers, per-layer inputs of 256, the double-wide MLP of the KV-shared layers, a
sliding window of 512, final-logit softcap 30), 10 layers in E2B's pattern (4 sliding to 1 full; the last 5
KV-shared), fp32, on CPU: about 4.5 GB of weights, built once under build/bench/width. Rows: GRPO groups of 8
sharing a prompt of 1,800–2,000 tokens, responses of 16–256 tokens (log-uniform), random ids.

Both modes run in one process on one loaded model, after a warm-up, each timed over its whole chunk (klpipe's own
plan, run_plan): no start-up in either. Then the FLOPs each needs (benchmarks/flops.py, the layers counted on a
meta-device copy: linear per fed token, attention per needed pair within windows, KV-shared layers on a node's
last position alone where the tree skips them, the head per scored token), its GFLOP/s against the machine's fp32
matmul peak, and the tree's speed ratio to `off` beside the FLOP ratio: the share of the FLOP limit it reaches.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import flops  # benchmarks/flops.py
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "bench" / "width"
MODEL_DIR = WORK / "gemma4-e2b-width-10"
VOCAB = 262_144
GROUP_SIZE = 8


def config(layers: int = 10, kv_shared: int = 5):
    """E2B's text width, `layers` layers in its pattern (4 sliding to 1 full), the last `kv_shared` sharing KV
    (bench_compile.py builds fewer)."""
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=1536, hidden_size_per_layer_input=256, intermediate_size=4 * 1536,
        num_hidden_layers=layers, layer_types=((["sliding_attention"] * 4 + ["full_attention"]) * layers)[:layers],
        num_attention_heads=8, num_key_value_heads=1, num_kv_shared_layers=kv_shared, use_double_wide_mlp=True,
        final_logit_softcapping=30.0, sliding_window=512, tie_word_embeddings=True,
        rope_parameters={
            "full_attention": {"rope_theta": 1_000_000.0, "rope_type": "proportional", "partial_rotary_factor": 0.25},
            "sliding_attention": {"rope_theta": 10_000.0, "rope_type": "default"},
        },
        max_position_embeddings=8192)


def build_model() -> None:
    import torch
    from transformers import AutoTokenizer, Gemma4ForCausalLM

    if (MODEL_DIR / "config.json").exists():
        return
    started = time.perf_counter()
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(config()).eval()
    model.save_pretrained(MODEL_DIR, safe_serialization=True)
    AutoTokenizer.from_pretrained(ROOT / "sample_data" / "tiny-gemma4").save_pretrained(MODEL_DIR)
    print(f"built the model in {time.perf_counter() - started:.0f}s", flush=True)


def rows(groups: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(groups):
        prompt = rng.integers(0, VOCAB, int(rng.integers(1800, 2001)))
        for _ in range(GROUP_SIZE):
            length = int(np.exp(rng.uniform(np.log(16), np.log(256))))
            out.append((prompt, rng.integers(0, VOCAB, length)))
    return out


def model_flops(layers: int = 10, kv_shared: int = 5) -> flops.ModelFlops:
    """Per layer: 2 × its linear weights per token, 4 × its query width per pair, its window, KV-shared or not;
    the per-layer input projections outside the layers per token; the head per scored token."""
    import torch
    from transformers import Gemma4ForCausalLM

    with torch.device("meta"):
        model = Gemma4ForCausalLM(config(layers, kv_shared))

    def linear(module) -> int:
        return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))

    c = model.config
    first_shared = c.num_hidden_layers - c.num_kv_shared_layers
    layers = [flops.Layer(2.0 * linear(layer), 4.0 * layer.self_attn.o_proj.in_features,
                          c.sliding_window if c.layer_types[i] == "sliding_attention" else None,
                          skippable=i >= first_shared) for i, layer in enumerate(model.model.layers)]
    outside = linear(model.model) - sum(linear(layer) for layer in model.model.layers)
    layers.append(flops.Layer(2.0 * outside, 0.0))
    return flops.ModelFlops(tuple(layers), 2.0 * model.lm_head.weight.numel())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=2)
    args = parser.parse_args()
    sys.path.append(str(ROOT))  # after PYTHONPATH: a klpipe exported from another commit runs instead, if given
    build_model()
    import torch

    from klpipe.model import ModelSpec, ReferenceModel
    from klpipe.precompute.logprobs import ForwardStats, packs_passes, plan_stats, run_plan
    from klpipe.precompute.sharing import Sharing

    chunk = rows(args.groups)
    prompts, responses = [p for p, _ in chunk], [r for _, r in chunk]
    reference = ReferenceModel.load(ModelSpec(str(MODEL_DIR), dtype="float32", device="cpu"))
    print(f"Gemma 4 of E2B's width, 10 layers, fp32, CPU, {torch.get_num_threads()} threads; rows run whole: "
          f"{'packed' if reference.packed else 'padded: ' + str(reference.padded_why)}; "
          f"{len(chunk)} rows, {sum(map(len, responses)):,} response tokens", flush=True)
    shape = {"m": 2048, "k": 1536, "n": 6144}  # the MLP's up-projection on a 2,048-token pass
    peak_before = flops.matmul_peak(**shape)
    cost = model_flops()
    results = {}
    for sharing in ("auto", "off"):
        plan = Sharing(reference, sharing, 1 << 14, print).plan(chunk, 65536, None)
        stats = ForwardStats()
        plan_stats(plan, stats, packs_passes(reference))
        run_plan(reference, Sharing(reference, sharing, 1 << 14, print).plan(rows(1, seed=9)[:2], 65536, None),
                 rows(1, seed=9)[:2], 1.0)  # a warm-up on two other rows
        started = time.perf_counter()
        run_plan(reference, plan, chunk, 1.0)
        seconds = time.perf_counter() - started
        segments = flops.tree(prompts, responses, sharing=sharing, skips_layers=reference.prefill_skips_layers) \
            if sharing != "off" else flops.per_row(prompts, responses)
        needed = cost.method(segments, sum(map(len, responses)))
        results[sharing] = (seconds, needed.total, stats)
        print(f"{sharing:>4}: {seconds:7.1f} s, {stats.fed_tokens:,} tokens fed ({stats.padded_tokens:,} with pads), "
              f"{needed.total / 1e12:.2f} TFLOP needed, {needed.total / seconds / 1e9:.1f} GFLOP/s", flush=True)
    peak = max(peak_before, flops.matmul_peak(**shape))
    (tree_s, tree_f, _), (off_s, off_f, _) = results["auto"], results["off"]
    speed, flop_ratio = off_s / tree_s, off_f / tree_f
    print(f"fp32 matmul peak {peak / 1e9:.1f} GFLOP/s; the tree at {tree_f / tree_s / peak:.0%} of it, off at "
          f"{off_f / off_s / peak:.0%}")
    print(f"tree {speed:.2f}x off on {flop_ratio:.2f}x fewer FLOPs: {speed / flop_ratio:.0%} of the FLOP ratio")


if __name__ == "__main__":
    main()
