"""Benchmark the prefix tree on a hybrid model: bench_agent.py's agent-shaped rollouts through a Qwen3.5-style
model (Gated DeltaNet and attention, 3:1), where a node's recurrent state is handed on instead of keys and values.

    python benchmarks/bench_hybrid.py                          # both shapes, klpipe and off
    python benchmarks/bench_hybrid.py --shape multi-turn --only klpipe off floor

Model: a random Qwen3_5ForCausalLM of bench_agent's Llama's size (8 layers x 256: 6 Gated DeltaNet layers and
2 of full attention, FFN 1024, vocabulary 8,192), fp32 on CPU. Without flash-linear-attention and
causal-conv1d (GPU-only kernels), transformers runs the linear-attention layers in its reference PyTorch
code, as it does here.

Contenders, each in its own process on the same file (contenders.py measures them):
  (a) klpipe   `klpipe.precompute`, --prefix-sharing auto (the default): the tree
  (c) off      klpipe --prefix-sharing off: every row runs whole
  (d) floor    each row alone, no padding, the head on response positions only
"""

from __future__ import annotations

import os
from pathlib import Path

import bench_agent  # the shapes
import contenders
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "bench" / "hybrid"
MODEL_DIR = WORK / "qwen3_5-8k"
CHECKED_ROWS = 12


def build_model(model_dir: Path, seed: int = 0) -> None:
    if (model_dir / "model.safetensors").exists():
        return
    import torch
    from transformers import AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(
        vocab_size=contenders.VOCAB, hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
        layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=64, linear_value_head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False)
    Qwen3_5ForCausalLM(config).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(ROOT / "sample_data" / "tiny-llama").save_pretrained(model_dir)


def data_path(shape: str, one_row: bool = False) -> Path:
    return WORK / f"{shape}{'-one-row' if one_row else ''}.parquet"


def build_inputs(shapes: list[str]) -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    build_model(MODEL_DIR)
    for shape in shapes:
        if not data_path(shape).exists():
            rows = bench_agent.SHAPES[shape](np.random.default_rng(1))
            contenders.write_rollouts(data_path(shape), data_path(shape, one_row=True),
                                      [f"r{i}" for i in range(len(rows))], [p for p, _ in rows], [r for _, r in rows])


CONTENDERS = {
    "klpipe": ("(a) klpipe", lambda path: contenders.run_klpipe(MODEL_DIR, path, "auto", CHECKED_ROWS)),
    "off": ("(c) klpipe --prefix-sharing off",
            lambda path: contenders.run_klpipe(MODEL_DIR, path, "off", CHECKED_ROWS)),
    "floor": ("(d) per-row minimal-work floor", lambda path: contenders.run_floor(MODEL_DIR, path, CHECKED_ROWS)),
}


def main() -> None:
    parser = contenders.parser(__doc__, list(CONTENDERS))
    parser.add_argument("--shape", nargs="+", choices=sorted(bench_agent.SHAPES), default=list(bench_agent.SHAPES))
    args = parser.parse_args()
    if args.child:
        return contenders.child(CONTENDERS[args.child][1], args.path)
    build_inputs(args.shape)
    print(f"Qwen3.5-style 8 x 256 (6 Gated DeltaNet, 2 attention), vocab {contenders.VOCAB:,}, fp32, CPU, "
          f"{os.cpu_count()} threads; each contender in its own process, fastest of {args.repeat} round(s)")
    for shape in args.shape:
        prompts, responses = contenders.load_rows(data_path(shape))
        per_row = sum(len(p) + len(r) - 1 for p, r in zip(prompts, responses, strict=True))
        print(f"\n== {shape}: {len(prompts)} rows, {per_row:,} tokens fed running each row whole", flush=True)
        names = args.only or ["klpipe", "off"]
        best = contenders.measure(__file__, names, data_path(shape), data_path(shape, one_row=True), args.repeat)
        contenders.print_table(best, {name: label for name, (label, _) in CONTENDERS.items()})


if __name__ == "__main__":
    main()
