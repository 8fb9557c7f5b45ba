"""The FLOPs a precompute method needs, counted from the model's config: the physical limit of sharing.

Three parts, each counted only where the method really needs it:

    linear     per fed token: 2 x the weights of the body's linear layers (q, k, v, o, the MLP)
    attention  per needed (query, key) pair, layer by layer: 4 x query heads x head dim (QK^T and
               AV). Causal, so a query at position q has q + 1 keys, min(q + 1, window) in a sliding
               layer; pads, re-fed tokens and masked slots are not needed and not counted
    head       per scored response token: 2 x hidden x vocabulary

A method is a list of segments: `context` positions already held as keys and values, then `length`
tokens fed. Running a row whole is one segment from position 0; a prefix tree's node is one segment
continuing its path. Three methods, as `klpipe precompute` takes a chunk:

    per_row       every row whole (--prefix-sharing off, the floor, TRL, a naive loop)
    whole_prompt  identical prompts once, each response continuing its prompt (klpipe before the tree)
    tree          klpipe's own tree (klpipe.precompute.logprobs, as precompute plans it); under auto,
                  rows that share nothing worth a node run whole

Every figure is a float (a day of rows passes 2^53 only at 9 PFLOP; exact enough either way).

    python benchmarks/flops.py build/bench/grpo/llama-8k build/bench/grpo/rollouts-24x8.parquet
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np


@dataclass(frozen=True)
class Flops:
    linear: float = 0.0
    attention: float = 0.0
    head: float = 0.0

    @property
    def total(self) -> float:
        return self.linear + self.attention + self.head

    def __add__(self, other: Flops) -> Flops:
        return Flops(self.linear + other.linear, self.attention + other.attention, self.head + other.head)


@dataclass(frozen=True)
class Layer:
    linear: float  # FLOPs per token through the layer's linear weights: 2 x their size
    attention: float  # FLOPs per (query, key) pair: 4 x query heads x head dim
    window: int | None = None  # a sliding layer's window in tokens (a query sees itself and window - 1 before it)
    skippable: bool = False  # run only on needed positions where the pass skips layers (Gemma 4's KV-shared ones)


@dataclass(frozen=True)
class Segment:
    context: int  # positions before the segment, held as keys and values
    length: int  # tokens fed
    only_last: bool = False  # only the last position's output is needed (a skippable layer runs on it alone)


def causal_pairs(context: int, length: int, window: int | None = None) -> float:
    """(query, key) pairs of queries at positions context .. context + length - 1, causal, within a window."""
    low, high = context + 1, context + length  # each query's number of keys before a window caps it
    if length <= 0:
        return 0.0
    if window is None or high <= window:
        return (low + high) * length / 2
    below = max(0, min(high, window) - low + 1)  # queries whose keys are not capped yet
    capped = length - below
    return (low + low + below - 1) * below / 2 + capped * window


@dataclass(frozen=True)
class ModelFlops:
    layers: tuple[Layer, ...]
    head: float  # FLOPs per scored token: 2 x hidden x vocabulary

    @classmethod
    def from_config(cls, config) -> ModelFlops:
        """A decoder with q, k, v, o projections and a gated MLP (Llama, Mistral, Qwen, Gemma...); `config` is a
        transformers config or a config.json as a dict."""
        c = SimpleNamespace(**config) if isinstance(config, dict) else config
        hidden, heads = c.hidden_size, c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        head_dim = getattr(c, "head_dim", None) or hidden // heads
        attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim  # q and o, k and v
        per_layer = 2.0 * (attention + 3 * hidden * c.intermediate_size)  # + the gated MLP's three
        window = getattr(c, "sliding_window", None) if getattr(c, "use_sliding_window", True) else None
        types = getattr(c, "layer_types", None) or [None] * c.num_hidden_layers
        layers = tuple(Layer(per_layer, 4.0 * heads * head_dim,
                             window if kind in (None, "sliding_attention") else None) for kind in types)
        return cls(layers, 2.0 * hidden * c.vocab_size)

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelFlops:
        return cls.from_config(json.loads((Path(model_dir) / "config.json").read_text()))

    def segment(self, segment: Segment) -> Flops:
        """The linear and attention FLOPs of feeding one segment (its head is counted per scored token)."""
        linear = attention = 0.0
        for layer in self.layers:
            if layer.skippable and segment.only_last:  # the last position alone, over the whole context
                linear += layer.linear
                attention += layer.attention * causal_pairs(segment.context + segment.length - 1, 1, layer.window)
            else:
                linear += layer.linear * segment.length
                attention += layer.attention * causal_pairs(segment.context, segment.length, layer.window)
        return Flops(linear, attention)

    def method(self, segments: Sequence[Segment], scored_tokens: int) -> Flops:
        total = Flops(head=self.head * scored_tokens)
        for segment in segments:
            total = total + self.segment(segment)
        return total


# -- the methods: a chunk's rows as segments --------------------------------------------------------


def _chunks(prompts, responses, chunk_rows: int):
    for start in range(0, len(prompts), chunk_rows):
        yield [(np.asarray(p, dtype=np.int64), np.asarray(r, dtype=np.int64))
               for p, r in zip(prompts[start:start + chunk_rows], responses[start:start + chunk_rows], strict=True)]


def per_row(prompts, responses) -> list[Segment]:
    """Every row whole: its prompt and its response less the last token, which is only a target."""
    return [Segment(0, len(p) + len(r) - 1) for p, r in zip(prompts, responses, strict=True) if len(r)]


def whole_prompt(prompts, responses, chunk_rows: int = 2048) -> list[Segment]:
    """Identical prompts once per chunk, each response continuing its prompt."""
    segments = []
    for chunk in _chunks(prompts, responses, chunk_rows):
        rows = [(p, r) for p, r in chunk if len(r)]
        segments += [Segment(0, len(p)) for p in {tuple(p.tolist()) for p, _ in rows}]
        segments += [Segment(len(p), len(r) - 1) for p, r in rows if len(r) > 1]
    return segments


def tree(prompts, responses, chunk_rows: int = 2048, sharing: str = "auto",
         skips_layers: bool = False) -> list[Segment]:
    """klpipe's plan, chunk by chunk: the tree's nodes, each continuing its path, and the rows that run whole.

    `skips_layers`: a model whose prefill skips layers for positions nobody needs (Gemma 4): every row
    goes through the tree, and prompts are cut into nodes of their own, as precompute does.
    """
    from klpipe.precompute import logprobs, prefix_tree

    model = SimpleNamespace(prefill_skips_layers=skips_layers)  # what the planner asks of a model
    segments = []
    for rows in _chunks(prompts, responses, chunk_rows):
        needed = [np.ones(len(r), dtype=bool) for _, r in rows]  # every response token's logprob
        fed = logprobs._fed(rows, needed, None)  # a RoPE whose frequencies do not follow the row length
        wanted = np.flatnonzero([len(r) > 0 for _, r in rows])
        if sharing == "off":
            segments += [Segment(0, len(fed[i])) for i in wanted]
            continue
        shared, alone = logprobs._worth_a_tree(model, rows, fed, needed, wanted, sharing)
        segments += [Segment(0, len(fed[i])) for i in alone]
        if not len(shared):
            continue
        first = logprobs._first_needed(rows, needed, shared)
        nodes = logprobs.pruned_tree(rows, fed, shared, needed)
        if skips_layers:
            nodes = prefix_tree.split_prefixes(nodes, prefix_tree.needs(nodes, first).lowest)
        only_last = prefix_tree.needs(nodes, first).only_last
        segments += [Segment(int(nodes.start[n]), int(nodes.end[n] - nodes.start[n]),
                             bool(only_last[n] and skips_layers)) for n in range(1, nodes.num_nodes)]
    return segments


def fed_tokens(segments: Sequence[Segment]) -> int:
    return sum(s.length for s in segments)


# -- the machine -------------------------------------------------------------------------------------


def matmul_peak(m: int = 2048, k: int = 256, n: int = 1024, seconds: float = 1.0, dtype: str = "float32",
                device: str = "cpu") -> float:
    """FLOP/s of (m x k) @ (k x n) matmuls, the best of repeated timings over about `seconds` (the defaults:
    the benchmark model's MLP up-projection on a CPU pass of 2,048 tokens). On the threads torch has."""
    import torch

    a = torch.randn(m, k, dtype=getattr(torch, dtype), device=device)
    b = torch.randn(k, n, dtype=getattr(torch, dtype), device=device)
    out = torch.empty(m, n, dtype=a.dtype, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(3):
        torch.mm(a, b, out=out)
    sync()
    best, spent = float("inf"), 0.0
    while spent < seconds:
        started = time.perf_counter()
        for _ in range(10):
            torch.mm(a, b, out=out)
        sync()
        took = (time.perf_counter() - started) / 10
        best, spent = min(best, took), spent + took * 10
    return 2.0 * m * k * n / best


# -- the table the benchmarks print -----------------------------------------------------------------


def print_flops_table(best: dict[str, dict], labels: dict[str, str], methods: dict[str, Flops], peak: tuple[float, str],
                      seconds_key: str = "steady", shape: str = "") -> None:
    """Per contender: the FLOPs its method needs (linear, attention, head), its GFLOP/s over its `seconds_key`
    seconds and that against the matmul peak `(FLOP/s, what was measured)`; then klpipe's speed ratios to
    `off` and the floor beside the FLOP ratios, and one summary line (the issue's table) for `shape`."""
    print(f"\n{'contender':<34}{'GFLOP':>9}{'linear':>9}{'attention':>10}{'head':>8}{'GFLOP/s':>9}{'of peak':>9}")
    for name, result in best.items():
        f = methods[name]
        print(f"{labels[name]:<34}{f.total / 1e9:>9.1f}{f.linear / 1e9:>9.1f}{f.attention / 1e9:>10.1f}"
              f"{f.head / 1e9:>8.1f}{f.total / result[seconds_key] / 1e9:>9.1f}"
              f"{f.total / result[seconds_key] / peak[0]:>9.0%}")
    print(f"machine: fp32 matmul peak {peak[0] / 1e9:.0f} GFLOP/s ({peak[1]})")
    a = best.get("klpipe")
    if not a:
        return
    for other in ("off", "klpipe-off", "floor"):
        if other in best:
            o = best[other]
            speed = o[seconds_key] / a[seconds_key]
            flop_ratio = methods[other].total / methods["klpipe"].total
            goal = "" if other == "floor" else " (goal >= 90%)"
            print(f"klpipe vs {labels[other]}: {speed:.2f}x faster ({seconds_key}); {flop_ratio:.2f}x fewer FLOPs "
                  f"needed: {speed / flop_ratio:.0%} of the FLOP limit{goal}")
    off = next((best[n] for n in ("off", "klpipe-off") if n in best), None)
    if off is not None and shape:
        name = next(n for n in ("off", "klpipe-off") if n in best)
        per_row_fed = off["fed_tokens"]
        tokens, flop_ratio = per_row_fed / a["fed_tokens"], methods[name].total / methods["klpipe"].total
        speed = off[seconds_key] / a[seconds_key]
        floor = f"floor {methods['floor'].total / best['floor'][seconds_key] / 1e9:.0f} / " if "floor" in best else ""
        print(f"| {shape} | {tokens:.1f}x | {flop_ratio:.1f}x | {speed:.2f}x | {speed / flop_ratio:.0%} | "
              f"{floor}off {methods[name].total / off[seconds_key] / 1e9:.0f} / "
              f"klpipe {methods['klpipe'].total / a[seconds_key] / 1e9:.0f} |")
    print("(| shape | tokens: per-row / tree | FLOPs: per-row / tree | klpipe / off | share of the FLOP limit | "
          "GFLOP/s |)")


def main() -> None:
    import argparse

    import pyarrow.parquet as pq

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path, help="a directory with config.json")
    parser.add_argument("rollouts", type=Path, help="parquet with prompt_ids and response_ids")
    parser.add_argument("--chunk-rows", type=int, default=2048)
    args = parser.parse_args()
    table = pq.read_table(args.rollouts, columns=["prompt_ids", "response_ids"])
    prompts, responses = table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist()
    model = ModelFlops.from_dir(args.model_dir)
    scored = sum(map(len, responses))
    for name, segments in (("per row", per_row(prompts, responses)),
                           ("whole prompt", whole_prompt(prompts, responses, args.chunk_rows)),
                           ("tree", tree(prompts, responses, args.chunk_rows))):
        f = model.method(segments, scored)
        print(f"{name:<14}{fed_tokens(segments):>10,} tokens fed  {f.total / 1e9:>8.1f} GFLOP  (linear "
              f"{f.linear / 1e9:.1f}, attention {f.attention / 1e9:.1f}, head {f.head / 1e9:.1f})")


if __name__ == "__main__":
    main()
