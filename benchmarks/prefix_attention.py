"""One attention layer over klpipe's own tree passes: the context gathered into every row's slots against cascade.

    python benchmarks/prefix_attention.py build/bench/grpo/rollouts-24x8.parquet
    python benchmarks/prefix_attention.py build/bench/agent/system.parquet --layers 8

For every pass klpipe's planner makes on the rows (precompute's own plan, the CPU budgets), one
attention layer of the benchmark model (4 query heads, 2 KV heads of 64, fp32) runs two ways on the
same random keys, values and queries, each timed over all passes (best of 3):

  gathered  the context copied into left-padded slots per row (context_cache._gather_context), the pass's keys
            after it, GQA's keys repeated, transformers' 4D mask, SDPA: what a tree pass did before
            cascade attention, and what it still does for a layer the cascade does not take
  cascade   klpipe's cascade (model/attention/cascade.py): the rows' queries over their path where it lies, in
            parts (the nodes adjacent runs of rows open with, then each run's rest), stacked per part,
            and over their own keys with the causal kernel, merged by log-sum-exp

Both outputs are checked against naive fp64 softmax attention over each row's explicit keys. Beside
them, for scale, the same rows run whole (`whole`: each row alone over its whole fed sequence, the
causal kernel, as `--prefix-sharing off` and the per-row floor attend), which needs many more pairs.

GFLOP/s counts only the needed (query, key) pairs, 4 × query heads × head size FLOPs each, so the
ways compare as rates of useful work; the cascade's time is split between the kernel's own-part
calls, its context calls, and the rest (joining a path's nodes, stacking, merging).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

HEADS, KV_HEADS, DIM = 4, 2, 64
GROUPS = HEADS // KV_HEADS
SCALE = DIM ** -0.5


def plan(path: Path):
    """(tree, passes) as precompute plans the file's rows on CPU."""
    from types import SimpleNamespace

    import pyarrow.parquet as pq

    from klpipe.precompute import logprobs

    table = pq.read_table(path, columns=["prompt_ids", "response_ids"])
    prompts, responses = table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist()
    rows = [(np.asarray(p, dtype=np.int64), np.asarray(r, dtype=np.int64))
            for p, r in zip(prompts, responses, strict=True)]
    model = SimpleNamespace(prefill_skips_layers=False, rope_length_limit=None, keeps_state=False,
                            state_tokens_per_node=0)
    needed = [np.ones(len(r), dtype=bool) for _, r in rows]  # every response token's logprob
    fed = logprobs._fed(rows, needed, model.rope_length_limit)
    chosen, _ = logprobs._worth_a_tree(model, rows, fed, needed, np.flatnonzero([len(r) > 0 for _, r in rows]), "auto")
    tree, passes, _ = logprobs._plan_tree(model, rows, fed, needed, chosen, logprobs.TreeBudget(2048, 1 << 40, 5e-4))
    return tree, passes


def make_pass(tree, step, kept):
    """A pass in the left layout (each node's own tokens first in its slots, pads after), with random queries,
    keys and values; what later passes read of it is kept as context_cache.py keeps it."""
    from klpipe.model.attention.context_cache import Kept

    nodes = step.nodes.tolist()
    own = tree.end[step.nodes] - tree.start[step.nodes]
    fed = int(own.max())
    q = torch.randn(len(nodes), HEADS, fed, DIM)
    k = torch.randn(len(nodes), KV_HEADS, fed, DIM)
    v = torch.randn(len(nodes), KV_HEADS, fed, DIM)
    for i, node in enumerate(nodes):
        kept[node] = [Kept(keys=k[i, :, :own[i]].clone(), values=v[i, :, :own[i]].clone())]
    ancestors = [tree.path(node)[:-1] for node in nodes]
    return dict(nodes=nodes, own=own, cached=tree.start[step.nodes].copy(), ancestors=ancestors, q=q, k=k, v=v)


def gathered_way(tree, p, kept):
    from klpipe.model.attention.context_cache import _gather_context

    b, fed, context = len(p["nodes"]), int(p["own"].max()), int(p["cached"].max())
    keys, values = p["k"], p["v"]
    if context:
        held_k, held_v = _gather_context(0, context, p["ancestors"], p["cached"], tree, kept)
        keys, values = torch.cat([held_k, keys], dim=-2), torch.cat([held_v, values], dim=-2)
    keys, values = keys.repeat_interleave(GROUPS, dim=1), values.repeat_interleave(GROUPS, dim=1)
    # transformers' 4D mask over the slots: causal, the context's left pads and the fed pads off.
    slot = torch.arange(context + fed)
    query = context + torch.arange(fed)
    real = torch.zeros(b, context + fed, dtype=torch.bool)
    for row in range(b):
        real[row, context - int(p["cached"][row]):context + int(p["own"][row])] = True
    mask = (slot[None, None, :] <= query[None, :, None]) & real[:, None, :]
    mask |= slot[None, None, :] == query[None, :, None]  # a pad query sees itself: no row of -inf alone
    out = F.scaled_dot_product_attention(p["q"], keys, values, attn_mask=mask[:, None], scale=SCALE)
    return out.transpose(1, 2)  # (b, T, H, d), as an attention function returns it


def cascade_way(tree, p, kept):
    from klpipe.model.attention import cascade
    from klpipe.model.attention.context_cache import _context_parts

    return cascade.PassContexts(_context_parts(p["ancestors"]), kept, 0).attend(p["q"], p["k"], p["v"], SCALE)


def whole_way(rows):
    """Each row's whole fed sequence alone, the causal kernel (keys and values repeated per query head)."""
    for q, k, v in rows:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE)


def needed_pairs(p) -> int:
    """(query, key) pairs the pass's real queries need: every context position and the causal own ones."""
    own, context = p["own"].astype(np.int64), p["cached"].astype(np.int64)
    return int((own * context + own * (own + 1) // 2).sum())


def naive(tree, p, kept, row):
    """Row `row`'s real queries over its path's keys and its own, softmax in fp64: (own, H, d)."""
    own = int(p["own"][row])
    path = p["ancestors"][row]
    k = torch.cat([kept[a][0].keys for a in path] + [p["k"][row, :, :own]], dim=1).repeat_interleave(GROUPS, 0)
    v = torch.cat([kept[a][0].values for a in path] + [p["v"][row, :, :own]], dim=1).repeat_interleave(GROUPS, 0)
    scores = p["q"][row, :, :own].double() @ k.double().transpose(-1, -2) * SCALE
    allowed = torch.arange(k.shape[1])[None, :] <= k.shape[1] - own + torch.arange(own)[:, None]
    return (torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v.double()).transpose(0, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rollouts", type=Path)
    parser.add_argument("--layers", type=int, default=1, help="times each pass runs (the model's layers)")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("KLPIPE_BENCH_THREADS", os.cpu_count() or 1)))
    torch.manual_seed(0)
    tree, passes = plan(args.rollouts)
    kept: dict = {}
    prepared = [make_pass(tree, step, kept) for step in passes]
    ways = {"gathered": gathered_way, "cascade": cascade_way}
    gap = dict.fromkeys(ways, 0.0)
    for p in prepared:  # exactness first, on every pass's real queries
        outs = {name: way(tree, p, kept) for name, way in ways.items()}
        for row in range(len(p["nodes"])):
            expected = naive(tree, p, kept, row)
            for name, out in outs.items():
                gap[name] = max(gap[name], float((out[row, :int(p["own"][row])].double() - expected).abs().max()))
    print(f"{args.rollouts.name}: {len(passes)} passes, {sum(len(p['nodes']) for p in prepared)} nodes; one layer "
          f"of {HEADS} query heads and {KV_HEADS} KV heads of {DIM}, fp32, {torch.get_num_threads()} threads")
    pair_flops = 4.0 * HEADS * DIM * args.layers
    tree_pairs = sum(needed_pairs(p) for p in prepared)
    from klpipe.model.attention import cascade

    kernel = cascade._flash
    spent = {"own": 0.0, "context": 0.0}

    def timed_kernel(q, k, v, dropout, causal, scale=None):
        started = time.perf_counter()
        result = kernel(q, k, v, dropout, causal, scale=scale)
        spent["own" if causal else "context"] += time.perf_counter() - started
        return result

    for name, way in ways.items():
        def every_pass(way=way):
            for _ in range(args.layers):
                for p in prepared:
                    way(tree, p, kept)

        if name == "cascade":
            cascade._flash = timed_kernel
        try:
            best, split = fastest_of_three(every_pass, spent)
        finally:
            cascade._flash = kernel
        parts = (f"   (kernel: own {split['own']:.3f}s, context {split['context']:.3f}s; "
                 f"the rest {best - split['own'] - split['context']:.3f}s)" if name == "cascade" else "")
        print(f"  {name:<9} {best:7.3f}s for {args.layers} layer(s), "
              f"{tree_pairs * pair_flops / best / 1e9:5.0f} GFLOP/s "
              f"of needed pairs   max |Δ| against naive fp64 attention {gap[name]:.2e}{parts}")
    whole_rows = [tuple(torch.randn(1, HEADS, int(tree.end[node]), DIM) for _ in range(3))
                  for node in np.unique(tree.end_node[tree.end_node > 0])]  # each distinct row's whole sequence
    whole_pairs = sum(q.shape[2] * (q.shape[2] + 1) // 2 for q, _, _ in whole_rows)
    best, _ = fastest_of_three(lambda: [whole_way(whole_rows) for _ in range(args.layers)])
    print(f"  {'whole':<9} {best:7.3f}s for {args.layers} layer(s), "
          f"{whole_pairs * pair_flops / best / 1e9:5.0f} GFLOP/s "
          f"of needed pairs   ({len(whole_rows)} distinct rows, {whole_pairs / tree_pairs:.1f}x the tree's pairs)")


def fastest_of_three(run, spent: dict | None = None) -> tuple[float, dict]:
    """(the fastest of three timings of `run()`, what `spent` held after that one; `spent` is zeroed before each)."""
    best, split = float("inf"), {}
    for _ in range(3):
        if spent is not None:
            spent.update(dict.fromkeys(spent, 0.0))
        started = time.perf_counter()
        run()
        took = time.perf_counter() - started
        if took < best:
            best, split = took, dict(spent or {})
    return best, split


if __name__ == "__main__":
    main()
