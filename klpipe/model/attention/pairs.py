"""Attention pairs a forward executes, per layer kind, read from each kernel call's own arguments.

A (query, key) pair is one score and one weighted value of one query head; pairs are counted per query head, so a
row of T tokens through a causal full-attention layer needs T (T + 1) / 2 of them, whatever its head count. The
count wraps the kernels every attention path here ends in, for the forwards run inside `PairCount`:

    torch.nn.functional.scaled_dot_product_attention   transformers' sdpa, packed rows (packing.py)
    lse_attention.run                                   the tree's cascade (cascade.py), whichever kernel runs it
                                                        (a kernel's probe is not counted)

A call with `is_causal` and no mask executes the causal triangle (query i over keys 0 .. i: the kernels skip the
blocks above the diagonal, so this is what they compute, to within a block); a call with a mask, or none and not
causal, the whole rectangle, masked pairs included: that is what a masked kernel computes. Each call is told to the
layer kind of the attention module it runs under: "sliding" where the module has a sliding window, else "full".
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from contextvars import ContextVar

import torch

from klpipe.model.attention import lse_attention

_MODULE: ContextVar = ContextVar("klpipe_attention_module", default=None)  # (kind, window, query heads)


def executed(query: torch.Tensor, key: torch.Tensor, causal: bool, masked: bool, heads: int | None) -> int:
    """Pairs one kernel call executes, per query head: query (..., Lq, d) over key (..., Lk, d)."""
    lq, lk = query.shape[-2], key.shape[-2]
    if causal and not masked:  # top-left aligned: query i sees keys 0 .. min(i, Lk - 1)
        inside = min(lq, lk)
        per_matrix = inside * (inside + 1) // 2 + (lq - inside) * lk
    else:
        per_matrix = lq * lk
    matrices = math.prod(query.shape[:-2])  # batch × heads (or the cascade's groups × KV heads)
    return matrices * per_matrix // (heads or query.shape[-3])


def kind_of(module) -> tuple[str, int | None] | None:
    """("sliding", window) or ("full", None) for an attention module; None for any other module."""
    if not hasattr(module, "layer_idx") or not any(hasattr(module, name) for name in ("q_proj", "qkv_proj",
                                                                                       "query_key_value")):
        return None
    window = getattr(module, "sliding_window", None)
    if isinstance(window, int) and not isinstance(window, bool) and window > 0:
        return "sliding", window
    return "full", None


class PairCount:
    """Inside `with PairCount(model) as count:`, every attention kernel call of `model` adds to
    count.executed[kind]; count.layers[kind] is how many attention modules of that kind ran, count.window[kind]
    their window."""

    def __init__(self, model):
        self.model = model
        self.executed: Counter = Counter()
        self.layers: dict[str, set] = {}
        self.window: dict[str, int | None] = {}
        self._hooks = []
        self._sdpa: Callable[..., torch.Tensor] | None = None  # the functions counted, while inside
        self._kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None

    def __enter__(self) -> PairCount:
        for module in self.model.modules():
            found = kind_of(module)
            if found is None:
                continue
            heads = getattr(getattr(module, "config", None), "num_attention_heads", None)
            self._hooks.append(module.register_forward_pre_hook(self._enter(module, found, heads)))
            self._hooks.append(module.register_forward_hook(_leave))
        self._sdpa = torch.nn.functional.scaled_dot_product_attention
        self._kernel = lse_attention.run
        sdpa, kernel = self._sdpa, self._kernel

        def counted_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
            self._add(query, key, is_causal, attn_mask is not None)
            return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

        def counted_kernel(backend, query, key, value, causal, scale):
            self._add(query, key, causal, False)
            return kernel(backend, query, key, value, causal, scale)

        # Counted in place while inside: torch's keywords (scale, enable_gqa) pass through **kwargs.
        torch.nn.functional.scaled_dot_product_attention = counted_sdpa  # type: ignore[assignment]
        lse_attention.run = counted_kernel
        return self

    def __exit__(self, *exc) -> None:
        assert self._sdpa is not None and self._kernel is not None, "left before entered"
        torch.nn.functional.scaled_dot_product_attention = self._sdpa
        lse_attention.run = self._kernel
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _enter(self, module, found: tuple[str, int | None], heads: int | None):
        def hook(*args):
            _MODULE.set((found[0], found[1], heads))
            self.layers.setdefault(found[0], set()).add(id(module))
            self.window[found[0]] = found[1]
        return hook

    def _add(self, query, key, causal: bool, masked: bool) -> None:
        current = _MODULE.get()
        kind, heads = ("other", None) if current is None else (current[0], current[2])
        self.executed[kind] += executed(query, key, causal, masked, heads)


def _leave(*args) -> None:
    _MODULE.set(None)  # a forward hook that returns nothing leaves the module's output as it is


def needed(lengths, window: int | None) -> int:
    """Pairs rows of these lengths need through one layer: causal, within `window` (a query sees itself and
    window − 1 before it) if given."""
    total = 0
    for length in lengths:
        length = int(length)
        if window is None or length <= window:
            total += length * (length + 1) // 2
        else:
            total += window * (window + 1) // 2 + (length - window) * window
    return total
