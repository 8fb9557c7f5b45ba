"""Running a chunk's prefix tree (precompute/prefix_tree.py): every node once, continuing its ancestors'
state, with transformers' own attention masks and no per-architecture code.

What a layer continues a prefix from depends on its kind, and one table says how (`CONTINUATIONS`):
an attention layer from the keys and values of every context position it can see, a linear-attention,
SSM or short-convolution layer from its recurrent state and convolution window at the prefix's last
token, a KV-shared layer from nothing of its own.

A pass runs several nodes side by side in one of two layouts (`pass_layout`):

    left  (the default):  [ pads | context, from the cache | fed tokens | pads ]
    right (Gemma 4):      [ pads | context, from the cache | pads | fed tokens ]
                          └──────────── C ───────────────┘ └─────── T ───────┘

The context is a node's path from the root, as the state that earlier passes computed; the fed
tokens are the node's own. On the left, each node feeds exactly its own tokens, straight after its
context, and shorter nodes end in pads that no earlier position sees (every layer is causal). A
recurrent layer's state is taken at the end of the pass, so a node that others continue must be as
long as its pass's longest (the planner's `exact_ends`); pads never enter a state. On the right,
every row ends at the last position, so that a model that skips layers for positions nobody needs
(Gemma 4's KV-shared layers) skips them for every row alike: a node shorter than the pass's longest
feeds the end of its context again instead of pads, and only a row with too little context to fill T
has pads before its fed tokens. That layout is for attention-only models: re-fed tokens would advance a
recurrent state twice. In both, real tokens are contiguous in the cache's slots, so a sliding window
or an attention chunk measured in slots, as transformers measures them, is the window in tokens. Pads
carry position 0 and an attention mask of 0, so no position id ever exceeds a row's real ones (a
dynamic or long RoPE picks its frequencies from the largest position in the batch).

Each node's own state is kept (keys and values cut to its real tokens) while any of its descendants
is still to run; `Pass.release` says when it goes.

Where the model runs sdpa on CPU in the left layout, a full-attention layer does not gather its context
into the pass's slots at all: cascade.py's attention reads the kept keys and values of each row's path
where they lie, in parts (`_context_parts`, `ContextLayer.cascade`), and only a call it cannot take
exactly gets them gathered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers import Cache
from transformers.cache_utils import CacheLayerMixin, DummyLayer, LinearAttentionLayer, get_layer_types_and_kwargs

from klpipe.model import cascade

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
    if reference.cascade:
        try:
            return _score_tree(reference, tree, passes, wanted, temperature, check_stop)
        except cascade.NotInPlace:
            # A model that attends over what it makes of its cache (DeepSeek's MLA latents) gets its context
            # gathered, as transformers' own sdpa reads it; nothing computed so far is kept.
            reference.drop_cascade()
    return _score_tree(reference, tree, passes, wanted, temperature, check_stop)


def _score_tree(reference, tree: Tree, passes: list[Pass], wanted: Wanted, temperature: float,
                check_stop) -> list[np.ndarray]:
    results = [np.full(len(t), np.nan, dtype=np.float32) for t in wanted.targets]
    rows_of = _rows_through(tree)
    kinds = reference.layer_kinds
    layout = pass_layout(reference)
    kept: dict[int, list[Kept]] = {}  # node -> per layer, the state its own tokens leave
    parent_of_kept = {int(tree.parent[n]) for n in range(1, tree.num_nodes) if tree.parent[n] != 0}
    with torch.inference_mode():
        for step in passes:
            _run_pass(reference, tree, step, kinds, layout, kept, parent_of_kept, rows_of, wanted, temperature,
                      results)
            for node in step.release:
                kept.pop(node, None)
            check_stop()
    return results


def pass_layout(reference) -> str:
    """"right" where the model skips layers for positions nobody needs (every row must end at the last position),
    "left" otherwise (each node feeds exactly its own tokens): see the module's docstring."""
    return "right" if reference.prefill_skips_layers and not reference.keeps_state else "left"


# -- one pass ---------------------------------------------------------------------------------------


def _run_pass(reference, tree: Tree, step: Pass, kinds, layout: str, kept, parents: set, rows_of, wanted: Wanted,
              temperature: float, results: list[np.ndarray]) -> None:
    nodes = step.nodes.tolist()
    start, end = tree.start[step.nodes], tree.end[step.nodes]  # (b,)
    own = end - start
    fed_len = int(own.max())
    # Context positions read from the cache; on the right, a short node feeds the end of its context again.
    cached = np.maximum(start - (fed_len - own), 0) if layout == "right" else start.copy()  # (b,)
    context = int(cached.max())
    b = len(nodes)
    device = reference.input_device

    ids = np.zeros((b, fed_len), dtype=np.int64)
    positions = np.zeros((b, fed_len), dtype=np.int64)
    mask = np.zeros((b, context + fed_len), dtype=np.int64)
    first = np.zeros(b, dtype=np.int64)  # the slot of each node's first own token among the fed ones
    for k, node in enumerate(nodes):
        fed = tree.tokens(node, start=int(cached[k]))  # the node's tokens, after any end of its context fed again
        at = fed_len - len(fed) if layout == "right" else 0
        ids[k, at:at + len(fed)] = fed
        positions[k, at:at + len(fed)] = np.arange(cached[k], end[k])
        mask[k, context - cached[k]:context] = 1
        mask[k, context + at:context + at + len(fed)] = 1
        first[k] = at + start[k] - cached[k]
    in_place = reference.cascade and layout == "left"
    cache = ContextCache(kinds, context, [tree.path(node)[:-1] for node in nodes], cached, tree, kept, in_place)
    extra = {}
    if step.only_last and reference.prefill_skips_layers and layout == "right":
        extra["logits_to_keep"] = 1  # the last position is every row's only needed output
    with cascade.active(cache):
        out = reference.body(input_ids=torch.from_numpy(ids).to(device),
                             attention_mask=torch.from_numpy(mask).to(device),
                             position_ids=torch.from_numpy(positions).to(device), use_cache=True,
                             **{reference.cache_argument: cache}, **extra)
    if any(getattr(layer, "pending", False) for layer in cache.layers):
        raise cascade.NotInPlace("a layer's update handed back keys that no attention call of ours read")
    hidden = out.last_hidden_state  # (b, T, H), or (b, 1, H) with logits_to_keep
    for k, node in enumerate(nodes):
        if node in parents:  # descendants continue it: keep the state its own tokens leave
            kept[node] = cache.state_of(k, int(first[k]), int(own[k]), fed_len)
    slot_of_start = first - (fed_len - hidden.shape[1])  # hidden's slot of each node's first own token
    _gather_logprobs(reference, tree, step, hidden, slot_of_start, rows_of, wanted, temperature, results)


def _gather_logprobs(reference, tree: Tree, step: Pass, hidden: torch.Tensor, slot_of_start: np.ndarray, rows_of,
                     wanted: Wanted, temperature: float, results: list[np.ndarray]) -> None:
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
            slot.append(slot_of_start[k] + p - start)
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


@dataclass(frozen=True)
class CacheCost:
    """What the tree keeps for a node, in bytes: keys and values per token, and recurrent and convolution
    states per node, whatever its length."""

    kv_bytes_per_token: int
    state_bytes_per_node: int


def cache_cost(reference) -> CacheCost:
    """Bytes one token holds as keys and values, and one node as states: one token's forward, measured."""
    cache = ContextCache(reference.layer_kinds, 0, [[]], np.zeros(1, dtype=np.int64), None, {})
    one = torch.zeros((1, 1), dtype=torch.long, device=reference.input_device)
    with torch.inference_mode():
        reference.body(input_ids=one, attention_mask=torch.ones_like(one), position_ids=torch.zeros_like(one),
                       use_cache=True, **{reference.cache_argument: cache})
    kept = cache.state_of(0, 0, 1, 1)
    return CacheCost(sum(layer.kv_bytes() for layer in kept), sum(layer.state_bytes() for layer in kept))


def _rows_through(tree: Tree) -> list[list[int]]:
    """For each node, the rows whose sequence passes through it (and may need positions in it)."""
    through: list[list[int]] = [[] for _ in range(tree.num_nodes)]
    for row, node in enumerate(tree.end_node.tolist()):
        if node >= 0:
            for n in tree.path(node):
                through[n].append(row)
    return through


# -- what each kind of layer continues a prefix from -------------------------------------------------------


@dataclass(frozen=True)
class Continuation:
    """What a layer needs of a prefix to continue it exactly."""

    keys_values: str | None = None  # "full" or "sliding": the keys and values of the context positions it sees
    state: bool = False  # its recurrent state and convolution window at the context's last token
    cascade: bool = False  # plain causal attention over every context position: cascade.py may attend in place


# transformers' cache layer types (cache_utils.get_layer_types_and_kwargs, as DynamicCache lays out a config),
# and how each continues a prefix. A type not here has no tree: --prefix-sharing auto runs rows whole.
CONTINUATIONS = {
    "full_attention": Continuation(keys_values="full", cascade=True),
    "sliding_attention": Continuation(keys_values="sliding"),  # the last window - 1 positions
    # Llama 4: the chunk mask is not a window; the context stays whole and the mask picks the chunk.
    "chunked_attention": Continuation(keys_values="full"),
    "dummy": Continuation(),  # Gemma 4's KV-shared layers, Nemotron-H's MLP layers: nothing of their own
    # Gated DeltaNet (Qwen3.5, Qwen3-Next), Mamba-2 (Nemotron-H): a recurrent state and a convolution window.
    "linear_attention": Continuation(state=True),
    "conv": Continuation(state=True),  # LFM2's short convolutions: a convolution window
    "hybrid": Continuation(keys_values="full", state=True, cascade=True),  # Falcon-H1: attention and Mamba-2
    "hybrid_sliding": Continuation(keys_values="sliding", state=True),
}


# Recurrent layers whose own code continues no state over several tokens, and transformers types as
# "linear_attention" all the same: the tree refuses them by name (under auto their rows run whole).
NO_CONTINUATION = {
    # Their scan over more than one token starts from a zero state: only a one-token step reads the state.
    "MambaMixer": "Mamba-1 SSM layers, whose scan over several tokens starts from a zero state",
    "FalconMambaMixer": "Mamba-1 SSM layers, whose scan over several tokens starts from a zero state",
    "JambaMambaMixer": "Mamba-1 SSM layers, whose scan over several tokens starts from a zero state",
    "MiniMaxLightningAttention": "lightning-attention layers, which keep their state in a cache of their own",
    "RecurrentGemmaRecurrentBlock": "RG-LRU recurrent layers, which keep their state in the layers themselves",
}


@dataclass(frozen=True)
class LayerKind:
    continuation: Continuation
    window: int | None = None  # sliding: the window, in tokens
    states: int = 1  # recurrent and convolution states the layer keeps (transformers' number_of_states)


class UnknownLayer(NotImplementedError):
    """A cache layer type the prefix tree does not know how to continue."""


def layer_kinds(model) -> list[LayerKind]:
    """How each decoder layer continues a prefix, from the layer types transformers' DynamicCache reads off
    the config; a type not in CONTINUATIONS, or a layer in NO_CONTINUATION, raises UnknownLayer."""
    for module in model.modules():
        if type(module).__name__ in NO_CONTINUATION:
            raise UnknownLayer(f"the prefix tree cannot continue {NO_CONTINUATION[type(module).__name__]} "
                               f"({type(module).__name__})")
    config = model.config.get_text_config(decoder=True)
    types, kwargs = get_layer_types_and_kwargs(config)
    kinds = []
    for index, (kind, extra) in enumerate(zip(types, kwargs)):
        if kind not in CONTINUATIONS:
            raise UnknownLayer(f"the prefix tree does not know how a {kind!r} cache layer (layer {index}) "
                               "continues a prefix")
        continuation = CONTINUATIONS[kind]
        window = extra.get("sliding_window") if continuation.keys_values == "sliding" else None
        kinds.append(LayerKind(continuation, window, int(extra.get("number_of_states", 1))))
    return kinds


# -- the cache a pass reads ---------------------------------------------------------------------------


@dataclass
class Kept:
    """One layer's state after a node's own tokens: what its descendants continue from."""

    keys: torch.Tensor | None = None  # (h, own length, d)
    values: torch.Tensor | None = None  # (h, own length, d_v)
    states: tuple | None = None  # per state index, (convolution window (C, K) or None, recurrent state or None)

    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values) if t is not None)

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.states or () for t in pair if t is not None)


class ContextLayer(CacheLayerMixin):
    """One layer's context (its rows' ancestors' keys and values, left-padded) plus the pass's own.

    `update` returns context + new, as a cache that had seen the context would, and keeps the new
    keys and values for the nodes to be continued; nothing is written into the context.
    """

    is_compileable = False
    supports_early_init = False

    def __init__(self, keys: torch.Tensor | None, values: torch.Tensor | None, full_length: int, sliding: bool,
                 cascade=None, gather=None, held: int = 0):
        CacheLayerMixin.__init__(self)
        self.context_keys, self.context_values = keys, values  # (b, h, c, d), c <= full_length
        self.full_length = full_length  # slots before the fed tokens: the queries' offset
        self.is_sliding = sliding
        self.held = held if keys is None else keys.shape[-2]  # context slots the mask covers
        self.new: tuple[torch.Tensor, torch.Tensor] | None = None
        self.is_initialized = True
        # With a cascade (cascade.PassContexts), `update` hands back the pass's own keys alone and the
        # attention function reads the context where it lies; `gather` makes the slots for a call it cannot take.
        self.cascade, self.gather, self.pending = cascade, gather, False

    def lazy_initialization(self, *args, **kwargs) -> None:
        pass  # built whole in __init__

    def update(self, key_states, value_states, *args, **kwargs):
        self.new = (key_states, value_states)
        if self.cascade is not None:
            self.pending = True
            return key_states, value_states
        return self.whole(key_states, value_states)

    def whole(self, key_states, value_states):
        """The context's slots and the pass's own, as the mask lays them out."""
        if self.gather is not None:
            self.context_keys, self.context_values = self.gather()
            self.gather = None
        if self.context_keys is None:
            return key_states, value_states
        return (torch.cat([self.context_keys, key_states], dim=-2),
                torch.cat([self.context_values, value_states], dim=-2))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.held + query_length, self.full_length - self.held  # a sliding layer holds the last slots only

    def get_seq_length(self) -> int:
        return self.full_length

    def get_max_length(self) -> int:
        return -1


class StateLayer(LinearAttentionLayer):
    """A linear-attention, SSM or short-convolution layer's states at each row's context end (its parent's
    last token; zeros, as a fresh prefill starts, for a row without context), as a cache that had run the
    context would hold them. The model updates them in place with the pass's own tokens."""

    def __init__(self, states: list[tuple] | None, number_of_states: int = 1):
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)
        self.written = False
        for index, (conv, recurrent) in enumerate(states or ()):
            if conv is not None:
                self.conv_states[index], self.conv_kernel_size[index] = conv, conv.shape[-1]
                self.is_conv_states_initialized[index] = True
                self.dtype, self.device = conv.dtype, conv.device
            if recurrent is not None:
                self.recurrent_states[index] = recurrent
                self.is_recurrent_states_initialized[index] = True
            self.has_previous_state[index] = True

    def update_conv_state(self, *args, **kwargs):
        self.written = True
        return LinearAttentionLayer.update_conv_state(self, *args, **kwargs)

    def update_recurrent_state(self, *args, **kwargs):
        self.written = True
        return LinearAttentionLayer.update_recurrent_state(self, *args, **kwargs)

    def states_of(self, row: int) -> tuple:
        return tuple((self.conv_states[i][row].clone() if self.is_conv_states_initialized[i] else None,
                      self.recurrent_states[i][row].clone() if self.is_recurrent_states_initialized[i] else None)
                     for i in range(self.number_of_states))


class ContextAndStateLayer(StateLayer, ContextLayer):
    """A layer with attention and a recurrent path side by side (Falcon-H1): both continuations at once."""

    def __init__(self, keys, values, full_length: int, sliding: bool, states, number_of_states: int = 1,
                 cascade=None, gather=None, held: int = 0):
        ContextLayer.__init__(self, keys, values, full_length, sliding, cascade, gather, held)
        StateLayer.__init__(self, states, number_of_states)

    lazy_initialization = StateLayer.lazy_initialization  # the recurrent path's (keys come whole)


class ContextCache(Cache):
    """The transformers Cache a pass reads: each layer's context gathered from the kept nodes."""

    def __init__(self, kinds: list[LayerKind], context: int, ancestors: list[list[int]], cached: np.ndarray,
                 tree: Tree, kept: dict, in_place: bool = False):
        """`in_place`: full-attention layers leave each row's context where it lies, for cascade.py's attention
        (only in the left layout, where a row sees every position of its path: `cached` is each node's start)."""
        layers = []
        parts = _context_parts(ancestors) if in_place else None
        for index, kind in enumerate(kinds):
            attention, state = kind.continuation.keys_values, kind.continuation.state
            keys = values = None
            contexts = gather = None
            held = 0
            if attention is not None:
                # A sliding layer's queries see at most the window's last `window - 1` context slots.
                held = context if attention == "full" else min(context, kind.window - 1)
                if in_place and kind.continuation.cascade:
                    contexts = cascade.PassContexts(parts, kept, index)
                    if held:
                        gather = (lambda index=index, held=held:
                                  _gather_context(index, held, ancestors, cached, tree, kept))
                elif held:
                    keys, values = _gather_context(index, held, ancestors, cached, tree, kept)
            states = _gather_states(index, ancestors, kept) if state else None
            if attention is not None and state:
                layers.append(ContextAndStateLayer(keys, values, context, attention == "sliding", states, kind.states,
                                                   contexts, gather, held))
            elif attention is not None:
                layers.append(ContextLayer(keys, values, context, attention == "sliding", contexts, gather, held))
            elif state:
                layers.append(StateLayer(states, kind.states))
            else:
                layers.append(DummyLayer())
        super().__init__(layers=layers)

    def state_of(self, row: int, first: int, length: int, fed: int) -> list[Kept]:
        """Per layer, the state batch row `row` leaves after its own tokens: fed slots first .. first + length - 1
        of the pass's `fed`."""
        kept_row, written = [], False
        for layer in self.layers:
            kept = Kept()
            new = getattr(layer, "new", None)
            if new is not None:
                keys, values = new  # (b, h, T, d)
                kept.keys = keys[row, :, first:first + length].clone()
                kept.values = values[row, :, first:first + length].clone()
                written = True
            if isinstance(layer, StateLayer):
                if first + length != fed:
                    # A state is the one after the pass's last position: pads after the node would be in it.
                    raise RuntimeError("a recurrent state was asked for at a node shorter than its pass")
                kept.states = layer.states_of(row)
                written = written or layer.written
            kept_row.append(kept)
        if not written:
            # A forward that takes its cache under another name drops it silently (**kwargs).
            raise RuntimeError("the model's forward wrote no keys, values or states into the cache it was given")
        return kept_row


def _gather_context(layer: int, held: int, ancestors: list[list[int]], cached: np.ndarray, tree: Tree,
                    kept: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, h, held, d) keys and values: each row's last `held` context positions, left-padded with zeros."""
    sample = next(kept[a][layer] for path in ancestors for a in path if kept[a][layer].keys is not None)
    sample_keys, sample_values = sample.keys, sample.values
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
            node_kept = kept[node][layer]  # (h, own length, d), on this layer's device
            at = held - (stop - low)  # slot of position `low`, counted from the left of the held slots
            keys[row, :, at:at + high - low] = node_kept.keys[:, low - tree.start[node]:high - tree.start[node]]
            values[row, :, at:at + high - low] = node_kept.values[:, low - tree.start[node]:high - tree.start[node]]
    return keys, values


def _context_parts(ancestors: list[list[int]]) -> list[tuple[slice, list[int]]]:
    """The pass's context in parts, in the order the cascade merges them: (a slice of batch rows, path nodes
    that every one of those rows attends over in full).

    First, for each stretch of consecutive runs (`_by_parent`) whose paths open with the same node, the
    nodes they all open with: one product for all their rows. An agent pass's rows share a long system
    prompt but few parents, and the kernel runs one large product much faster than a product per run
    (benchmarks/prefix_attention.py). Then, per run, the rest of its path."""
    runs = _by_parent(ancestors)
    parts: list[tuple[slice, list[int]]] = []
    tails: list[tuple[slice, list[int]]] = []
    start = 0
    while start < len(runs):
        stop = start + 1  # runs[start:stop]: adjacent rows, every path opening with the same node
        while (stop < len(runs) and runs[stop][1][0] == runs[start][1][0]
               and runs[stop][0].start == runs[stop - 1][0].stop):
            stop += 1
        shared = 0
        if stop - start > 1:
            paths = [path for _, path in runs[start:stop]]
            while all(len(path) > shared and path[shared] == paths[0][shared] for path in paths):
                shared += 1
            parts.append((slice(runs[start][0].start, runs[stop - 1][0].stop), paths[0][:shared]))
        tails += [(rows, path[shared:]) for rows, path in runs[start:stop] if len(path) > shared]
        start = stop
    return parts + tails


def _by_parent(ancestors: list[list[int]]) -> list[tuple[slice, list[int]]]:
    """The pass's rows with context in runs of one parent: (a slice of batch rows, their path from the root).
    Runs, not groups: a slice of the batch is a view, so the cascade reads and merges a run where it lies."""
    runs: list[tuple[slice, list[int]]] = []
    for row, path in enumerate(ancestors):
        if not path:
            continue
        if runs and runs[-1][0].stop == row and runs[-1][1][-1] == path[-1]:
            runs[-1] = (slice(runs[-1][0].start, row + 1), runs[-1][1])
        else:
            runs.append((slice(row, row + 1), path))
    return runs


def _gather_states(layer: int, ancestors: list[list[int]], kept: dict) -> list[tuple] | None:
    """Per state index, (b, ...) convolution windows and recurrent states: each row's parent's (the state at its
    context's last token), zeros for a row without context; None when no row has one (a fresh prefill)."""
    parents = [path[-1] if path else None for path in ancestors]
    sample = next((kept[p][layer].states for p in parents if p is not None), None)
    if sample is None:
        return None
    stacked = []
    for index, pair in enumerate(sample):
        stacked.append(tuple(
            None if like is None else torch.stack([kept[p][layer].states[index][which] if p is not None
                                                   else torch.zeros_like(like) for p in parents])
            for which, like in enumerate(pair)))
    return stacked
