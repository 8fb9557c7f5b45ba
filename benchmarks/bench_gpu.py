"""GPU benchmark: klpipe precompute on a random model of Gemma 4 E2B's text shape, the prefix tree on and off.

    python benchmarks/bench_gpu.py                   # ~2M tokens of agent-shaped rows; under 5 minutes on one H200
    python benchmarks/bench_gpu.py --tokens 200000   # a quick look
    python benchmarks/bench_gpu.py --model qwen3_5 --tokens 500000   # the hybrid, below

The model has E2B's text shape as transformers' Gemma 4 conversion script defines it: hidden 1536,
35 layers (4 sliding : 1 full, window 512), 8 query heads and 1 KV head, per-layer inputs of 256,
the last 20 layers sharing KV, double-wide MLPs in those, vocabulary 262,144 with a tied head and
final-logit softcap 30. Its weights are random (nothing is downloaded), in bfloat16, saved once
under build/bench/gpu/ and loaded by `klpipe precompute` like any local checkpoint.

Rows are agent-shaped: a 1,500-token system prompt in every row, then GRPO groups of 8 sharing a
task of 128-1024 tokens, responses of 32-1024 tokens (log-uniform), about --tokens tokens counted per
row (prompt + response). Each mode runs
`klpipe.precompute` end to end (read, validate, forward, write), model loading excluded, and prints
response tokens/s, tokens fed/s, peak GPU memory, and two shares of the GPU's bf16 dense peak:

  MFU        the FLOPs the mode's method needs (benchmarks/flops.py: linear per fed token, attention
             per needed causal pair, sliding windows respected, the KV-shared layers on a node's last
             position alone where the tree skips them, the head per response token) over its seconds;
             `off` needs the per-row FLOPs, the tree its own. Comparable across modes: the useful work
  linear     2 x the linear weights each token fed really passed through, over the seconds (attention
             left out: a lower bound on the work done)

and the tree's speed-up beside its FLOP ratio (the share of the FLOP limit it reached).

`--model qwen3_5` runs a random hybrid instead: a Qwen3.5-style model of about 2B parameters (hidden
2048, 24 layers, 3 Gated DeltaNet : 1 gated full attention, 16 query and 2 KV heads of 256, 16 key and
value heads of 128 in the linear layers, vocabulary 248,320, tied head). Its nodes hand on recurrent
states. A linear-attention layer's recurrence is counted as 6 x key dim x value dim per value head and
token (the delta rule's read, update and output). Without flash-linear-attention and causal-conv1d,
transformers runs those layers in its reference PyTorch code, and klpipe's log says so.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import flops  # benchmarks/flops.py: the FLOPs each method needs
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "bench" / "gpu"
MODEL_DIR = WORK / "gemma4-e2b-shape"
VOCAB = 262_144  # E2B's
ROW_VOCAB = 248_320  # the rows' ids, below both models' vocabularies (the hybrid's is this)
GROUP_SIZE = 8
# Dense bf16 tensor-core peaks (no sparsity), TFLOP/s; --peak-tflops for anything else.
PEAKS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "B200": 2250.0}


def e2b_text_config():
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=1536, hidden_size_per_layer_input=256, intermediate_size=4 * 1536,
        num_hidden_layers=35, layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7,
        num_attention_heads=8, num_key_value_heads=1, num_kv_shared_layers=20, use_double_wide_mlp=True,
        final_logit_softcapping=30.0, sliding_window=512, tie_word_embeddings=True,
        rope_parameters={
            "full_attention": {"rope_theta": 1_000_000.0, "rope_type": "proportional", "partial_rotary_factor": 0.25},
            "sliding_attention": {"rope_theta": 10_000.0, "rope_type": "default"},
        },
        max_position_embeddings=8192,
    )


def qwen3_5_config():
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=ROW_VOCAB, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, max_position_embeddings=32768, tie_word_embeddings=True)


def causal_lm(name: str):
    from transformers import Gemma4ForCausalLM, Qwen3_5ForCausalLM

    return {"gemma4-e2b": (Gemma4ForCausalLM, e2b_text_config),
            "qwen3_5": (Qwen3_5ForCausalLM, qwen3_5_config)}[name]


MODEL = "gemma4-e2b"  # main() sets it from --model


def model_dir() -> Path:
    return MODEL_DIR if MODEL == "gemma4-e2b" else WORK / f"{MODEL}-shape"


def build_model() -> None:
    import torch
    from transformers import AutoTokenizer

    if (model_dir() / "config.json").exists():
        return
    started = time.perf_counter()
    torch.manual_seed(0)
    cls, config = causal_lm(MODEL)
    with torch.device("cuda"):
        model = cls(config()).to(torch.bfloat16)
    model.save_pretrained(model_dir(), safe_serialization=True)
    # klpipe loads a tokenizer beside the model; ids are given, so the sample one will do.
    AutoTokenizer.from_pretrained(ROOT / "sample_data" / "tiny-gemma4").save_pretrained(model_dir())
    print(f"built and saved the model in {time.perf_counter() - started:.0f}s", flush=True)
    del model
    torch.cuda.empty_cache()


def build_rollouts(tokens: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = WORK / f"agent-{tokens}.parquet"
    if path.exists():
        return path
    rng = np.random.default_rng(0)
    system = rng.integers(0, ROW_VOCAB, 1500)
    prompts, responses, total = [], [], 0
    while total < tokens:
        prompt = np.concatenate([system, rng.integers(0, ROW_VOCAB, int(rng.integers(128, 1025)))])
        for _ in range(GROUP_SIZE):
            response = rng.integers(0, ROW_VOCAB, int(np.exp(rng.uniform(np.log(32), np.log(1024)))))
            prompts.append(prompt)
            responses.append(response)
            total += len(prompt) + len(response)
    table = pa.table({
        "prompt_ids": pa.array([p.tolist() for p in prompts], pa.list_(pa.int32())),
        "response_ids": pa.array([r.tolist() for r in responses], pa.list_(pa.int32())),
    })
    pq.write_table(table, path)
    return path


def meta_model():
    import torch

    cls, config = causal_lm(MODEL)
    with torch.device("meta"):
        return cls(config())


def _linear(module) -> int:
    import torch

    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


def flops_per_token() -> dict:
    """FLOPs per token: 2 x the weights of every linear layer a token passes through, counted on a
    meta-device copy of the model (embedding lookups cost no FLOPs; KV-shared layers have no k and v
    projections). `early` is the layers before the KV-shared ones, `shared` the KV-shared layers,
    `head` the LM head for one response token."""
    model = meta_model()
    linear = _linear
    first_shared = model.config.num_hidden_layers - (getattr(model.config, "num_kv_shared_layers", 0) or 0)
    shared = sum(linear(layer) for layer in model.model.layers[first_shared:])
    return {"early": 2.0 * (linear(model.model) - shared), "shared": 2.0 * shared,
            "head": 2.0 * model.lm_head.weight.numel()}


def model_flops() -> flops.ModelFlops:
    """The FLOPs the model needs, layer by layer, counted on a meta-device copy of it: each decoder layer's
    linear weights, its query width (4 x heads x head dim per pair), its window, and whether it is KV-shared
    (run on a node's last position alone where the tree skips it); a linear-attention layer's recurrence per
    token (see the module's docstring); the per-layer input projections outside the layers, for every fed
    token."""
    model = meta_model()
    linear = _linear
    config = model.config
    first_shared = config.num_hidden_layers - (getattr(config, "num_kv_shared_layers", 0) or 0)
    recurrence = 0.0
    if MODEL == "qwen3_5":
        recurrence = 6.0 * config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    layers = []
    for i, layer in enumerate(model.model.layers):
        kind = config.layer_types[i]
        if kind == "linear_attention":
            layers.append(flops.Layer(2.0 * linear(layer) + recurrence, 0.0))
            continue
        width = layer.self_attn.o_proj.in_features  # heads x head dim (Qwen3.5's q_proj also makes its gate)
        layers.append(flops.Layer(2.0 * linear(layer), 4.0 * width,
                                  config.sliding_window if kind == "sliding_attention" else None,
                                  skippable=i >= first_shared))
    outside = linear(model.model) - sum(linear(layer) for layer in model.model.layers)
    layers.append(flops.Layer(2.0 * outside, 0.0))  # no attention: per-layer input projections
    return flops.ModelFlops(tuple(layers), 2.0 * model.lm_head.weight.numel())


def needed_flops(rollouts: Path, sharing: str) -> tuple[flops.Flops, int]:
    """(FLOPs the mode's method needs, tokens it feeds): the tree as precompute plans it on this model
    (prompts cut into nodes of their own, KV-shared layers skipped), or every row whole."""
    import pyarrow.parquet as pq

    table = pq.read_table(rollouts, columns=["prompt_ids", "response_ids"])
    prompts, responses = table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist()
    if sharing == "off":
        segments = flops.per_row(prompts, responses)
    else:
        segments = flops.tree(prompts, responses, sharing=sharing, skips_layers=MODEL == "gemma4-e2b")
    return model_flops().method(segments, sum(map(len, responses))), flops.fed_tokens(segments)


def run(rollouts: Path, sharing: str, peak_tflops: float) -> dict:
    import pyarrow.parquet as pq
    import torch

    from klpipe.precompute import PrecomputeConfig, precompute

    out = WORK / f"cached-{sharing}.parquet"
    out.unlink(missing_ok=True)
    torch.cuda.reset_peak_memory_stats()
    summary = precompute(PrecomputeConfig(inputs=[rollouts], output=out, model=str(model_dir()), device="cuda",
                                          dtype="bfloat16", overwrite=True, progress="none",
                                          prefix_sharing=sharing), log=lambda m: print(f"  {m}", flush=True))
    cost = flops_per_token()
    forward = summary.forward
    # Nodes that need only their last output run the KV-shared layers on that position alone
    # (logits_to_keep=1): their other tokens pass the early layers only. Attention scores (QK^T and
    # AV) are left out: a lower bound on the work done, and so on the share.
    flops = (cost["early"] * forward.fed_tokens + cost["shared"] * (forward.fed_tokens - forward.early_only_tokens)
             + cost["head"] * summary.tokens)
    needed, counted_fed = needed_flops(rollouts, sharing)
    if counted_fed != forward.fed_tokens:  # the count's plan is not what ran: say so, do not hide it
        print(f"  note: {sharing} fed {forward.fed_tokens:,} tokens, flops.py's plan {counted_fed:,}", flush=True)
    return {
        "needed": needed, "needed_mfu": needed.total / summary.seconds / (peak_tflops * 1e12),
        "sharing": sharing, "seconds": summary.seconds, "rows": summary.rows, "tokens": summary.tokens,
        "fed": forward.fed_tokens, "padded": forward.padded_tokens, "per_row": forward.per_row_tokens,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "mfu": flops / summary.seconds / (peak_tflops * 1e12),
        "first_rows": pq.read_table(out).column("ref_logprobs").slice(0, 16).to_pylist(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2_000_000, help="prompt + response tokens, counted per row")
    parser.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak; default by device name")
    parser.add_argument("--model", choices=["gemma4-e2b", "qwen3_5"], default="gemma4-e2b")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    global MODEL
    MODEL = args.model

    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_gpu.py needs a CUDA GPU")
    name = torch.cuda.get_device_name()
    peak = args.peak_tflops or next((v for k, v in PEAKS.items() if k in name), None)
    if peak is None:
        sys.exit(f"unknown GPU {name!r}: pass --peak-tflops")
    WORK.mkdir(parents=True, exist_ok=True)
    build_model()
    rollouts = build_rollouts(args.tokens)
    table_rows = pq_rows(rollouts)
    print(f"{name}, bf16 peak {peak:g} TFLOP/s; {table_rows} rows in groups of {GROUP_SIZE}, ~{args.tokens:,} tokens "
          f"per row-wise count; {'Gemma 4 E2B text shape' if MODEL == 'gemma4-e2b' else 'Qwen3.5-style hybrid, ~2B'}, "
          "random weights", flush=True)
    results = [run(rollouts, sharing, peak) for sharing in ("auto", "off")]

    gap = max(float(np.max(np.abs(np.subtract(a, b)))) for a, b in zip(results[0]["first_rows"],
                                                                          results[1]["first_rows"]) if len(a))
    print()
    print(f"{'prefix sharing':<16}{'seconds':>9}{'resp tok/s':>12}{'fed tok/s':>12}{'tokens fed':>13}"
          f"{'per-row tokens':>16}{'peak GPU GiB':>14}{'TFLOP':>8}{'attention':>10}{'MFU':>7}{'linear':>8}")
    for r in results:
        print(f"{r['sharing']:<16}{r['seconds']:>9.1f}{r['tokens'] / r['seconds']:>12,.0f}"
              f"{r['fed'] / r['seconds']:>12,.0f}{r['fed']:>13,}{r['per_row']:>16,}{r['peak_gib']:>14.1f}"
              f"{r['needed'].total / 1e12:>8.1f}{r['needed'].attention / r['needed'].total:>10.0%}"
              f"{r['needed_mfu']:>7.1%}{r['mfu']:>8.1%}")
    speed = results[1]["seconds"] / results[0]["seconds"]
    flop_ratio = results[1]["needed"].total / results[0]["needed"].total
    print(f"\nMFU: the FLOPs each mode needs over its seconds, against the bf16 peak {peak:g} TFLOP/s; linear: "
          "2 x the linear weights each fed token passed through")
    print(f"auto / off throughput: {speed:.2f}x on {flop_ratio:.2f}x fewer FLOPs needed ({speed / flop_ratio:.0%} of "
          f"the FLOP limit); max |auto - off| over the first 16 rows' logprobs: {gap:.3g} (bf16)")


def pq_rows(path: Path) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows


if __name__ == "__main__":
    main()
