"""Benchmark stage 1: klpipe precompute against a naive seed-style loop and the minimal-work floor.

Each contender runs in its own process (so peak RSS is its own), on the same ~50k tokens with
log-uniform lengths 16-512, through a small random Llama-style model with a 32k vocabulary, fp32 on CPU:

  (a) klpipe  - `klpipe.precompute` end to end: read, validate, batch, score, write the cache
  (a') klpipe --prefix-sharing off: every prompt here is unique, so auto must cost next to nothing
  (b) naive   - the seed's way: batches of 8 in input order, right-padded with an attention mask,
                full (B, T, V) logits, full log_softmax, gather
  (c) floor   - minimal work: each sequence alone (no padding), the model body, then the LM head
                only on response positions, in chunks

Model loading is excluded from every timing. Then the FLOPs each method needs (flops.py: every row
whole, here for klpipe too, as its prompts are unique), GFLOP/s against the machine's fp32 matmul peak
at the model's MLP shape, and klpipe's ratios beside the FLOP ratios.
Run: `make bench` or `python benchmarks/bench_precompute.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import flops  # benchmarks/flops.py: the FLOPs each method needs
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "bench" / "precompute"
MODEL_DIR = WORK / "llama-32k"
ROLLOUTS = WORK / "rollouts.parquet"
VOCAB = 32_000


def random_rows(rng, tokens: int, vocab: int = VOCAB) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, responses) of random ids until `tokens` in all: rows of log-uniform length 16-512, each 20-60%
    prompt."""
    prompts, responses, total = [], [], 0
    while total < tokens:
        length = int(np.exp(rng.uniform(np.log(16), np.log(512))))
        prompt_len = max(1, int(length * rng.uniform(0.2, 0.6)))
        prompts.append(rng.integers(0, vocab, prompt_len).tolist())
        responses.append(rng.integers(0, vocab, length - prompt_len).tolist())
        total += length
    return prompts, responses


def build_inputs(target_tokens: int, seed: int = 0) -> None:
    """The model and the rollouts, made once and reused (delete build/bench to rebuild)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    WORK.mkdir(parents=True, exist_ok=True)
    if not (MODEL_DIR / "model.safetensors").exists():
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                             tie_word_embeddings=False)
        LlamaForCausalLM(config).save_pretrained(MODEL_DIR, safe_serialization=True)
        # klpipe needs a tokenizer beside the model; any with a 32k-compatible vocabulary will do.
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(ROOT / "sample_data" / "tiny-llama").save_pretrained(MODEL_DIR)
    marker = WORK / f"rollouts-{target_tokens}.done"
    if not marker.exists():
        prompts, responses = random_rows(np.random.default_rng(seed), target_tokens)
        table = pa.table({
            "id": [f"r{i}" for i in range(len(prompts))],
            "prompt_ids": pa.array(prompts, pa.list_(pa.int32())),
            "response_ids": pa.array(responses, pa.list_(pa.int32())),
        })
        pq.write_table(table, ROLLOUTS)
        for stale in WORK.glob("rollouts-*.done"):
            stale.unlink()
        marker.touch()


def load_rows():
    import pyarrow.parquet as pq

    table = pq.read_table(ROLLOUTS)
    return table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist()


def run_klpipe(sharing: str = "auto") -> dict:
    from transformers import AutoConfig, AutoTokenizer

    # The other contenders load their model before the clock starts, and with it transformers'
    # lazily imported modules (seconds in a fresh process). klpipe loads config and tokenizer
    # before the weights, inside precompute: load them once here, so the same imports are warm.
    AutoConfig.from_pretrained(MODEL_DIR)
    AutoTokenizer.from_pretrained(MODEL_DIR)
    from klpipe.precompute import PrecomputeConfig, precompute

    out = WORK / f"klpipe-{sharing}.parquet"
    out.unlink(missing_ok=True)  # a finished output would make the run a no-op
    started = time.perf_counter()
    summary = precompute(PrecomputeConfig(inputs=[ROLLOUTS], output=out, model=str(MODEL_DIR), device="cpu",
                                          dtype="float32", overwrite=True, progress="none",
                                          prefix_sharing=sharing), log=lambda m: None)
    seconds = time.perf_counter() - started - summary.load_seconds
    assert summary.rows and not summary.skipped
    return {"seconds": seconds, "padding_efficiency": summary.padding_efficiency,
            "fed_tokens": summary.forward.fed_tokens}


def load_model():
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_grad_enabled(False)
    return AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()


def run_naive() -> dict:
    import torch

    model = load_model()
    prompts, responses = load_rows()
    started = time.perf_counter()
    results = []
    real = padded = 0
    for start in range(0, len(prompts), 8):
        seqs = [p + r for p, r in zip(prompts[start:start + 8], responses[start:start + 8], strict=True)]
        longest = max(map(len, seqs))
        ids = torch.zeros(len(seqs), longest, dtype=torch.long)
        mask = torch.zeros(len(seqs), longest, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s)
            mask[i, :len(s)] = 1
        logits = model(input_ids=ids, attention_mask=mask).logits  # (B, T, V)
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # (B, T, V) again
        token_lp = logprobs[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        for i, (p, r) in enumerate(zip(prompts[start:start + 8], responses[start:start + 8], strict=True)):
            results.append(token_lp[i, len(p) - 1:len(p) - 1 + len(r)].numpy().copy())
        real += sum(map(len, seqs))
        padded += len(seqs) * longest
    return {"seconds": time.perf_counter() - started, "padding_efficiency": real / padded}


def run_floor() -> dict:
    import torch

    model = load_model()
    prompts, responses = load_rows()
    body, head = model.model, model.lm_head
    started = time.perf_counter()
    for p, r in zip(prompts, responses, strict=True):
        ids = torch.tensor([p + r[:-1]])
        hidden = body(input_ids=ids).last_hidden_state[0, len(p) - 1:]  # response positions only
        targets = torch.tensor(r)
        for s in range(0, len(r), 512):
            logits = head(hidden[s:s + 512]).float()
            _ = logits.gather(1, targets[s:s + 512, None])[:, 0] - torch.logsumexp(logits, dim=-1)
    return {"seconds": time.perf_counter() - started, "padding_efficiency": 1.0}


CONTENDERS = {"klpipe": run_klpipe, "klpipe-off": lambda: run_klpipe("off"), "naive": run_naive,
              "floor": run_floor}


def child(name: str) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("KLPIPE_BENCH_THREADS", os.cpu_count() or 1)))
    result = CONTENDERS[name]()
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=50_000)
    parser.add_argument("--child", choices=sorted(CONTENDERS))
    args = parser.parse_args()
    if args.child:
        return child(args.child)

    build_inputs(args.tokens)
    prompts, responses = load_rows()
    tokens = sum(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    print(f"{len(prompts)} rows, {tokens:,} tokens (log-uniform lengths 16-512), Llama-style model "
          f"(hidden 512, 8 layers, vocab {VOCAB:,}), fp32, CPU, "
          f"{os.environ.get('KLPIPE_BENCH_THREADS', os.cpu_count())} threads of {os.cpu_count()} cores", flush=True)
    import torch

    torch.set_num_threads(int(os.environ.get("KLPIPE_BENCH_THREADS", os.cpu_count() or 1)))
    config = json.loads((MODEL_DIR / "config.json").read_text())
    peak_shape = (2048, config["hidden_size"], config["intermediate_size"])
    peaks = [flops.matmul_peak(*peak_shape)]  # before and after: a busy neighbour only lowers it
    results = {}
    for name in ("klpipe", "klpipe-off", "naive", "floor"):
        out = subprocess.run([sys.executable, __file__, "--child", name, "--tokens", str(args.tokens)],
                             capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, check=False)
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if out.returncode or not line:
            sys.exit(f"{name} failed:\n{out.stderr}")
        results[name] = json.loads(line[0][7:])
        results[name]["tokens_per_s"] = tokens / results[name]["seconds"]
        print(f"  ran {name}: {results[name]['seconds']:.1f}s", flush=True)

    a, b, c, off = results["klpipe"], results["naive"], results["floor"], results["klpipe-off"]
    print()
    print(f"{'contender':<34}{'seconds':>9}{'tokens/s':>11}{'padding eff':>13}{'peak RSS MiB':>14}")
    for label, r in (("(a) klpipe precompute", a), ("(a') klpipe --prefix-sharing off", off),
                     ("(b) naive seed-style loop", b), ("(c) minimal-work floor", c)):
        print(f"{label:<34}{r['seconds']:>9.1f}{r['tokens_per_s']:>11,.0f}{r['padding_efficiency']:>12.1%}"
              f"{r['peak_rss_mib']:>14,.0f}")
    print()
    print(f"(a) / (c) throughput: {a['tokens_per_s'] / c['tokens_per_s']:.2f}x   (target >= 0.9x)")
    print(f"(a) / (b) throughput: {a['tokens_per_s'] / b['tokens_per_s']:.2f}x   (target >= 2x)")
    print(f"(a) / (b) peak RSS:   {a['peak_rss_mib'] / b['peak_rss_mib']:.0%}     (target <= 50%)")
    print(f"(a) / (a') throughput: {a['tokens_per_s'] / off['tokens_per_s']:.2f}x   "
          "(unique prompts: auto must cost at most 5%, target >= 0.95x)")

    peaks.append(flops.matmul_peak(*peak_shape))
    model = flops.ModelFlops.from_dir(MODEL_DIR)
    scored = sum(map(len, responses))
    segments = {"klpipe": flops.tree(prompts, responses), "klpipe-off": flops.per_row(prompts, responses)}
    for name in segments:
        assert results[name]["fed_tokens"] == flops.fed_tokens(segments[name]), name
    methods = {name: model.method(segments.get(name, segments["klpipe-off"]), scored) for name in results}
    labels = {"klpipe": "(a) klpipe precompute", "klpipe-off": "(a') klpipe --prefix-sharing off",
              "naive": "(b) naive seed-style loop", "floor": "(c) minimal-work floor"}
    m, k, n = peak_shape
    flops.print_flops_table(results, labels, methods, (max(peaks), (f"{m} x {k} @ {k} x {n}, higher of "
                            f"{' and '.join(f'{p / 1e9:.0f}' for p in peaks)}")), seconds_key="seconds",
                            shape="unique prompts")


if __name__ == "__main__":
    main()
