"""GPU benchmark: klpipe precompute on a random model of Gemma 4 E2B's text shape, the prefix tree on and off, and
the rows padded through transformers as TRL does.

    python benchmarks/bench_gpu.py                   # GRPO and agent rows, ~400k tokens each, auto, off, padded
    python benchmarks/bench_gpu.py --tokens 200000   # a quick look
    python benchmarks/bench_gpu.py --model qwen3_5 --tokens 500000   # the hybrid, below
    python benchmarks/bench_gpu.py --dry-run         # the same script on CPU, a tiny shape: CI runs it
    python benchmarks/bench_gpu.py --shapes grpo --runners auto --compile off   # and the streamed row: a quick one

Where the tree runs, each runner prints which way its attention calls went (cascade.CALLS: in place, "cascade", or
"gathered") and the kernel each part of the cascade ran on (lse_attention.CALLS: cuda_flash, efficient, or math
where no kernel passed its probe for that kind of call, with the probe's reason).
    benchmarks/gpu_run.sh                            # on a lent GPU machine: the wheel it needs, then the run

Last, the copy-stream row (benchmarks/gpu_stream.py, `--stream off` leaves it out): a stack of Llama 3.1 70B's decoder
layers whose weights stay in pinned host memory, run layer-major with each layer copied on a copy stream while the one
before computes, against the same stack resident: what a copy stream would add to klpipe's GPU path, which copies on
the compute's own stream.

Two shapes of rows (--shapes): `grpo`, GRPO groups of 8 sharing a prompt of ~1,900 tokens (1,500-2,300); `agent`,
below. Four runners each: `auto` and `off` (klpipe.precompute end to end), `streamed` (`auto+s`: `auto` under a
--max-memory that holds a third of what streams, so the weights stream to the device; same bits as `auto` or
a slip), and `padded`, the contender: the rows
as TRL's GRPOTrainer feeds its reference model (prompts padded on the left, completions on the right, batches of
8 in input order, the model's own forward with an attention mask, logits kept for the completion only, an fp32
log_softmax gathered row by row), timed over its loop. `--dry-run` builds a tiny model of the same family (hidden
64, 6 layers, vocabulary 4,096) and rows 1/32 as long, and runs everything on CPU in bf16: no figure of it means
anything, but a typo costs no device minute.

The model has E2B's text shape as transformers' Gemma 4 conversion script defines it: hidden 1536,
35 layers (4 sliding : 1 full, window 512), 8 query heads and 1 KV head, per-layer inputs of 256,
the last 20 layers sharing KV, double-wide MLPs in those, vocabulary 262,144 with a tied head and
final-logit softcap 30. Its weights are random (nothing is downloaded), in bfloat16, saved once
under build/bench/gpu/ and loaded by `klpipe precompute` like any local checkpoint.

Agent rows: a 1,500-token system prompt in every row, then GRPO groups of 8 sharing a
task of 128-1024 tokens, responses of 32-1024 tokens (log-uniform), about --tokens tokens counted per
row (prompt + response). Each mode runs
`klpipe.precompute` end to end (read, validate, forward, write), model loading excluded, and prints
response tokens/s, tokens fed/s, peak GPU memory (on CPU: the process's peak RSS), and two shares of the GPU's
bf16 dense peak:

  MFU        the FLOPs the mode's method needs (benchmarks/flops.py: linear per fed token, attention
             per needed causal pair, sliding windows respected, the KV-shared layers on a node's last
             position alone where the tree skips them, the head per response token) over its seconds;
             `off` needs the per-row FLOPs, the tree its own. Comparable across modes: the useful work
  linear     2 x the linear weights each token fed really passed through, over the seconds (attention
             left out: a lower bound on the work done)

and the tree's speed-up beside its FLOP ratio (the share of the FLOP limit it reached).

`--compile on,off` (the default) runs `auto` and `off` under each mode: `auto+c` and `off+c` with the decoder layers'
norms and MLPs compiled (`klpipe precompute --compile on`), beside them eager, and prints compiled over eager. The
compile happens at load, outside a runner's seconds; its time is in klpipe's log line ("compiled ... in N s").

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
from contextlib import contextmanager
from pathlib import Path

import flops  # benchmarks/flops.py: the FLOPs each method needs
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "bench" / "gpu"
MODEL_DIR = WORK / "gemma4-e2b-shape"
VOCAB = 262_144  # E2B's
ROW_VOCAB = 248_320  # the rows' ids, below both models' vocabularies (the hybrid's is this)
GROUP_SIZE = 8
TRL_BATCH = 8  # GRPOTrainer's reference pass, batch_size 8 (benchmarks/contenders.py)
# Dense bf16 tensor-core peaks (no sparsity), TFLOP/s; --peak-tflops for anything else.
PEAKS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "B200": 2250.0}


def e2b_text_config():
    from transformers import Gemma4TextConfig

    if DRY:  # the same family, tiny: sliding and full layers, KV-shared layers, softcap, per-layer inputs
        return Gemma4TextConfig(
            vocab_size=VOCAB, hidden_size=64, hidden_size_per_layer_input=16, intermediate_size=128,
            num_hidden_layers=6, layer_types=(["sliding_attention"] * 2 + ["full_attention"]) * 2,
            num_attention_heads=4, num_key_value_heads=1, head_dim=16, global_head_dim=32, num_kv_shared_layers=3,
            use_double_wide_mlp=True, final_logit_softcapping=30.0, sliding_window=16, tie_word_embeddings=True,
            max_position_embeddings=8192)
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
DRY = False  # main() sets it from --dry-run: CPU, a tiny model of the same family, rows SCALE times shorter
SCALE = 1
DEVICE = "cuda"


def model_dir() -> Path:
    if DRY:
        return WORK / f"{MODEL}-tiny"
    return MODEL_DIR if MODEL == "gemma4-e2b" else WORK / f"{MODEL}-shape"


def build_model() -> None:
    import torch
    from transformers import AutoTokenizer

    if (model_dir() / "config.json").exists():
        return
    started = time.perf_counter()
    torch.manual_seed(0)
    cls, config = causal_lm(MODEL)
    with torch.device(DEVICE):
        model = cls(config()).to(torch.bfloat16)
    model.save_pretrained(model_dir(), safe_serialization=True)
    # klpipe loads a tokenizer beside the model; ids are given, so the sample one will do.
    AutoTokenizer.from_pretrained(ROOT / "sample_data" / "tiny-gemma4").save_pretrained(model_dir())
    print(f"built and saved the model in {time.perf_counter() - started:.0f}s", flush=True)
    del model
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def build_rollouts(shape: str, tokens: int) -> Path:
    """GRPO or agent rows (see the module's docstring) of about `tokens` tokens counted per row, lengths / SCALE."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = WORK / f"{shape}-{tokens}{'-tiny' if DRY else ''}.parquet"
    if path.exists():
        return path
    rng = np.random.default_rng(0)
    vocab = ROW_VOCAB if not DRY else VOCAB

    def ids(n: float) -> np.ndarray:
        return rng.integers(0, vocab, max(1, int(n) // SCALE))

    system = ids(1500)
    prompts, responses, total = [], [], 0
    while total < tokens:
        if shape == "agent":
            prompt = np.concatenate([system, ids(rng.integers(128, 1025))])
        else:  # grpo: a prompt of its own per group
            prompt = ids(rng.integers(1500, 2301))
        for _ in range(GROUP_SIZE):
            response = ids(np.exp(rng.uniform(np.log(32), np.log(1024))))
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


def reset_peak() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_gib() -> float:
    """Peak GPU memory allocated since reset_peak; on CPU the process's peak resident set (never reset)."""
    import torch

    if DEVICE == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_padded(rollouts: Path, peak_tflops: float) -> dict:
    """The contender: the rows padded through transformers as TRL's GRPOTrainer feeds its reference model."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM

    table = pq.read_table(rollouts, columns=["prompt_ids", "response_ids"])
    prompts, responses = table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist()
    model = AutoModelForCausalLM.from_pretrained(model_dir(), dtype=torch.bfloat16).to(DEVICE).eval()
    reset_peak()
    logps, padded, started = [], 0, time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(prompts), TRL_BATCH):
            batch_p, batch_r = prompts[start:start + TRL_BATCH], responses[start:start + TRL_BATCH]
            p_len, r_len = max(map(len, batch_p)), max(map(len, batch_r))
            ids = torch.zeros(len(batch_p), p_len + r_len, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, (p, r) in enumerate(zip(batch_p, batch_r, strict=True)):
                ids[i, p_len - len(p):p_len + len(r)] = torch.tensor(p + r)
                mask[i, p_len - len(p):p_len + len(r)] = 1
            padded += ids.numel()
            ids, mask = ids.to(DEVICE), mask.to(DEVICE)
            logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=r_len + 1).logits[:, :-1]  # (b, R, V)
            targets = ids[:, p_len:]
            for i in range(len(batch_p)):  # TRL's selective_log_softmax for bf16: row by row, in fp32
                row = logits[i].float()
                picked = row.gather(-1, targets[i, :, None])[:, 0] - torch.logsumexp(row, dim=-1)
                logps.append(picked[:len(batch_r[i])])
        first = [values.cpu().tolist() for values in logps[:16]]
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    needed, fed = needed_flops(rollouts, "off")
    del model
    return {"needed": needed, "needed_mfu": needed.total / seconds / (peak_tflops * 1e12), "sharing": "padded",
            "seconds": seconds, "rows": len(prompts), "tokens": sum(map(len, responses)), "fed": fed,
            "padded": padded, "per_row": fed, "peak_gib": peak_gib(), "mfu": float("nan"), "first_rows": first}


def streamed_budget() -> str:
    """A --max-memory that holds a third of what streams (the decoder layers, and the tables read by rows: E2B's
    per-layer embeddings) beside what stays loaded and one pass: the
    weights do not fit it, so `klpipe precompute` streams them (on a GPU, the device's budget; on CPU the process's,
    its footprint and a margin for what the process grows by before the decision included)."""
    import torch

    from klpipe.model.streamed_load import measure
    from klpipe.precompute import PrecomputeConfig
    from klpipe.precompute.budget import GROWTH
    from klpipe.precompute.models import resolve
    from klpipe.precompute.provenance import default_max_tokens
    from klpipe.process_memory import resident

    config = PrecomputeConfig(inputs=[], output=WORK / "unused.parquet", model=str(model_dir()), device=DEVICE,
                              dtype="bfloat16")
    sizes = measure(resolve(config).spec, default_max_tokens(DEVICE))
    footprint = torch.cuda.memory_reserved() if DEVICE == "cuda" else resident()
    return str(footprint + GROWTH + sizes.resident + sizes.activations + (sizes.weights - sizes.resident) // 3)


@contextmanager
def footprint_held():
    """On CPU (the dry run), the process's footprint as the budget sees it held at its value now: the tiny model's
    layers are a few MB, less than the process grows by between streamed_budget's sum and the run's own decision,
    which would then find the weights fit. On a GPU the budget is the device's, and nothing is held."""
    if DEVICE == "cuda":
        yield
        return
    from klpipe import process_memory

    now, saved = process_memory.resident(), process_memory.resident
    process_memory.resident = lambda: now
    try:
        yield
    finally:
        process_memory.resident = saved


def run_streamed(rollouts: Path, peak_tflops: float) -> dict:
    with footprint_held():
        return run(rollouts, "auto", peak_tflops, "off", streamed_budget())


def run_full_kl(rollouts: Path, peak_tflops: float) -> list[dict]:
    """The exact KL's pair: `--policy` (the model itself as a policy of its own: the same work as another's) without
    and with --full-kl, rows `policy` and `policy+kl`; their seconds' ratio is its cost (bench_full_kl.py on CPU)."""
    return [run(rollouts, "auto", peak_tflops, "off", policy=str(model_dir()), full_kl=full) for full in (False, True)]


def run(rollouts: Path, sharing: str, peak_tflops: float, compile: str = "auto", max_memory: str | None = None,
        policy: str | None = None, full_kl: bool = False) -> dict:
    import pyarrow.parquet as pq

    from klpipe.model.attention import cascade, lse_attention
    from klpipe.precompute import PrecomputeConfig, precompute

    label = (("policy+kl" if full_kl else "policy") if policy else f"{sharing}+s" if max_memory
             else sharing if compile == "off" else f"{sharing}+c")
    out = WORK / f"cached-{rollouts.stem}-{label}.parquet"
    out.unlink(missing_ok=True)
    reset_peak()
    cascade.CALLS.clear()
    lse_attention.CALLS.clear()
    summary = precompute(PrecomputeConfig(inputs=[rollouts], output=out, model=str(model_dir()), device=DEVICE,
                                          dtype="bfloat16", overwrite=True, progress="none",
                                          prefix_sharing=sharing, compile=compile, max_memory=max_memory,
                                          policy=policy, full_kl=full_kl, overwrite_policy_logprobs=policy is not None),
                         log=lambda m: print(f"  {m}", flush=True))
    if max_memory:
        print(f"  streamed under --max-memory {max_memory}: {summary.streamed}", flush=True)
    cost = flops_per_token()
    forward = summary.forward
    # Nodes that need only their last output run the KV-shared layers on that position alone
    # (logits_to_keep=1): their other tokens pass the early layers only. Attention scores (QK^T and
    # AV) are left out: a lower bound on the work done, and so on the share.
    flops = (cost["early"] * forward.fed_tokens + cost["shared"] * (forward.fed_tokens - forward.early_only_tokens)
             + cost["head"] * summary.tokens)
    # Which way each of the tree's attention calls went (cascade.py: in place or gathered), and which kernel each of
    # the cascade's parts ran on (lse_attention.py: a probed kernel, or plain torch where no kernel passed its probe).
    if cascade.CALLS:
        print(f"  tree attention calls: {dict(cascade.CALLS)}; their kernels: {dict(lse_attention.CALLS)}", flush=True)
    for kind, why in lse_attention.REJECTED.items():
        print(f"  kernel {kind[0]} not used for {kind[1:]}: {why}", flush=True)
    needed, counted_fed = needed_flops(rollouts, sharing)
    if counted_fed != forward.fed_tokens:  # the count's plan is not what ran: say so, do not hide it
        print(f"  note: {sharing} fed {forward.fed_tokens:,} tokens, flops.py's plan {counted_fed:,}", flush=True)
    return {
        "needed": needed, "needed_mfu": needed.total / summary.seconds / (peak_tflops * 1e12),
        "sharing": label,  # +c: the layers' norms and MLPs compiled; +s: the weights streamed
        "seconds": summary.seconds, "rows": summary.rows, "tokens": summary.tokens,
        "fed": forward.fed_tokens, "padded": forward.padded_tokens, "per_row": forward.per_row_tokens,
        "peak_gib": peak_gib(),
        "mfu": flops / summary.seconds / (peak_tflops * 1e12),
        "first_rows": pq.read_table(out).column("ref_logprobs").slice(0, 16).to_pylist(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=400_000,
                        help="prompt + response tokens per shape, counted per row")
    parser.add_argument("--shapes", default="grpo,agent", help="comma-separated: grpo, agent")
    parser.add_argument("--runners", default="auto,off,padded,streamed,fullkl",
                        help="comma-separated: auto, off, padded, streamed, fullkl (--policy without and with "
                             "--full-kl)")
    parser.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak; default by device name")
    parser.add_argument("--compile", default="on,off",
                        help="comma-separated --compile modes each of auto and off runs under (a runner compiled "
                             "is labelled RUNNER+c; its load, where the compile happens, is not in its seconds)")
    parser.add_argument("--model", choices=["gemma4-e2b", "qwen3_5"], default="gemma4-e2b")
    parser.add_argument("--stream", choices=["on", "off"], default="on",
                        help="the streamed row (benchmarks/gpu_stream.py): a 70B-shaped stack of layers from pinned "
                             "host memory, layer-major on a copy stream, against it resident")
    parser.add_argument("--dry-run", action="store_true", help="on CPU, a tiny model and short rows: checks the script")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    global MODEL, DRY, SCALE, DEVICE, VOCAB
    MODEL = args.model
    shapes, runners = args.shapes.split(","), args.runners.split(",")

    import torch

    if args.dry_run:
        if MODEL != "gemma4-e2b":
            sys.exit("--dry-run builds the tiny Gemma 4 only")
        DRY, SCALE, DEVICE, VOCAB = True, 32, "cpu", 4096
        args.tokens = min(args.tokens, 4_000)
        name, peak = "CPU (dry run: a nominal 1 TFLOP/s peak)", args.peak_tflops or 1.0
    else:
        if not torch.cuda.is_available():
            sys.exit("bench_gpu.py needs a CUDA GPU (--dry-run runs it on CPU)")
        name = torch.cuda.get_device_name()
        peak = args.peak_tflops or next((v for k, v in PEAKS.items() if k in name), None)
        if peak is None:
            sys.exit(f"unknown GPU {name!r}: pass --peak-tflops")
    WORK.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    build_model()
    what = "Qwen3.5-style hybrid, ~2B" if MODEL == "qwen3_5" else "Gemma 4 E2B text shape"
    print(f"{name}, bf16 peak {peak:g} TFLOP/s; {'a tiny model of the ' if DRY else ''}{what}, random weights",
          flush=True)
    for shape in shapes:
        rollouts = build_rollouts(shape, args.tokens)
        print(f"\n{shape} rows: {pq_rows(rollouts)} rows in groups of {GROUP_SIZE}, ~{args.tokens:,} tokens per "
              "row-wise count", flush=True)
        results = [result for runner in runners
                   for result in ([run_padded(rollouts, peak)] if runner == "padded" else
                                  [run_streamed(rollouts, peak)] if runner == "streamed"
                                  else run_full_kl(rollouts, peak) if runner == "fullkl"
                                  else [run(rollouts, runner, peak, mode) for mode in args.compile.split(",")])]
        report(results, peak)
    if args.stream == "on":
        import gpu_stream  # benchmarks/gpu_stream.py

        gpu_stream.main(DRY, DEVICE)
    print(f"\nwhole run {time.perf_counter() - started:.0f}s", flush=True)


def report(results: list[dict], peak: float) -> None:
    print(f"{'runner':<10}{'seconds':>9}{'resp tok/s':>12}{'fed tok/s':>12}{'tokens fed':>13}{'padded':>13}"
          f"{'per-row tokens':>16}{'peak GiB':>10}{'TFLOP':>8}{'attention':>10}{'MFU':>7}{'linear':>8}")
    for r in results:
        print(f"{r['sharing']:<10}{r['seconds']:>9.1f}{r['tokens'] / r['seconds']:>12,.0f}"
              f"{r['fed'] / r['seconds']:>12,.0f}{r['fed']:>13,}{r['padded']:>13,}{r['per_row']:>16,}"
              f"{r['peak_gib']:>10.1f}{r['needed'].total / 1e12:>8.2f}"
              f"{r['needed'].attention / r['needed'].total:>10.0%}"
              f"{r['needed_mfu']:>7.1%}{'-' if r['mfu'] != r['mfu'] else format(r['mfu'], '.1%'):>8}")
    print(f"MFU: the FLOPs each runner's method needs over its seconds, against the bf16 peak {peak:g} TFLOP/s; "
          "linear: 2 x the linear weights each fed token passed through")
    by = {r["sharing"]: r for r in results}
    base = by.get("off") or by.get("padded")
    for r in results:
        if base is None or r is base:  # neither `off` nor `padded` ran: nothing to compare with
            continue
        gap = max((float(np.max(np.abs(np.subtract(a, b))))
                   for a, b in zip(r["first_rows"], base["first_rows"], strict=True) if len(a)), default=0.0)
        speed = base["seconds"] / r["seconds"]
        flop_ratio = base["needed"].total / r["needed"].total
        print(f"{r['sharing']} / {base['sharing']}: {speed:.2f}x the throughput on {flop_ratio:.2f}x fewer FLOPs "
              f"needed ({speed / flop_ratio:.0%} of the FLOP limit); max |Δ| over the first 16 rows' logprobs: "
              f"{gap:.3g} (bf16)")
    for name in ("auto", "off"):
        if name in by and f"{name}+c" in by:
            print(f"{name}+c / {name} (compiled norms and MLPs against eager): "
                  f"{by[name]['seconds'] / by[name + '+c']['seconds']:.2f}x the throughput")
    if "auto+s" in by and "auto" in by:  # the same kernels over the same weights: any difference is a slip
        a, b = by["auto"]["first_rows"], by["auto+s"]["first_rows"]
        print(f"auto+s / auto (the weights streamed layer by layer against held in memory): "
              f"{by['auto']['seconds'] / by['auto+s']['seconds']:.2f}x the throughput; same bits over the first 16 "
              f"rows: {'yes' if a == b else 'NO'}")
    if "padded" in by and "auto" in by and base is not by["padded"]:
        print(f"auto / padded (TRL's way): {by['padded']['seconds'] / by['auto']['seconds']:.2f}x the throughput")
    if "policy" in by and "policy+kl" in by:  # the exact KL's cost with a policy (goal <= 1.15x); the same logprobs
        a, b = by["policy"]["first_rows"], by["policy+kl"]["first_rows"]
        gap = max((float(np.max(np.abs(np.subtract(x, y)))) for x, y in zip(a, b, strict=True) if x), default=0.0)
        ratio = by['policy+kl']['seconds'] / by['policy']['seconds']
        print(f"policy+kl / policy (--full-kl against --no-full-kl): {ratio:.3f}x "
              f"the seconds, peak {by['policy+kl']['peak_gib']:.1f} against {by['policy']['peak_gib']:.1f} GiB; "
              f"max |Δ ref_logprobs| over the first 16 rows {gap:.3g}")


def pq_rows(path: Path) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).metadata.num_rows


if __name__ == "__main__":
    main()
