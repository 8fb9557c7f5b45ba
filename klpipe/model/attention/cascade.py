"""Attention over a shared prefix without copying it into every row: cascade attention for the prefix tree.

A tree pass (tree.py) runs several nodes side by side, each continuing its ancestors' keys and values. A row's
attention is split by where its keys lie, and the parts are merged exactly by their log-sum-exp (Hydragen; FlashInfer's
cascade attention):

    own      each row's queries over the pass's own keys, causal (in the right layout a row too short to fill the
             pass runs alone)
    context  the row's path, in parts (context_parts.py), each one unmasked product over the kept keys and values
             read where they lie (window_cascade.context, piece A)

Every part is one call of lse_attention.attend. A call this cannot take exactly gets the context gathered and
transformers' own sdpa with its mask; every call outside a tree pass is transformers' sdpa untouched. The function
is registered with transformers (`AttentionInterface.register`) under NAME, with sdpa's mask (none in a packed
pass), and a model is switched to it only where it runs sdpa. docs/precompute.md, "Prefix sharing" (point 6), says
why and how.
"""

from __future__ import annotations

import inspect
import re
import sys
from collections import Counter
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from klpipe.model.attention import lse_attention, packing, window_cascade

NAME = "klpipe_cascade_sdpa"

# What each attention call in a tree pass took: "cascade" or "gathered"; of the cascade's, "window" (a sliding layer)
# "shared" (a KV-shared layer, through another layer's keys) and "packed" (in a packed pass). Tests read it.
CALLS: Counter = Counter()


class NotInPlace(RuntimeError):
    """A model whose attention does not read what its cache's update returned: the context must be gathered."""


class FreedKeys(RuntimeError):
    """A layer reuses keys whose context a layer-major tree pass has freed (layered.py): the tree runs in waves."""


class NotPackedPass(RuntimeError):
    """A call in a packed tree pass that the cascade cannot take: the pass must run as a padded batch."""


_PASS: ContextVar = ContextVar("klpipe_tree_pass", default=None)  # the running pass's ContextCache

# Keyword arguments that reach the attention function without changing what it computes. Anything
# else with a value (softcap, s_aux, sliding_window, position_bias, ...) takes the gathered way.
_HARMLESS = {"position_ids", "cache_position", "use_cache", "output_attentions", "return_dict", "shared_kv_states",
             "position_embeddings", "logits_to_keep"}

def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
               **kwargs):
    if packing.is_packed():  # rows run whole, packed (packing.py), while the tree's attention is installed
        return packing.attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    cache = _PASS.get()
    layer = None
    index = getattr(module, "layer_idx", None)
    if cache is not None and isinstance(index, int) and index < len(cache.layers):
        layer = cache.layers[index]
    # Pending: this layer's update just handed over the pass's own keys only.
    if layer is not None and getattr(layer, "pending", False):
        layer.pending = False
        if key is not layer.new[0] or value is not layer.new[1]:
            # The model attends over something made from what its cache handed back (DeepSeek's MLA expands
            # latents): its context is not the kept keys. tree.score_tree runs the tree again without us.
            raise NotInPlace(f"{type(module).__name__} attends over keys its cache did not hand back")
        shared = False
    elif cache is not None:
        # A layer that reuses another's keys (Gemma 4's KV-shared layers) is handed what that layer's update
        # returned: the pass's own keys, whose context is that layer's.
        layer, shared = _owner(cache, key, value), True
    else:
        layer = None
    if layer is not None:
        if _exact_here(module, query, key, value, dropout, kwargs, layer.cascade.window):
            CALLS["cascade"] += 1
            CALLS["window"] += layer.cascade.window is not None
            CALLS["shared"] += shared
            CALLS["packed"] += layer.cascade.segments is not None
            return layer.cascade.attend(query, key, value, scaling), None
        if layer.cascade.segments is not None:
            # A packed pass has no slots to gather into: tree.py runs the pass again as a batch, and every later one.
            raise NotPackedPass(f"{type(module).__name__} makes a call the cascade cannot take in a packed pass")
        CALLS["gathered"] += 1
        key, value = layer.whole(key, value)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def _owner(cache, key, value):
    """The layer of this pass whose update handed out `key` and `value` (the pass's own keys, its context read in
    place), or None."""
    for layer in cache.layers:
        new = getattr(layer, "new", None)
        if getattr(layer, "cascade", None) is not None and new is not None and new[0] is key and new[1] is value:
            return layer
        freed = getattr(layer, "freed", None)
        if freed is not None and freed[0]() is key and freed[1]() is value:
            raise FreedKeys(f"layer {cache.layers.index(layer)}'s keys are reused by a later layer")
    return None


def _exact_here(module, query, key, value, dropout: float, kwargs: dict, window: int | None = None) -> bool:
    """Whether the call computes what the cascade does: plain causal attention, within `window` (the layer's sliding
    window as the cache knows it; None for full attention) and no other."""
    if kwargs.get("is_causal") is False or dropout or not getattr(module, "is_causal", True):
        return False
    if (kwargs.get("sliding_window") or None) != window:  # a window the cache does not know, or none where it does
        return False
    if query.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):  # fp64: wide.py
        return False
    if not (query.shape[-1] == key.shape[-1] == value.shape[-1]) or query.shape[1] % key.shape[1]:
        return False
    if query.shape[2] not in (1, key.shape[2]):  # every fed slot's query, or the last one's
        return False
    return not any(given is not None and given is not False for name, given in kwargs.items()
                   if name not in _HARMLESS and name not in ("is_causal", "sliding_window"))


def _mask(*args, **kwargs):
    """None in a packed pass (its attention is the cascade's alone) and while packed rows run; sdpa's otherwise."""
    cache = _PASS.get()
    if cache is not None and getattr(cache, "packed", False):
        return None
    return packing.mask(*args, **kwargs)


AttentionInterface.register(NAME, _attention)
# The mask is sdpa's (outside a pass it is sdpa), or none while packed rows run (packing.py) or in a packed pass.
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, _mask)


def enable(model, text_config) -> bool:
    """Switch `model` to the cascade attention function where that is exact and known: sdpa. True if so.

    Never for a model whose own code branches on the implementation's name (`branches_on_name`): under a name
    other than its own it may run another computation, and a short probe cannot show that it does not."""
    if getattr(text_config, "_attn_implementation", None) not in ("sdpa", packing.NAME):
        return False
    if branches_on_name(model):
        return False
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, KeyError, AttributeError, NotImplementedError):
        return False
    return getattr(text_config, "_attn_implementation", None) == NAME


def disable(model, implementation: str) -> None:
    """Give `model` back its own attention implementation (what transformers loaded it with)."""
    model.set_attn_implementation(implementation)


# A comparison of the implementation's name in a model's own code: `_attn_implementation in ("eager", "sdpa")`
# (DeepSeek-V3.2's sparse attention applies its top-k mask only under those names), `== "sdpa"`. The dispatch
# every model has, `ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)`, is no comparison.
_NAME_TEST = re.compile(r"_attn_implementation\s*(==|!=|\bin\b|\bnot\s+in\b)|(==|!=)\s*[\w.]*_attn_implementation\b")


# Functions whose comparison of the name is known to compute the same under the cascade's name as under "sdpa" for
# every call a tree pass makes. Gemma 4 slices its KV-shared layers' inputs to `logits_to_keep` unless, under "sdpa",
# logits_to_keep > 1 or the cache is compileable and some mask is None: a tree pass passes 1 or nothing (0) and a
# ContextCache is not compileable, so the test is false under both names. Only that function's source is exempt.
_SAME_UNDER_EITHER_NAME = {
    "transformers.models.gemma4.modeling_gemma4": ("Gemma4TextModel", "_maybe_slice_kv_shared_inputs"),
}


def branches_on_name(model) -> bool:
    """Whether the source of any module class `model` is made of compares the attention implementation's name."""
    names = {type(module).__module__ for module in model.modules()}
    for name in sorted(names):
        if name.startswith(("torch.", "klpipe.")):
            continue
        module = sys.modules.get(name)
        try:
            source = inspect.getsource(module) if module is not None else ""
            if name in _SAME_UNDER_EITHER_NAME:
                owner, function = _SAME_UNDER_EITHER_NAME[name]
                exempt = getattr(getattr(module, owner, None), function, None)
                if exempt is not None:
                    source = source.replace(inspect.getsource(exempt), "")
        except (OSError, TypeError):
            continue
        if _NAME_TEST.search(source):
            return True
    return False


def running():
    """The running pass's ContextCache (in this greenlet or thread), or None."""
    return _PASS.get()


@contextmanager
def active(cache):
    """Attention calls inside read `cache` (a tree pass's ContextCache)."""
    token = _PASS.set(cache)
    try:
        yield
    finally:
        _PASS.reset(token)


class PassContexts:
    """One pass's context in parts (context_parts.context_parts), for one layer: rows and the path nodes they
    attend over, and what a sliding layer needs of each row (window_cascade.py)."""

    def __init__(self, parts: list[tuple[slice, list[int], int | None]], kept: dict, layer: int, starts=None,
                 real=None, runs=None, window: int | None = None, segments=None):
        self.parts = parts  # (a slice of batch rows, path nodes every one of them sees, up to position stop), in order
        self.kept = kept
        self.layer = layer
        self.starts = starts  # each node's first position (tree.start); None: parts are never cut (stop None)
        self.real = real  # (2, b): each row's first real slot among the fed ones, and how many
        self.runs = runs or []  # (rows, path, context length): runs of one parent and one context length
        self.window = window  # a sliding layer's window, None for full attention
        # A packed pass (tree.py): (starts, lengths) of each row's own tokens in the one sequence; None: a batch.
        self.segments = segments

    def read(self, nodes: list[int], low: int | None = None, high: int | None = None):
        """(h, n, d) keys and values of positions low .. high - 1 along `nodes` (all of them where None), where they
        lie: a view when one node holds them."""
        keys, values = [], []
        for node in nodes:
            kept = self.kept[node][self.layer]
            if low is None and high is None:
                keys.append(kept.keys)
                values.append(kept.values)
                continue
            start = int(self.starts[node])
            a, b = max(low or 0, start) - start, min(high if high is not None else 1 << 62,
                                                     start + kept.keys.shape[1]) - start
            if a < b:
                keys.append(kept.keys[:, a:b])
                values.append(kept.values[:, a:b])
        if not keys:
            sample = self.kept[nodes[0]][self.layer]
            return sample.keys[:, :0], sample.values[:, :0]
        if len(keys) == 1:
            return keys[0], values[0]
        return torch.cat(keys, dim=1), torch.cat(values, dim=1)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float | None) -> torch.Tensor:
        """(b, q, H, d) attention of query (b, H, q, d) over each row's path and its own keys (b, h, T, d); q = T, or
        q = 1 where the model keeps only the last slot (every row's last real token: the right layout)."""
        _b, _heads, fed, dim = query.shape
        scale = scaling if scaling is not None else dim ** -0.5
        if self.segments is not None:
            return window_cascade.attend_packed(self, query, key, value, scale, self.window)
        if self.window is not None:
            return window_cascade.attend(self, query, key, value, scale, self.window)
        slots = key.shape[2]
        # Causal over the fed slots; the last slot's query alone sees them all.
        out, lse = lse_attention.attend(query, key, value, fed == slots, scale)  # (b, H, q, d), (b, H, q) float32
        if self.real is not None and self.real[0].any():
            # The right layout: a row too short to fill the pass has pads before its real slots (and no context).
            for row in map(int, self.real[0].nonzero()[0]):
                first = int(self.real[0, row])
                q = query[row:row + 1, :, first:] if fed == slots else query[row:row + 1]
                got, got_lse = lse_attention.attend(q, key[row:row + 1, :, first:], value[row:row + 1, :, first:],
                                                    fed == slots, scale)
                out[row:row + 1, :, fed - got.shape[2]:] = got
                lse[row:row + 1, :, fed - got.shape[2]:] = got_lse
        if not self.parts:
            return out.transpose(1, 2).contiguous()  # (b, T, H, d), as transformers' sdpa returns it
        out = out.float()  # merged in fp32, in place, a part at a time; lse: of what is merged so far
        for rows, nodes, stop in self.parts:
            context_k, context_v = self.read(nodes, None if stop is None else 0, stop)  # (h, C, d)
            if context_k.shape[1]:
                # Every query of these rows sees every key of these nodes: window_cascade's piece A, no window.
                window_cascade.context(query[rows], context_k, context_v, scale, None, 0, out[rows], lse[rows])
        return out.transpose(1, 2).to(query.dtype).contiguous()
