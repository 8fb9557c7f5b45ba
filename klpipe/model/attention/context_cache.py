"""The cache a tree pass reads (tree.py): each layer's context gathered from the nodes its rows continue.

Each node's own state is kept (`Kept`: keys and values cut to its real tokens, recurrent and convolution
states at its last token) while any of its descendants is still to run. A pass's `ContextCache` is a
transformers Cache whose layers hand the model's own code that context: keys and values gathered into the
pass's slots (`ContextLayer`), the parent's states (`StateLayer`), or both (`ContextAndStateLayer`), as
continuation.py says each kind of layer needs.

Where the model runs sdpa (on any device, in either layout), a full-attention or sliding-window layer does not
gather its context into the pass's slots at all: cascade.py's attention reads the kept keys and values of each
row's path where they lie, in parts (`context_parts.py`, `ContextLayer.cascade`), and only a call it cannot take
exactly gets them gathered.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers import Cache
from transformers.cache_utils import CacheLayerMixin, DummyLayer, LinearAttentionCacheLayerMixin, LinearAttentionLayer

from klpipe.model.attention import cascade
from klpipe.model.attention.context_parts import by_parent, context_parts
from klpipe.model.attention.continuation import LayerKind

if TYPE_CHECKING:
    from klpipe.plan import Tree


class CacheIgnored(NotImplementedError):
    """A model whose forward keeps nothing in the cache it is given: it takes none (GPT, Reformer), or keeps its
    state in one of its own (RWKV), or takes it under another name and drops it. The tree cannot continue it."""


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


@dataclass(frozen=True)
class LayerContext:
    """What one attention layer of a pass reads before its own keys."""

    full_length: int  # slots before the fed tokens: the queries' offset
    sliding: bool
    # With `contexts` (cascade.PassContexts), `update` hands back the pass's own keys alone and the attention
    # function reads the context where it lies; `gather` makes the slots for a call it cannot take.
    contexts: cascade.PassContexts | None = None
    gather: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None
    held: int = 0  # context slots the mask covers


class ContextLayer(CacheLayerMixin):
    """One layer's context (its rows' ancestors' keys and values, left-padded) plus the pass's own.

    `update` returns context + new, as a cache that had seen the context would, and keeps the new
    keys and values for the nodes to be continued; nothing is written into the context.
    """

    is_compileable = False
    supports_early_init = False

    def __init__(self, context: LayerContext):
        CacheLayerMixin.__init__(self)
        self.context_keys: torch.Tensor | None = None  # (b, h, c, d), c <= full_length: made by `gather`
        self.context_values: torch.Tensor | None = None
        self.full_length = context.full_length
        self.is_sliding = context.sliding
        self.held = context.held
        self.new: tuple[torch.Tensor, torch.Tensor] | None = None
        # What `new` was, as weak references, once a layer-major pass has freed it (`leave`): for cascade._owner.
        self.freed: tuple[weakref.ref[torch.Tensor], ...] | None = None
        self.is_initialized = True
        self.cascade, self.gather, self.pending = context.contexts, context.gather, False

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
        keys, values = self.context_keys, self.context_values
        if keys is None or values is None:  # both or neither
            return key_states, value_states
        return torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)

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
        return tuple((_made(self.conv_states[i])[row].clone() if self.is_conv_states_initialized[i] else None,
                      _made(self.recurrent_states[i])[row].clone() if self.is_recurrent_states_initialized[i] else None)
                     for i in range(self.number_of_states))


def _made(state: torch.Tensor | None) -> torch.Tensor:
    """A state the layer holds: initialized, or zeros made for the pass (_zero_states)."""
    if state is None:
        raise RuntimeError("klpipe bug: a cache layer's state read before it was made")
    return state


# The MRO puts the recurrent path's is_compileable and is_croppable (properties) before the attention path's class
# attributes, which is what this layer means; mypy refuses a mix of the two kinds.
class ContextAndStateLayer(StateLayer, ContextLayer):  # type: ignore[override]
    """A layer with attention and a recurrent path side by side (Falcon-H1): both continuations at once."""

    def __init__(self, context: LayerContext, states, number_of_states: int = 1):
        ContextLayer.__init__(self, context)
        StateLayer.__init__(self, states, number_of_states)

    lazy_initialization = StateLayer.lazy_initialization  # the recurrent path's (keys come whole)


class ContextCache(Cache):
    """The transformers Cache a pass reads: each layer's context gathered from the kept nodes."""

    def __init__(self, kinds: list[LayerKind], context: int, ancestors: list[list[int]], cached: np.ndarray,
                 tree: Tree | None, kept: dict, in_place: bool = False, real: np.ndarray | None = None, segments=None,
                 template: list | None = None):
        """`in_place`: attention layers the cascade knows leave each row's context where it lies, for cascade.py's
        attention: row k continues positions 0 .. cached[k] - 1 of its path, and `real` (2, b) gives the first of
        its real slots among the fed ones and how many. `segments`: a packed pass (tree.py), the rows' own tokens end
        to end in one sequence, (starts, lengths); every attention layer then takes the cascade. `template`: in a
        layer-major pass (layered.py), per layer the states of one row (CacheCost.states): its state layers start
        from zeros of their shape, filled from the parents' states as each layer comes (`fill`). `tree`: None for
        a pass without context (cache_cost's one token)."""
        layers: list[CacheLayerMixin | LinearAttentionCacheLayerMixin | DummyLayer] = []
        unfilled: dict[int, list[tuple[int, int]]] = {}  # state layer -> (batch row, its parent) still to fill
        parts: list[tuple[slice, list[int], int | None]] = []  # read in place only
        runs: list[tuple[slice, list[int], int | None]] = []
        if in_place:
            runs = by_parent(ancestors, cached)
            parts = context_parts(ancestors, cached, _known(tree).end)
        for index, kind in enumerate(kinds):
            attention, state = kind.continuation.keys_values, kind.continuation.state
            contexts = gather = None
            held = 0
            if attention is not None:
                # A sliding layer's queries see at most the window's last `window - 1` context slots.
                held = context if attention == "full" else min(context, kind.sliding_window - 1)
                if in_place and kind.continuation.cascade:
                    contexts = cascade.PassContexts(parts, kept, index, _known(tree).start, real, runs,
                                                    kind.window if attention == "sliding" else None, segments)
                if held:  # gathered when the layer runs (a layer-major pass's parents write it just before), or
                    # never where the cascade takes every call
                    gather = functools.partial(_gather_context, index, held, ancestors, cached, _known(tree), kept)
            states = None
            if state and template is not None:
                states = _zero_states(template[index], ancestors)
                if states is not None:
                    unfilled[index] = [(row, path[-1]) for row, path in enumerate(ancestors) if path]
            elif state:
                states = _gather_states(index, ancestors, kept)
            if attention is not None:
                layer_context = LayerContext(context, attention == "sliding", contexts, gather, held)
                layers.append(ContextAndStateLayer(layer_context, states, kind.states) if state
                              else ContextLayer(layer_context))
            elif state:
                layers.append(StateLayer(states, kind.states))
            else:
                layers.append(DummyLayer())
        super().__init__(layers=layers)
        self.packed = segments is not None
        self.keeping: list[tuple[int, int, int, int]] = []  # `keep`: the nodes the pass keeps
        self.owners: frozenset | None = None  # `keep`'s: set in a layer-major pass, which keeps layer by layer
        self.kept, self.unfilled = kept, unfilled

    def fill(self) -> None:
        """A layer-major pass about to go on through a decoder layer: each state layer whose rows' parents have all
        left it starts from their states (the parents run first in each layer; rows without one from zeros)."""
        for index in [i for i, rows in self.unfilled.items()
                      if all(self.kept[parent][i].states is not None for _, parent in rows)]:
            layer = self.layers[index]
            assert isinstance(layer, StateLayer), "only a state layer waits to be filled"
            for row, parent in self.unfilled.pop(index):
                for which, (conv, recurrent) in enumerate(self.kept[parent][index].states):
                    if conv is not None:
                        _made(layer.conv_states[which])[row].copy_(conv)
                    if recurrent is not None:
                        _made(layer.recurrent_states[which])[row].copy_(recurrent)

    def state_of(self, row: int, first: int, length: int, fed: int) -> list[Kept]:
        """Per layer, the state batch row `row` leaves after its own tokens: fed slots first .. first + length - 1
        of the pass's `fed`."""
        kept_row = [_kept_of(layer, row, first, length, fed) for layer in self.layers]
        _check_written(any(_written(layer) for layer in self.layers))
        return kept_row

    def keep(self, keeping: list[tuple[int, int, int, int]], fed: int, owners: frozenset | None = None) -> None:
        """Before the pass's forward: the nodes others continue, (node, batch row, first slot, length) of the pass's
        `fed` slots, each kept in the tree's kept states as the state its own tokens leave. Every layer at once when
        the forward ends (`finish`); with `owners` (a layer-major group, layered.py), layer by layer as the pass
        leaves each layer (`leave`), so that a pass after it in the same group reads it at that layer. What the pass
        made of a layer then goes when it leaves the layer, but for `owners`, the layers whose keys a later layer
        reuses (Gemma 4's KV-shared layers)."""
        self.keeping, self.fed, self.owners = keeping, fed, owners
        if owners is None:
            return
        self.left: set[int] = set()
        self.wrote = False
        for node, *_ in keeping:
            self.kept[node] = [Kept() for _ in self.layers]

    def leave(self) -> list[int]:
        """Between two decoder layers: every cache layer the pass has written since, kept for its nodes and freed
        of its own keys; their indices. By what was written, not by the decoder layer's index: a decoder layer may
        hold several attention layers (LongCat-Flash's two)."""
        taken: list[int] = []
        if self.owners is None:  # not layer-major: kept at `finish`
            return taken
        for index, layer in enumerate(self.layers):
            if index in self.left or not _written(layer):
                continue
            if index in self.unfilled:  # never a silent fresh state: the layer ran before its parents' were in
                raise RuntimeError(f"klpipe bug: state layer {index} ran before its context's state was filled")
            for node, row, first, length in self.keeping:
                self.kept[node][index] = _kept_of(layer, row, first, length, self.fed)
            self.wrote = True
            self.left.add(index)
            taken.append(index)
            if index not in self.owners and isinstance(layer, ContextLayer):
                if layer.new is not None:  # for cascade._owner: a later layer handed these keys reads freed context
                    layer.freed = tuple(weakref.ref(t) for t in layer.new)
                layer.new = None
                layer.context_keys = layer.context_values = None
        return taken

    def finish(self) -> None:
        """After the pass's forward: its nodes kept (`keep`), every layer now, or in a layer-major pass what its last
        decoder layer wrote."""
        if self.owners is None:
            for node, row, first, length in self.keeping:
                self.kept[node] = self.state_of(row, first, length, self.fed)
            return
        self.leave()
        _check_written(self.wrote)


def _known(tree: Tree | None) -> Tree:
    """The tree of a pass that reads context from it."""
    if tree is None:
        raise RuntimeError("klpipe bug: a pass with context was given no tree")
    return tree


def _kept_of(layer, row: int, first: int, length: int, fed: int) -> Kept:
    """One layer's state batch row `row` leaves after fed slots first .. first + length - 1 of the pass's `fed`."""
    kept = Kept()
    new = getattr(layer, "new", None)
    if new is not None:
        keys, values = new  # (b, h, T, d)
        kept.keys = keys[row, :, first:first + length].clone()
        kept.values = values[row, :, first:first + length].clone()
    if isinstance(layer, StateLayer):
        if first + length != fed:
            # A state is the one after the pass's last position: pads after the node would be in it.
            raise RuntimeError("a recurrent state was asked for at a node shorter than its pass")
        kept.states = layer.states_of(row)
    return kept


def _written(layer) -> bool:
    return getattr(layer, "new", None) is not None or (isinstance(layer, StateLayer) and layer.written)


def _check_written(written: bool) -> None:
    if not written:
        # A forward that takes its cache under another name drops it silently (**kwargs).
        raise CacheIgnored("the model's forward wrote no keys, values or states into the cache it was given")


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


def _zero_states(template: tuple | None, ancestors: list[list[int]]) -> list[tuple] | None:
    """Per state index, (b, ...) zeros shaped as `template`'s one row (CacheCost.states); None when no row has a
    context (a fresh prefill), as _gather_states."""
    if template is None or not any(ancestors):
        return None
    return [tuple(None if like is None else torch.zeros((len(ancestors), *like.shape), dtype=like.dtype,
                                                        device=like.device) for like in pair) for pair in template]


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


@dataclass(frozen=True)
class CacheCost:
    """What the tree keeps for a node, in bytes: keys and values per token, and recurrent and convolution
    states per node, whatever its length."""

    kv_bytes_per_token: int
    state_bytes_per_node: int
    kv_layer_bytes_per_token: int = 0  # the most one layer holds (a layer-major pass holds few at once)
    states: tuple = ()  # per layer, one row's states (the shapes a layer-major pass's state layers start from)


def cache_cost(reference) -> CacheCost:
    """Bytes one token holds as keys and values, and one node as states: one token's forward, measured."""
    cache = ContextCache(reference.layer_kinds, 0, [[]], np.zeros(1, dtype=np.int64), None, {})
    one = torch.zeros((1, 1), dtype=torch.long, device=reference.input_device)
    with torch.inference_mode():
        reference.body(input_ids=one, attention_mask=torch.ones_like(one), position_ids=torch.zeros_like(one),
                       use_cache=True, **{reference.cache_argument: cache})
    kept = cache.state_of(0, 0, 1, 1)
    return CacheCost(sum(layer.kv_bytes() for layer in kept), sum(layer.state_bytes() for layer in kept),
                     max(layer.kv_bytes() for layer in kept), tuple(layer.states for layer in kept))
