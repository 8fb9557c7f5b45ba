"""The LM head at Gemma 4 E2B's width on CPU: the fused head (vocabulary blocks, online log-sum-exp) against the
row-blocked one (whole rows of logits, then logsumexp), and the bytes each scored token costs the head.

    python benchmarks/bench_head.py              # 512 scored tokens, hidden 1536, vocabulary 262,144, fp32
    python benchmarks/bench_head.py --tokens 256

Prints seconds and scored tokens/s of each head (the same call, one warm-up first), both as a share of this
machine's fp32 matmul peak (a (1024, 1536) x (1536, 4096) GEMM, timed here), the largest |Δ logprob| between
them, and the bytes the fused head reads and writes per scored token on CUDA (bf16, blocks of HeadBlocks'
GPU size, 8,192 tokens a call) and on CPU, beside the minimum: the weight's share and one fp32 out
(klpipe/model/head.py, HeadBlocks.bytes_per_token).
"""

from __future__ import annotations

import argparse
import time

import torch

from klpipe.model.head import HeadBlocks, LMHead

VOCAB, HIDDEN, SOFTCAP = 262_144, 1536, 30.0


class _Config:
    final_logit_softcapping = SOFTCAP


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        with torch.no_grad():
            self.lm_head.weight.normal_(0, HIDDEN ** -0.5)

    def get_output_embeddings(self):
        return self.lm_head


def matmul_peak() -> float:
    """FLOP/s of a fp32 GEMM of the head's blocks' shape: the machine's practical fp32 peak."""
    a, b = torch.randn(1024, HIDDEN), torch.randn(HIDDEN, 4096)
    a @ b
    started, runs = time.perf_counter(), 8
    for _ in range(runs):
        a @ b
    return 2.0 * 1024 * HIDDEN * 4096 * runs / (time.perf_counter() - started)


def timed(head: LMHead, hidden, targets) -> tuple[float, torch.Tensor]:
    head.logprobs(hidden[:64], targets[:64])  # warm-up
    started = time.perf_counter()
    out = head.logprobs(hidden, targets)
    return time.perf_counter() - started, out


def bytes_table(blocks: HeadBlocks, n: int, weight_bytes: int, where: str) -> str:
    f = blocks.bytes_per_token(n, VOCAB, HIDDEN, weight_bytes)
    return (f"{where:<34}{blocks.rows:>6} x {blocks.vocab:<6}{f['weight'] / 1e3:>10,.1f}{f['hidden'] / 1e3:>10,.1f}"
            f"{f['out']:>6.0f}{f['memory'] / 1e3:>11,.1f}{f['minimum'] / 1e3:>11,.1f}"
            f"{f['memory'] / f['minimum']:>7.2f}x"
            f"{f['block'] / 1e6:>10,.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = _Model()
    hidden = torch.randn(args.tokens, HIDDEN)
    targets = torch.randint(0, VOCAB, (args.tokens,))
    peak = matmul_peak()
    flops = 2.0 * args.tokens * VOCAB * HIDDEN
    print(f"head at E2B width: {args.tokens} scored tokens, hidden {HIDDEN}, vocabulary {VOCAB:,}, "
          f"softcap {SOFTCAP:g}, "
          f"fp32, {torch.get_num_threads()} threads; fp32 matmul peak here {peak / 1e9:,.0f} GFLOP/s")
    results = {}
    for name, fused in (("row-blocked", False), ("fused", True)):
        head = LMHead(model, _Config(), "cpu", fused=fused)
        seconds, out = timed(head, hidden, targets)
        results[name] = out
        print(f"  {name:<12}{seconds:>8.2f} s{args.tokens / seconds:>10,.0f} tokens/s"
              f"{flops / seconds / peak:>8.0%} of the matmul peak")
    gap = float((results["fused"] - results["row-blocked"]).abs().max())
    print(f"  max |fused - row-blocked| = {gap:.2g}")
    print("\nbytes the fused head reads and writes per scored token (KB; block: MB of fp32 block traffic, which stays "
          "in the L2/L3 when the block fits):")
    print(f"{'':<34}{'block':>15}{'weight':>10}{'hidden':>10}{'out':>6}{'total':>11}{'minimum':>11}{'':>8}"
          f"{'block':>10}")
    print(bytes_table(HeadBlocks.for_device(VOCAB, "cuda"), 8192, 2, "CUDA bf16, 8,192 tokens a call"))
    print(bytes_table(HeadBlocks.for_device(VOCAB, "cuda"), 2048, 2, "CUDA bf16, 2,048 tokens a call"))
    print(bytes_table(HeadBlocks.for_device(VOCAB, "cpu"), args.tokens, 4, f"CPU fp32, {args.tokens:,} tokens a call"))


if __name__ == "__main__":
    main()
