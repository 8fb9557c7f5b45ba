"""Attention over a shared prefix without copying it per row: today's gather + masked SDPA against cascade attention.

    python benchmarks/prefix_attention.py build/bench/grpo/rollouts-24x8.parquet
    python benchmarks/prefix_attention.py build/bench/agent/system.parquet --layers 8

For every pass klpipe's planner makes on the rows (precompute's own plan, the CPU budgets), one
attention layer of the benchmark model (4 query heads, 2 KV heads of 64, fp32) runs several ways on the
same random keys, values and queries, and each is timed over all passes (best of 3):

  gather   klpipe today (model/tree.py): each row's context copied into left-padded slots, the
           pass's keys and values concatenated after it, GQA's keys repeated, a 4D mask, SDPA
  lower    the same slots, but a causal-lower-right bias in place of the mask (no mask built)
  cascade  no copies: every row's queries attend to each of its ancestors' kept keys and values
           where they lie (one matrix product per ancestor, all query heads of a KV head stacked),
           and to the pass's own tokens with the causal kernel; the parts are merged by
           log-sum-exp (Hydragen, Juravsky et al. 2024; FlashInfer's cascade attention)

  flash    cascade with torch's CPU flash kernel for both parts (it returns the log-sum-exp), a row's
           own slots moved to the front so the causal kernel needs no mask
  batched  flash, over today's gathered slots, without a per-row loop: one causal call over every
           row's own slots, one call over the contexts with their pads masked, one merge

Every way's output is checked against a naive fp32 per-row softmax attention (max |Δ| printed). The
FLOPs each needs are the (query, key) pairs it computes x 4 x query heads x head dim.
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
    rows = [(np.asarray(p, dtype=np.int64), np.asarray(r, dtype=np.int64))
            for p, r in zip(table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist())]
    model = SimpleNamespace(prefill_skips_layers=False, rope_length_limit=None, keeps_state=False, state_tokens_per_node=0)
    needed = [np.ones(len(r), dtype=bool) for _, r in rows]  # every response token's logprob
    fed = logprobs._fed(rows, needed)
    chosen, _ = logprobs._worth_a_tree(model, rows, fed, needed, np.flatnonzero([len(r) > 0 for _, r in rows]), "auto")
    tree, passes, _ = logprobs._plan_tree(model, rows, fed, needed, chosen, 2048, 1 << 40, attention=5e-4)
    return tree, passes


def make_pass(tree, step, kept):
    """The pass's alignment as model/tree.py makes it, and its new keys, values and queries (random)."""
    start, end = tree.start[step.nodes], tree.end[step.nodes]
    own = end - start
    fed = int(own.max())
    cached = np.maximum(start - (fed - own), 0)  # context positions read from the cache
    b = len(own)
    q = torch.randn(b, HEADS, fed, DIM)
    k = torch.randn(b, KV_HEADS, fed, DIM)
    v = torch.randn(b, KV_HEADS, fed, DIM)
    for i, node in enumerate(step.nodes.tolist()):  # what later passes read: the node's own tokens
        kept[node] = (k[i, :, fed - own[i]:].clone(), v[i, :, fed - own[i]:].clone())
    return dict(nodes=step.nodes.tolist(), own=own, cached=cached, fed=fed, q=q, k=k, v=v)


def ancestors_of(tree, node):
    return tree.path(node)[:-1]


def gather_way(tree, p, kept, lower_right=False):
    """model/tree.py's way: contexts copied into left-padded slots, concatenated with the new, repeat_kv, mask."""
    b, fed, context = len(p["nodes"]), p["fed"], int(p["cached"].max())
    keys = torch.zeros(b, KV_HEADS, context, DIM)
    values = torch.zeros(b, KV_HEADS, context, DIM)
    for row, node in enumerate(p["nodes"]):
        stop = int(p["cached"][row])
        for a in ancestors_of(tree, node):
            low, high = int(tree.start[a]), min(int(tree.end[a]), stop)
            if low >= high:
                continue
            at = context - (stop - low)
            keys[row, :, at:at + high - low] = kept[a][0][:, :high - low]
            values[row, :, at:at + high - low] = kept[a][1][:, :high - low]
    keys = torch.cat([keys, p["k"]], dim=-2).repeat_interleave(GROUPS, dim=1)
    values = torch.cat([values, p["v"]], dim=-2).repeat_interleave(GROUPS, dim=1)
    if lower_right:  # only right for rows whose slots are all real: used to time the kernel alone
        from torch.nn.attention.bias import causal_lower_right

        return F.scaled_dot_product_attention(p["q"], keys, values, attn_mask=causal_lower_right(fed, context + fed))
    mask = torch.zeros(b, context + fed, dtype=torch.bool)  # real slots: the context's, then the fed ones
    for row, node in enumerate(p["nodes"]):
        n_fed = int(p["own"][row]) + int(tree.start[node]) - int(p["cached"][row])  # a re-fed context end included
        mask[row, context - p["cached"][row]:context] = True
        mask[row, context + fed - n_fed:] = True
    # The 4D mask transformers builds: causal over the slots, and the padding columns off.
    slots = torch.arange(context + fed)
    query_slot = (context + torch.arange(fed))[:, None]
    full = (slots[None, :] <= query_slot)[None] & mask[:, None, :]  # (b, fed, slots)
    full |= (slots[None, :] == query_slot)[None]  # a pad query sees itself: no row of -inf only
    return F.scaled_dot_product_attention(p["q"], keys, values, attn_mask=full[:, None])


def _attend(q, k, v):
    """(out, lse) of softmax attention without a mask: q (h, n, d), k and v (h, m, d)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * SCALE  # (h, n, m)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.matmul(torch.exp(scores - lse), v), lse


def cascade_way(tree, p, kept):
    """No copies: each row's queries over each ancestor's kept keys where they lie, plus the causal suffix,
    merged by log-sum-exp. The suffix is the pass's own slots (a re-fed context end included), which the
    ancestors' part then leaves out."""
    q = p["q"]  # (b, H, T, d)
    b, _, fed, _ = q.shape
    # Suffix: the pass's own slots, causal; a row's left pads sit before its real tokens, so mask them.
    k = p["k"].repeat_interleave(GROUPS, dim=1)
    v = p["v"].repeat_interleave(GROUPS, dim=1)
    real = torch.zeros(b, fed, dtype=torch.bool)
    for row in range(b):
        real[row, fed - (p["own"][row] + int(tree.start[p["nodes"][row]]) - int(p["cached"][row])):] = True
    causal = torch.ones(fed, fed, dtype=torch.bool).tril()
    mask = (causal[None] & real[:, None, :]) | torch.eye(fed, dtype=torch.bool)[None]
    scores = torch.matmul(q, k.transpose(-1, -2)) * SCALE
    scores.masked_fill_(~mask[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # (b, H, T, 1)
    out = torch.matmul(torch.exp(scores - lse), v)
    for row, node in enumerate(p["nodes"]):
        stop = int(p["cached"][row])
        grouped = q[row].reshape(KV_HEADS, GROUPS * fed, DIM)  # a KV head's query heads stacked
        for a in ancestors_of(tree, node):
            high = min(int(tree.end[a]), stop) - int(tree.start[a])
            if high <= 0:
                continue
            part, part_lse = _attend(grouped, kept[a][0][:, :high], kept[a][1][:, :high])
            part, part_lse = part.reshape(HEADS, fed, DIM), part_lse.reshape(HEADS, fed, 1)
            merged = torch.logaddexp(lse[row], part_lse)
            out[row] = out[row] * torch.exp(lse[row] - merged) + part * torch.exp(part_lse - merged)
            lse[row] = merged
    return out


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # (out, logsumexp), the kernel SDPA runs


def cascade_flash_way(tree, p, kept):
    """cascade with the flash kernel for both parts: each row's fed slots moved to the left (pads after them,
    so `is_causal` is exact on the suffix), and every ancestor's part unmasked; merged by log-sum-exp."""
    q, k, v = p["q"], p["k"], p["v"]
    b, _, fed, _ = q.shape
    n_fed = [int(p["own"][r]) + int(tree.start[n]) - int(p["cached"][r]) for r, n in enumerate(p["nodes"])]
    if all(n == fed for n in n_fed):
        ql, kl, vl = q, k, v
    else:  # the row's real slots first
        ql, kl, vl = (torch.stack([t[r].roll(n - fed, dims=-2) for r, n in enumerate(n_fed)]) for t in (q, k, v))
    out, lse = _flash(ql, kl.repeat_interleave(GROUPS, dim=1), vl.repeat_interleave(GROUPS, dim=1), 0.0, True)[:2]
    lse = lse.unsqueeze(-1)  # (b, H, T, 1)
    for row, node in enumerate(p["nodes"]):
        stop = int(p["cached"][row])
        grouped = ql[row].reshape(1, KV_HEADS, GROUPS * fed, DIM)
        for a in ancestors_of(tree, node):
            high = min(int(tree.end[a]), stop) - int(tree.start[a])
            if high <= 0:
                continue
            part, part_lse = _flash(grouped, kept[a][0][None, :, :high], kept[a][1][None, :, :high], 0.0, False)[:2]
            part, part_lse = part.reshape(HEADS, fed, DIM), part_lse.reshape(HEADS, fed, 1)
            merged = torch.logaddexp(lse[row], part_lse)
            out[row] = out[row] * torch.exp(lse[row] - merged) + part * torch.exp(part_lse - merged)
            lse[row] = merged
    if ql is not q:  # back where the model's layout has them
        out = torch.stack([out[r].roll(fed - n, dims=-2) for r, n in enumerate(n_fed)])
    return out


def batched_way(tree, p, kept):
    """cascade over today's gathered slots, batched: one causal flash call over every row's own slots (moved
    to the front of the row), one flash call over the contexts (their pads masked), merged by log-sum-exp.
    No per-row loop; the context is still gathered (its copy is a few percent of a pass)."""
    b, fed, context = len(p["nodes"]), p["fed"], int(p["cached"].max())
    keys = torch.zeros(b, KV_HEADS, context, DIM)
    values = torch.zeros(b, KV_HEADS, context, DIM)
    for row, node in enumerate(p["nodes"]):
        stop = int(p["cached"][row])
        for a in ancestors_of(tree, node):
            low, high = int(tree.start[a]), min(int(tree.end[a]), stop)
            if low >= high:
                continue
            at = context - (stop - low)
            keys[row, :, at:at + high - low] = kept[a][0][:, :high - low]
            values[row, :, at:at + high - low] = kept[a][1][:, :high - low]
    key, value = torch.cat([keys, p["k"]], dim=-2), torch.cat([values, p["v"]], dim=-2)
    real_fed = np.array([int(p["own"][r]) + int(tree.start[n]) - int(p["cached"][r]) for r, n in enumerate(p["nodes"])])
    out = _cascade(p["q"], key, value, np.asarray(p["cached"], dtype=np.int64), real_fed, SCALE)
    return out.transpose(1, 2)  # (b, H, T, d), as the other ways return


def _cascade(query, key, value, context_held: np.ndarray, fed_real: np.ndarray, scaling: float) -> torch.Tensor:
    """(b, T, H, d) attention of query (b, H, T, d) over key, value (b, h, C + T, d) laid out as a tree pass."""
    from types import SimpleNamespace

    layout = SimpleNamespace(context=context_held, fed=fed_real)
    b, heads, fed, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    context = key.shape[2] - fed
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    # Own slots first: each row's real fed slots moved to the front (a roll per row, as one gather), so
    # the causal kernel needs no mask: a real query sees real slots only, the pads now after it.
    own_q, own_k, own_v = query, key[:, :, context:], value[:, :, context:]
    shifted = bool((layout.fed != fed).any())
    if shifted:
        slot = torch.arange(fed)
        source = (slot[None, :] + torch.from_numpy(fed - layout.fed)[:, None]) % fed  # (b, T) fed slot of each
        own_q, own_k, own_v = (t.gather(2, source[:, None, :, None].expand(-1, t.shape[1], -1, dim).to(t.device))
                               for t in (own_q, own_k, own_v))
    if groups > 1:
        own_k, own_v = own_k.repeat_interleave(groups, dim=1), own_v.repeat_interleave(groups, dim=1)
    out, lse = flash(own_q, own_k, own_v, 0.0, True, scale=scaling)[:2]  # (b, H, T, d), (b, H, T)

    if context and layout.context.any():
        # The context: every query of a row sees each of its real context slots (right-aligned before
        # the fed ones); all query heads of a KV head stacked into one product. A row with no context
        # sees a slot of it here and gets no weight below.
        held = torch.from_numpy(np.maximum(layout.context, 1))
        pads = torch.arange(context)[None, :] < (context - held)[:, None]  # (b, C)
        mask = None
        if pads.any():
            mask = torch.zeros(b, 1, 1, context, dtype=query.dtype).masked_fill(pads[:, None, None], float("-inf"))
            mask = mask.to(query.device)
        part, part_lse = flash(own_q.reshape(b, kv_heads, groups * fed, dim), key[:, :, :context],
                               value[:, :, :context], 0.0, False, attn_mask=mask, scale=scaling)[:2]
        part, part_lse = part.reshape(b, heads, fed, dim), part_lse.reshape(b, heads, fed)
        none = torch.from_numpy(layout.context == 0).to(query.device)[:, None, None]
        part_lse = part_lse.masked_fill(none, float("-inf"))
        merged = torch.logaddexp(lse, part_lse)
        out = out * torch.exp(lse - merged).unsqueeze(-1) + part * torch.exp(part_lse - merged).unsqueeze(-1)
    if shifted:  # back to the pass's slots
        back = (slot[None, :] - torch.from_numpy(fed - layout.fed)[:, None]) % fed
        out = out.gather(2, back[:, None, :, None].expand(-1, heads, -1, dim).to(out.device))
    return out.transpose(1, 2).contiguous()


def naive(tree, p, kept, row):
    """Row `row`'s real queries over its real keys, softmax in fp32, one head at a time."""
    node = p["nodes"][row]
    own, stop, fed = int(p["own"][row]), int(p["cached"][row]), p["fed"]
    n_fed = own + int(tree.start[node]) - stop  # the row's fed slots: a re-fed context end, then its tokens
    parts_k = [kept[a][0][:, :min(int(tree.end[a]), stop) - int(tree.start[a])] for a in ancestors_of(tree, node)
               if min(int(tree.end[a]), stop) > int(tree.start[a])]
    parts_v = [kept[a][1][:, :min(int(tree.end[a]), stop) - int(tree.start[a])] for a in ancestors_of(tree, node)
               if min(int(tree.end[a]), stop) > int(tree.start[a])]
    k = torch.cat(parts_k + [p["k"][row, :, fed - n_fed:]], dim=1).repeat_interleave(GROUPS, dim=0)
    v = torch.cat(parts_v + [p["v"][row, :, fed - n_fed:]], dim=1).repeat_interleave(GROUPS, dim=0)
    q = p["q"][row, :, fed - n_fed:]
    scores = q @ k.transpose(-1, -2) * SCALE
    causal = torch.arange(k.shape[1])[None, :] <= (k.shape[1] - n_fed + torch.arange(n_fed))[:, None]
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v, n_fed


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
    ways = {"gather": lambda p: gather_way(tree, p, kept), "cascade": lambda p: cascade_way(tree, p, kept),
            "flash": lambda p: cascade_flash_way(tree, p, kept), "batched": lambda p: batched_way(tree, p, kept)}
    timed_only = {"lower": lambda p: gather_way(tree, p, kept, lower_right=True)}
    gap = {name: 0.0 for name in ways}
    for p in prepared:  # exactness first, on every pass's real queries
        outs = {name: way(p) for name, way in ways.items()}
        for row in range(len(p["nodes"])):
            expected, n_fed = naive(tree, p, kept, row)
            for name, out in outs.items():
                gap[name] = max(gap[name], float((out[row, :, p["fed"] - n_fed:] - expected).abs().max()))
    print(f"{args.rollouts.name}: {len(passes)} passes, {sum(len(p['nodes']) for p in prepared)} nodes; one layer "
          f"of {HEADS} query heads and {KV_HEADS} KV heads of {DIM}, fp32, {torch.get_num_threads()} threads")
    for name, way in {**ways, **timed_only}.items():
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            for _ in range(args.layers):
                for p in prepared:
                    way(p)
            best = min(best, time.perf_counter() - started)
        check = f"max |Δ| against the naive per-row attention {gap[name]:.2e}" if name in gap else "(timing only)"
        print(f"  {name:<8} {best:7.3f}s for {args.layers} layer(s)   {check}")


if __name__ == "__main__":
    main()
