"""Cascade attention on a sliding-window layer of a tree pass (cascade.py runs the full-attention layers).

A query at position p sees the keys at (p − W, p]. A pass's row continues a context of `cached` positions and
feeds its own tokens after it, slot i at position cached + i, so its attention splits as the full layer's does,
into parts merged by their log-sum-exp, each computing only the pairs it needs:

    own      each row's real slots alone: the first W queries causal (with their log-sum-exp), the rest in
             blocks with a band mask, as packed rows run (packing.band)
    context  only queries at slots i < W − 1 see any of it, and only its last held = min(cached, W − 1) keys:
             query i sees context key j (of those held) iff j ≥ i + held − W + 1. Per run of rows with one
             parent and one context length, over the keys read where they lie (no copy per row), in two
             exact pieces:
                 A  the keys every query sees (the last W − 1 − s1 of them, s1 the last query slot + 1):
                    one unmasked product, all query heads of a KV head stacked
                 B  the rest: query i sees key j iff (held' − 1 − j) ≤ (s1 − 1 − i), which is top-left
                    causal once queries and keys are both reversed: one causal kernel call, no mask

With no window (None), `context` is piece A alone, every query over every key: cascade.py merges a full
layer's context parts through it too. A packed pass (tree.py: the nodes' own tokens end to end, no pad) runs the
same parts per node, full layers included (`attend_packed`). Every piece is one call of lse_attention (a kernel
that returns the log-sum-exp, probed against plain torch), on whatever device the keys are. Where the model keeps
only the last position (Gemma 4's KV-shared layers under logits_to_keep = 1), the one query is slot T − 1 and the
same pieces hold with that offset. Pads (after a row's real slots on the left
layout, before them on the right) are never read as keys; a pad's own output is zeros or a finite mix that
nothing reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from klpipe.model.attention import lse_attention, packing


@dataclass(frozen=True)
class _Real:
    """A row's real slots, first .. first + count - 1; `base`: the slot of its query 0 (not 0 where the model keeps
    only the last slot's query)."""

    first: int
    count: int
    base: int = 0


def attend(contexts, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           scale: float, window: int) -> torch.Tensor:
    """(b, q, H, d_v) attention of query (b, H, q, d) over each row's own real slots of key, value (b, h, T, d) and
    its context (contexts: cascade.PassContexts), within `window`; q = T, or 1 (the last slot's only)."""
    b, heads, queries, _dim = query.shape
    slots = key.shape[2]
    base = slots - queries  # the slot of query 0
    seen = max(0, min(queries, window - 1 - base))  # queries that may see context: slots < window - 1
    out = torch.zeros((b, heads, queries, value.shape[-1]), dtype=torch.float32, device=query.device)
    lse = torch.full((b, heads, seen), float("-inf"), dtype=torch.float32, device=query.device)
    for row in range(b):
        first, count = int(contexts.real[0, row]), int(contexts.real[1, row])
        if not count:
            continue
        _own(query[row:row + 1], key[row:row + 1], value[row:row + 1], _Real(first, count, base), scale,
             window, out[row:row + 1], lse[row:row + 1])
    if seen:
        for rows, nodes, cached in contexts.runs:
            held = min(cached, window - 1)
            keys, values = contexts.read(nodes, cached - held, cached)  # (h, held, d)
            context(query[rows, :, :seen], keys, values, scale, window, base + seen, out[rows, :, :seen], lse[rows])
    return out.transpose(1, 2).to(query.dtype).contiguous()


def attend_packed(contexts, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  scale: float, window: int | None) -> torch.Tensor:
    """(1, N, H, d_v) attention of a packed pass (tree.py): its nodes' own tokens end to end, query (1, H, N, d) and
    key, value (1, h, N, d), node k in slots contexts.segments[0][k] .. + contexts.segments[1][k] - 1, each over its
    own tokens and its context, within `window` if given (None: full attention). No pad anywhere."""
    starts, lengths = contexts.segments
    out = torch.zeros((1, query.shape[1], query.shape[2], value.shape[-1]), dtype=torch.float32,
                      device=query.device)
    lse = torch.full(query.shape[:3], float("-inf"), dtype=torch.float32, device=query.device)
    for start, length in zip(starts, lengths, strict=True):
        span = slice(start, start + length)
        if length:
            _own(query[:, :, span], key[:, :, span], value[:, :, span], _Real(0, length), scale, window,
                 out[:, :, span], lse[:, :, span])
    if window is None:
        # Every query of a part's rows sees all of its keys: their slots are one stretch of the sequence.
        for rows, nodes, stop in contexts.parts:
            keys, values = contexts.read(nodes, None if stop is None else 0, stop)
            if not keys.shape[1]:
                continue
            span = slice(starts[rows.start], starts[rows.stop - 1] + lengths[rows.stop - 1])
            context(query[:, :, span], keys, values, scale, None, 0, out[:, :, span], lse[:, :, span])
    else:
        for rows, nodes, cached in contexts.runs:
            held = min(cached, window - 1)
            keys, values = contexts.read(nodes, cached - held, cached)  # (h, held, d)
            for row in range(rows.start, rows.stop):
                seen = min(lengths[row], window - 1)  # a node's first window - 1 tokens see its context
                if seen:
                    span = slice(starts[row], starts[row] + seen)
                    context(query[:, :, span], keys, values, scale, window, seen, out[:, :, span],
                            lse[:, :, span])
    return out.transpose(1, 2).to(query.dtype).contiguous()


def _own(query, key, value, slots: _Real, scale: float, window: int | None, out, lse) -> None:
    """One row's attention over its real slots, written into out (1, H, q, d_v) fp32, and the log-sum-exp of the
    queries that may see context into lse (1, H, seen)."""
    first, count = slots.first, slots.count
    seen = lse.shape[2]
    real = slice(first, first + count)
    if slots.base:  # the last slot's query alone: it sees the row's last `window` real slots
        assert window is not None, "only a sliding layer's pass (attend) keeps the last slot's query alone"
        if first + count != key.shape[2]:
            raise ValueError("the model kept a last position that is a pad")
        low = max(first, key.shape[2] - window)
        got, got_lse = lse_attention.attend(query, key[:, :, low:], value[:, :, low:], False, scale)
        out.copy_(got)
        lse.copy_(got_lse[:, :, :seen])
        return
    q, k, v = query[:, :, real], key[:, :, real], value[:, :, real]
    head = count if window is None else min(count, window)  # queries that see every real key before them
    got, got_lse = lse_attention.attend(q[:, :, :head], k[:, :, :head], v[:, :, :head], True, scale)
    out[:, :, first:first + head] = got
    if first == 0:  # only a row whose real slots open the pass continues a context
        lse[:, :, :min(seen, head)] = got_lse[:, :, :seen]
    if window is not None and count > window:
        out[:, :, first + window:first + count] = packing.band(q, k, v, scale, window, window)


def context(query, keys, values, scale: float, window: int | None, end: int, out, lse) -> None:
    """Merge into out (r, H, s, d_v) and lse (r, H, s) the attention of query (r, H, s, d), at slots end - s .. end - 1
    of rows continuing the same context, over that context's last keys, values (h, held, d), within `window` (None:
    full attention, every query sees every key: piece A alone). cascade.py merges a full layer's parts here too."""
    r, _heads, _s, _dim = query.shape
    held = keys.shape[1]
    every = held if window is None else min(window - 1 - end, held)  # A: the last keys, seen by every query
    if every > 0:
        # Every query sees every key of A: rows, slots and the query heads of a KV head stack into one product.
        part, part_lse = lse_attention.attend_shared(query, keys[:, held - every:], values[:, held - every:], scale)
        _merge(out, lse, part, part_lse)
    rest = held - max(every, 0)  # B: keys 0 .. rest - 1, query i seeing key j iff rest - 1 - j <= s - 1 - i
    if rest > 0:
        k, v = keys[:, :rest].flip(1), values[:, :rest].flip(1)  # (h, rest, d), the nearest key first
        # Causal, so the rows cannot stack along the queries: each row reads the same (at most window - 1) keys.
        part, part_lse = lse_attention.attend(query.flip(2), k.expand(r, *k.shape), v.expand(r, *v.shape), True,
                                              scale)
        _merge(out, lse, part.flip(2), part_lse.flip(2))


def _merge(out, lse, part, part_lse) -> None:
    """out·e^a + part·e^c over e^a + e^c, in place: out + σ(c − a)·(part − out); lse becomes log(e^a + e^c)."""
    out.lerp_(part.float(), torch.sigmoid(part_lse - lse).unsqueeze(-1))
    lse.copy_(torch.logaddexp(lse, part_lse))
