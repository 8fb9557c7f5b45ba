"""Running a chunk's prefix tree (precompute/prefix_tree.py): every node once, continuing its ancestors'
keys and values, with transformers' own attention masks and no per-architecture code.

A pass runs several nodes side by side, aligned at the right so that every row ends at the last
position (a model that skips layers for positions nobody needs, Gemma 4's KV-shared layers, then
skips them for every row alike):

    row:  [ pads | context, from the cache | pads | fed tokens ]
          └──────────── C ───────────────┘ └─────── T ───────┘

The context is a node's path from the root as keys and values that earlier passes computed; the
fed tokens are the node's own tokens. A node shorter than the pass's longest feeds the end of its
context again instead of pads (so nothing ever sits between a context and its tokens); only a
row with too little context to fill T has pads before its fed tokens, and every pad is at the
left. Real tokens are therefore contiguous in the cache's slots, and a sliding window measured in
slots, as transformers measures it, is the window in tokens. Pads carry position 0 and an
attention mask of 0, so no position id ever exceeds a row's real ones (a dynamic or long RoPE picks
its frequencies from the largest position in the batch).

Each node's own keys and values are kept, cut to its real tokens, while any of its descendants is
still to run; `Pass.release` says when they go.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers import Cache, DynamicCache
from transformers.cache_utils import CacheLayerMixin, DummyLayer, DynamicLayer, DynamicSlidingWindowLayer

if TYPE_CHECKING:  # the plan's types: precompute/ plans, model/ runs, and never the other way round
    from klpipe.precompute.prefix_tree import Pass, Tree


@dataclass
class Wanted:
    """The hidden states a chunk's rows need: row r, positions base[r] + j for each response token j that
    needed[r] marks (all of them without a mask), all between first[r] and len(sequence r) - 1."""

    first: np.ndarray  # (rows,) int64 the first needed position, which the planner runs from
    base: np.ndarray  # (rows,) int64 the position that predicts response token 0: the prompt's length − 1
    targets: list[np.ndarray]  # (rows,) the row's response: position base + j predicts targets[j]
    needed: list[np.ndarray] | None = None  # (rows,) bool per response token: the logprobs to compute


def score_tree(reference, tree: Tree, passes: list[Pass], wanted: Wanted, temperature: float = 1.0,
               check_stop=lambda: None) -> list[np.ndarray]:
    """log p(response tokens) of every row of `tree`, each node computed once, as float32 per row."""
    results = [np.full(len(t), np.nan, dtype=np.float32) for t in wanted.targets]
    rows_of = _rows_through(tree)
    kinds = layer_kinds(reference.model)
    kept: dict[int, list] = {}  # node -> per layer (keys, values) of its own tokens, or None
    parent_of_kept = {int(tree.parent[n]) for n in range(1, tree.num_nodes) if tree.parent[n] != 0}
    with torch.inference_mode():
        for step in passes:
            _run_pass(reference, tree, step, kinds, kept, parent_of_kept, rows_of, wanted, temperature, results)
            for node in step.release:
                kept.pop(node, None)
            check_stop()
    return results


# -- one pass ---------------------------------------------------------------------------------------


def _run_pass(reference, tree: Tree, step: Pass, kinds, kept, parents: set, rows_of, wanted: Wanted,
              temperature: float, results: list[np.ndarray]) -> None:
    nodes = step.nodes.tolist()
    start, end = tree.start[step.nodes], tree.end[step.nodes]  # (b,)
    own = end - start
    fed_len = int(own.max())
    cached = np.maximum(start - (fed_len - own), 0)  # (b,) context positions read from the cache
    context = int(cached.max())
    b = len(nodes)
    device = reference.input_device

    ids = np.zeros((b, fed_len), dtype=np.int64)
    positions = np.zeros((b, fed_len), dtype=np.int64)
    mask = np.zeros((b, context + fed_len), dtype=np.int64)
    for k, node in enumerate(nodes):
        fed = tree.tokens(node, start=int(cached[k]))  # the node's tokens, after any end of its context fed again
        ids[k, fed_len - len(fed):] = fed
        positions[k, fed_len - len(fed):] = np.arange(cached[k], end[k])
        mask[k, context - cached[k]:context] = 1
        mask[k, context + fed_len - len(fed):] = 1
    cache = ContextCache(kinds, context, [tree.path(node)[:-1] for node in nodes], cached, tree, kept)
    extra = {}
    if step.only_last and reference.prefill_skips_layers:
        extra["logits_to_keep"] = 1  # the last position is every row's only needed output
    out = reference.body(input_ids=torch.from_numpy(ids).to(device), attention_mask=torch.from_numpy(mask).to(device),
                         position_ids=torch.from_numpy(positions).to(device), use_cache=True,
                         **{reference.cache_argument: cache}, **extra)
    hidden = out.last_hidden_state  # (b, T, H), or (b, 1, H) with logits_to_keep
    for k, node in enumerate(nodes):
        if node in parents:  # descendants continue it: keep its own tokens' keys and values
            kept[node] = cache.new_of(k, int(own[k]))
    _gather_logprobs(reference, tree, step, hidden, rows_of, wanted, temperature, results)


def _gather_logprobs(reference, tree: Tree, step: Pass, hidden: torch.Tensor, rows_of, wanted: Wanted,
                     temperature: float, results: list[np.ndarray]) -> None:
    """The logprobs of every row's needed positions that fall inside this pass's nodes."""
    batch_row, slot, row, position = [], [], [], []
    width = hidden.shape[1]
    for k, node in enumerate(step.nodes.tolist()):
        start, end = int(tree.start[node]), int(tree.end[node])
        for r in rows_of[node]:  # rows whose sequence passes through the node
            low, high = max(int(wanted.first[r]), start), min(len(tree.sequences[r]), end)
            if low >= high:
                continue
            p = np.arange(low, high)
            if wanted.needed is not None:  # a masked token is context only: no head for it
                p = p[wanted.needed[r][p - wanted.base[r]]]
            batch_row.append(np.full(len(p), k))
            slot.append(width - (end - p))
            row.append(np.full(len(p), r))
            position.append(p)
    if not batch_row:
        return
    batch_row, slot, row, position = (np.concatenate(a) for a in (batch_row, slot, row, position))
    # One hidden state per (batch row, slot), read by every target that needs it.
    key = batch_row * width + slot
    unique, which = np.unique(key, return_inverse=True)
    selected = hidden[torch.from_numpy(unique // width).to(hidden.device),
                      torch.from_numpy(unique % width).to(hidden.device)]  # (n, H)
    offset = position - wanted.base[row]  # index into each row's response
    targets = np.array([wanted.targets[r][o] for r, o in zip(row.tolist(), offset.tolist())], dtype=np.int64)
    logprobs = reference.head.logprobs(selected, torch.from_numpy(targets), temperature,
                                       rows=torch.from_numpy(which.astype(np.int64))).numpy()
    for r, o, value in zip(row.tolist(), offset.tolist(), logprobs.tolist()):
        results[r][o] = value


def kv_bytes_per_token(reference) -> int:
    """Bytes of keys and values one token holds in the layers that store them: one token's forward, measured."""
    cache = ContextCache(layer_kinds(reference.model), 0, [[]], np.zeros(1, dtype=np.int64), None, {})
    one = torch.zeros((1, 1), dtype=torch.long, device=reference.input_device)
    with torch.inference_mode():
        reference.body(input_ids=one, attention_mask=torch.ones_like(one), position_ids=torch.zeros_like(one),
                       use_cache=True, **{reference.cache_argument: cache})
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size()
               for kv in cache.new_of(0, 1) if kv is not None for k, v in [kv])


def _rows_through(tree: Tree) -> list[list[int]]:
    """For each node, the rows whose sequence passes through it (and may need positions in it)."""
    through: list[list[int]] = [[] for _ in range(tree.num_nodes)]
    for row, node in enumerate(tree.end_node.tolist()):
        if node >= 0:
            for n in tree.path(node):
                through[n].append(row)
    return through


# -- the cache a pass reads ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerKind:
    kind: str  # "full", "sliding" or "none" (a layer that stores nothing: Gemma 4's KV-shared layers)
    window: int | None = None  # sliding: the window, in tokens


def layer_kinds(model) -> list[LayerKind]:
    """What each decoder layer keeps, as transformers' own DynamicCache lays it out for this config."""
    config = model.config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None)
    kinds = []
    for index, layer in enumerate(DynamicCache(config=model.config).layers):
        if isinstance(layer, DummyLayer):
            kinds.append(LayerKind("none"))
        elif isinstance(layer, DynamicSlidingWindowLayer):
            sliding = layer_types is None or layer_types[index] == "sliding_attention"
            # Chunked attention shares the class; its mask is not a window, so its context stays whole.
            kinds.append(LayerKind("sliding", layer.sliding_window) if sliding else LayerKind("full"))
        elif type(layer) is DynamicLayer:
            kinds.append(LayerKind("full"))
        else:
            raise NotImplementedError(f"a {type(layer).__name__} cache layer (layer {index})")
    return kinds


class ContextLayer(CacheLayerMixin):
    """One layer's context (its rows' ancestors' keys and values, left-padded) plus the pass's own.

    `update` returns context + new, as a cache that had seen the context would, and keeps the new
    keys and values for the nodes to be continued; nothing is written into the context.
    """

    is_compileable = False
    supports_early_init = False

    def __init__(self, keys: torch.Tensor | None, values: torch.Tensor | None, full_length: int, sliding: bool):
        super().__init__()
        self.context_keys, self.context_values = keys, values  # (b, h, c, d), c <= full_length
        self.full_length = full_length  # slots before the fed tokens: the queries' offset
        self.is_sliding = sliding
        self.new: tuple[torch.Tensor, torch.Tensor] | None = None
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass  # built whole in __init__

    def update(self, key_states, value_states, *args, **kwargs):
        self.new = (key_states, value_states)
        if self.context_keys is None:
            return key_states, value_states
        return (torch.cat([self.context_keys, key_states], dim=-2),
                torch.cat([self.context_values, value_states], dim=-2))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        held = 0 if self.context_keys is None else self.context_keys.shape[-2]
        return held + query_length, self.full_length - held  # a sliding layer holds the last slots only

    def get_seq_length(self) -> int:
        return self.full_length

    def get_max_length(self) -> int:
        return -1


class ContextCache(Cache):
    """The transformers Cache a pass reads: each layer's context gathered from the kept nodes."""

    def __init__(self, kinds: list[LayerKind], context: int, ancestors: list[list[int]], cached: np.ndarray,
                 tree: Tree, kept: dict):
        layers = []
        for index, kind in enumerate(kinds):
            if kind.kind == "none":
                layers.append(DummyLayer())
                continue
            # A sliding layer's queries see at most the window's last `window - 1` context slots.
            held = context if kind.kind == "full" else min(context, kind.window - 1)
            keys = values = None
            if held:
                keys, values = _gather_context(index, held, ancestors, cached, tree, kept)
            layers.append(ContextLayer(keys, values, context, sliding=kind.kind == "sliding"))
        super().__init__(layers=layers)

    def new_of(self, row: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Batch row `row`'s last `length` fed tokens' keys and values, per layer (None where none)."""
        kept_row = []
        for layer in self.layers:
            new = getattr(layer, "new", None)
            if new is None:
                kept_row.append(None)
                continue
            keys, values = new  # (b, h, T, d)
            kept_row.append((keys[row, :, keys.shape[-2] - length:].clone(),
                             values[row, :, values.shape[-2] - length:].clone()))
        if all(kv is None for kv in kept_row):
            # A forward that takes its cache under another name drops it silently (**kwargs).
            raise RuntimeError("the model's forward wrote no keys or values into the cache it was given")
        return kept_row


def _gather_context(layer: int, held: int, ancestors: list[list[int]], cached: np.ndarray, tree: Tree,
                    kept: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, h, held, d) keys and values: each row's last `held` context positions, left-padded with zeros."""
    sample_keys, sample_values = next(kept[a][layer] for path in ancestors for a in path if kept[a][layer] is not None)
    heads, dim, device = sample_keys.shape[0], sample_keys.shape[-1], sample_keys.device
    keys = torch.zeros((len(ancestors), heads, held, dim), dtype=sample_keys.dtype, device=device)
    values = torch.zeros((len(ancestors), heads, held, sample_values.shape[-1]), dtype=sample_values.dtype,
                         device=device)
    for row, path in enumerate(ancestors):
        stop = int(cached[row])  # context positions 0..stop-1 come from the cache
        first = max(stop - held, 0)
        for node in path:
            low, high = max(int(tree.start[node]), first), min(int(tree.end[node]), stop)
            if low >= high:
                continue
            node_keys, node_values = kept[node][layer]  # (h, own length, d), on this layer's device
            at = held - (stop - low)  # slot of position `low`, counted from the left of the held slots
            keys[row, :, at:at + high - low] = node_keys[:, low - tree.start[node]:high - tree.start[node]]
            values[row, :, at:at + high - low] = node_values[:, low - tree.start[node]:high - tree.start[node]]
    return keys, values
