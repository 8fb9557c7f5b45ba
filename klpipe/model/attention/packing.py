"""Rows run whole, packed: one sequence per batch with no pads and no mask, and an attention that computes only the
pairs each query needs.

    input_ids     [ row 0 ........ | row 1 ..... | row 2 ............ ]   (1, N), N = the rows' tokens
    position_ids  [ 0 1 2 ...      | 0 1 2 ...   | 0 1 2 ...          ]   restarting per row, as in a lone row

This module's attention function (registered with transformers under NAME, its mask function building no mask while
rows are packed) runs each row's segment on its own: one causal SDPA call per row on a full layer; on a sliding layer
the first `window` queries causal, the rest in blocks of `window // 16` queries, each over the `block + window - 1`
keys its queries see, one batched call with a band mask ((block - 1) / window more pairs than needed, 6% at a
512-token window). Grouped-query attention never repeats keys (SDPA's `enable_gqa`; `_grouped` for the masked calls).
An attention call this module cannot compute exactly raises NotPacked, after which the model's rows run padded.
docs/precompute.md, "Packed rows", says why and when packing is exact (packing_check.py checks it at load).
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from contextvars import ContextVar

import numpy as np
import torch
import transformers.masking_utils
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "klpipe_packed_sdpa"
BLOCKS_PER_WINDOW = 16  # a sliding layer's query block is window // 16: 1/16 more pairs than needed, at most

# Keyword arguments that reach an attention function without changing what it computes (sliding_window is read).
HARMLESS = frozenset({"position_ids", "cache_position", "use_cache", "output_attentions", "return_dict",
                      "shared_kv_states", "position_embeddings", "logits_to_keep", "is_causal", "sliding_window"})

# Why a model keeps its rows padded: the load-time check's words.
NOT_SDPA = "its attention is not transformers' sdpa"
STATEFUL = "a layer keeps a recurrent or convolution state, which would run on from one row into the next"
LONG_ROPE = "its RoPE changes with the batch's length"
NOT_CAUSAL = "its rows run alone, whole"  # its forward is not causal, or a row changes beside another's pads
DISAGREE = "packed rows disagree with its own forward"
WINDOW_TOO_LONG = "its window is longer than the packed probe may be"
CHECKING = "being checked"  # ReferenceModel.padded_why while packing_check runs: score_batch lets NotPacked through
PROBE_CAP = 8192  # the longest probe the load-time check packs (a window longer than this keeps rows padded)


# What each call that ran rows alone took: "rows" (a packed batch) or "spans" (a tree pass without context).
CALLS: Counter = Counter()


class NotPacked(RuntimeError):
    """An attention call that packed rows cannot compute exactly (a softcap, sinks, a bias, dropout, not causal)."""


class Rows:
    """The packed batch's segments: row k is positions starts[k] .. starts[k] + lengths[k] - 1."""

    def __init__(self, lengths: list[int]):
        self.lengths = [int(n) for n in lengths]
        self.starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(np.int64).tolist()
        self.total = int(sum(self.lengths))

    def position_ids(self) -> np.ndarray:
        """(N,) each row's positions 0 .. length - 1, end to end."""
        return np.concatenate([np.arange(n, dtype=np.int64) for n in self.lengths]) if self.lengths else \
            np.zeros(0, dtype=np.int64)


_ROWS: ContextVar = ContextVar("klpipe_packed_rows", default=None)
# Whether the packed batch's masks are `mask`'s below (none): False for a model that keeps transformers' own masks
# under any name (Falcon runs sdpa whatever it is told, with transformers' packed-sequence mask).
_MASKLESS: ContextVar = ContextVar("klpipe_packed_maskless", default=False)


@contextmanager
def packed(rows: Rows, maskless: bool = False):
    """Attention calls inside run `rows` as separate sequences (the model was switched to NAME). `maskless`: the
    model's masks are built by `mask` (its implementation is NAME or the cascade's), so none is built."""
    token, mask_token = _ROWS.set(rows), _MASKLESS.set(maskless)
    try:
        yield
    finally:
        _MASKLESS.reset(mask_token)
        _ROWS.reset(token)


class Spans:
    """A padded batch whose rows each hold one whole sequence from position 0 (a tree pass without context): row
    k's real tokens are its slots starts[k] .. starts[k] + lengths[k] - 1, pads around them."""

    def __init__(self, starts, lengths):
        self.starts = [int(n) for n in starts]
        self.lengths = [int(n) for n in lengths]


_SPANS: ContextVar = ContextVar("klpipe_padded_spans", default=None)


@contextmanager
def spans(rows: Spans):
    """Attention calls inside attend each batch row's real slots alone, as packed rows do, pads never read."""
    token = _SPANS.set(rows)
    try:
        yield
    finally:
        _SPANS.reset(token)


def is_packed() -> bool:
    """Whether attention calls now run each row alone (packed rows, or spans of a padded batch)."""
    return _ROWS.get() is not None or _SPANS.get() is not None


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
              **kwargs):
    """transformers' attention interface: packed rows when a packed batch runs, sdpa untouched otherwise."""
    rows = _ROWS.get()
    if rows is not None:
        CALLS["rows"] += 1
        return attend(module, query, key, value, rows, dropout, scaling, kwargs), None
    padded = _SPANS.get()
    if padded is not None:
        CALLS["spans"] += 1
        return attend_spans(module, query, key, value, padded, dropout, scaling, kwargs), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def mask(*args, **kwargs):
    """No mask while rows run alone (each one's attention is causal by construction); sdpa's otherwise."""
    return None if is_packed() else sdpa_mask(*args, **kwargs)


AttentionInterface.register(NAME, attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, mask)

_find_packed_sequence_indices = transformers.masking_utils.find_packed_sequence_indices


def _packed_sequences(position_ids: torch.Tensor):
    """transformers' test of whether a batch without an attention mask holds packed rows, except while klpipe packs
    them for a model whose masks are `mask`'s: there it would read the position ids on the host (`(...).all()`, a
    device sync per kind of mask and batch) only to build a mask factory that `mask` never calls. Anywhere else
    (Falcon's packed rows run on transformers' packed-sequence mask), transformers' own answer."""
    if _ROWS.get() is not None and _MASKLESS.get():
        return None
    return _find_packed_sequence_indices(position_ids)


# transformers calls it by its module's global name (masking_utils._preprocess_mask_arguments, its one caller); the
# wrapper is transformers' own function outside klpipe's packed batches, so code beside klpipe in the process sees
# no change.
transformers.masking_utils.find_packed_sequence_indices = _packed_sequences


def _plain(module, query: torch.Tensor, key: torch.Tensor, dropout: float, kwargs: dict) -> int | None:
    """The call's window (None for full attention) where each row's attention alone computes it exactly; raises
    NotPacked otherwise."""
    unknown = sorted(name for name, given in kwargs.items()
                     if name not in HARMLESS and given is not None and given is not False)
    if unknown:
        raise NotPacked(f"{type(module).__name__} passes {', '.join(unknown)} to its attention")
    if dropout or kwargs.get("is_causal") is False or not getattr(module, "is_causal", True):
        raise NotPacked(f"{type(module).__name__}'s attention is not causal or has dropout")
    if query.shape[1] % key.shape[1] or query.shape[-1] != key.shape[-1]:
        raise NotPacked(f"{type(module).__name__}'s heads do not group")
    window = kwargs.get("sliding_window")
    return int(window) if window else None


def attend(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: Rows, dropout: float,
           scaling: float | None, kwargs: dict) -> torch.Tensor:
    """(1, N, H, d_v) attention of query (1, H, N, d) over key, value (1, h, N, d), each row's segment alone."""
    window = _plain(module, query, key, dropout, kwargs)
    if query.shape[0] != 1 or not (query.shape[2] == key.shape[2] == value.shape[2] == rows.total):
        raise NotPacked(f"{type(module).__name__} attends over other keys than the packed batch's own")
    heads, kv_heads = query.shape[1], key.shape[1]
    gqa = heads != kv_heads
    out = query.new_empty((1, heads, rows.total, value.shape[-1]))  # (1, H, N, d_v)
    for start, length in zip(rows.starts, rows.lengths, strict=True):
        if length:
            span = slice(start, start + length)
            out[:, :, span] = segment(query[:, :, span], key[:, :, span], value[:, :, span], scaling, window, gqa)
    return out.transpose(1, 2).contiguous()  # (1, N, H, d_v), as transformers' sdpa returns it


def attend_spans(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: Spans, dropout: float,
                 scaling: float | None, kwargs: dict) -> torch.Tensor:
    """(b, q, H, d_v) attention of query (b, H, q, d) over key, value (b, h, T, d), each row's real slots alone:
    q = T (every slot's query; a pad's output is zeros, never read), or q = 1 (the last slot's, where the model
    keeps only the last position: Gemma 4's KV-shared layers under logits_to_keep=1, every row ending there)."""
    window = _plain(module, query, key, dropout, kwargs)
    batch, heads, queries, _ = query.shape
    slots = key.shape[2]
    if batch != len(rows.starts) or value.shape[2] != slots or queries not in (1, slots):
        raise NotPacked(f"{type(module).__name__} attends over other slots than the pass's own")
    gqa = heads != key.shape[1]
    out = query.new_zeros((batch, heads, queries, value.shape[-1]))  # (b, H, q, d_v)
    for row, (start, length) in enumerate(zip(rows.starts, rows.lengths, strict=True)):
        if not length:
            continue
        if queries == slots:
            span = slice(start, start + length)
            out[row:row + 1, :, span] = segment(query[row:row + 1, :, span], key[row:row + 1, :, span],
                                                value[row:row + 1, :, span], scaling, window, gqa)
            continue
        if start + length != slots:
            raise NotPacked(f"{type(module).__name__} keeps a last position that is a pad")
        low = start if window is None else max(start, slots - window)  # the last query's keys
        out[row:row + 1] = torch.nn.functional.scaled_dot_product_attention(
            query[row:row + 1], key[row:row + 1, :, low:], value[row:row + 1, :, low:], scale=scaling,
            enable_gqa=gqa)
    return out.transpose(1, 2).contiguous()


def segment(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None, window: int | None,
            gqa: bool) -> torch.Tensor:
    """(1, H, L, d_v) causal attention of one row (query (1, H, L, d), key and value (1, h, L, d)), within `window`
    positions (a query sees itself and window - 1 before it, as transformers' sliding_window_overlay) if given."""
    sdpa = torch.nn.functional.scaled_dot_product_attention  # looked up per call: counters (pairs.py) wrap it
    length = query.shape[2]
    if window is None or length <= window:
        return sdpa(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
    out = query.new_empty((1, query.shape[1], length, value.shape[-1]))
    # Queries 0 .. window - 1 see every key before them: plain causal.
    out[:, :, :window] = sdpa(query[:, :, :window], key[:, :, :window], value[:, :, :window], is_causal=True,
                              scale=scaling, enable_gqa=gqa)
    out[:, :, window:] = band(query, key, value, scaling, window, window)
    return out


def band(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None, window: int,
         first: int) -> torch.Tensor:
    """(1, H, L - first, d_v): queries first .. L - 1 of one row (query (1, H, L, d), key and value (1, h, L, d)),
    each over the `window` keys up to itself, in blocks of window // 16 queries with a band mask. first >= window - 1
    (every query's window lies inside the row). The tree's sliding cascade (window_cascade.py) runs its own
    queries past the first window here too."""
    sdpa = torch.nn.functional.scaled_dot_product_attention  # looked up per call: counters (pairs.py) wrap it
    length = query.shape[2]
    out = query.new_empty((1, query.shape[1], length - first, value.shape[-1]))
    start = first
    step = max(1, window // BLOCKS_PER_WINDOW)
    blocks = (length - first) // step
    if blocks:
        # Block b's queries first + b·step + i see keys first + b·step + i − window + 1 .. first + b·step + i: in the
        # block's key span, which opens window − 1 before its first query, key j is seen by query i iff i ≤ j ≤ i +
        # window − 1. The spans overlap; unfold makes them views of the keys, one batch of blocks.
        span = step + window - 1
        stop = first + blocks * step
        q = query[0, :, first:stop].unflatten(1, (blocks, step)).transpose(0, 1)  # (blocks, H, step, d)
        k = key[0, :, first - window + 1:stop].unfold(1, span, step).permute(1, 0, 3, 2)  # (blocks, h, span, d)
        v = value[0, :, first - window + 1:stop].unfold(1, span, step).permute(1, 0, 3, 2)
        mask = _band(step, span, window, query.device)
        got = _grouped(sdpa, q, k, v, mask, scaling)  # (blocks, H, step, d_v)
        out[0, :, :stop - start] = got.transpose(0, 1).flatten(1, 2)
        first = stop
    if first < length:  # the last, shorter block
        rest = length - first
        mask = _band(rest, rest + window - 1, window, query.device)
        lo = first - window + 1
        out[:, :, first - start:] = _grouped(sdpa, query[:, :, first:], key[:, :, lo:], value[:, :, lo:], mask,
                                             scaling)
    return out


def _grouped(sdpa, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, band: torch.Tensor,
             scaling: float | None) -> torch.Tensor:
    """(b, H, q, d_v) masked attention with the query heads of each KV head stacked along the queries: (b, h, g·q, d)
    against (b, h, k, d), the mask repeated per group. No key is repeated, and no kernel needs to take grouped heads
    with a mask (CUDA's do not all): a plain multi-head call. Query head i reads KV head i // g, as repeat_kv lays
    them out."""
    blocks, heads, queries, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    if groups == 1:
        return sdpa(query, key, value, attn_mask=band, scale=scaling)
    stacked = query.reshape(blocks, kv_heads, groups * queries, dim)  # (b, h, g·q, d)
    got = sdpa(stacked, key, value, attn_mask=band.repeat(groups, 1), scale=scaling)  # (b, h, g·q, d_v)
    return got.reshape(blocks, heads, queries, value.shape[-1])


def _band(queries: int, keys: int, window: int, device) -> torch.Tensor:
    """(queries, keys) bool: query i sees key j iff i ≤ j ≤ i + window − 1 (keys open window − 1 before query 0)."""
    i = torch.arange(queries, device=device)[:, None]
    j = torch.arange(keys, device=device)[None, :]
    return (j >= i) & (j <= i + window - 1)


# -- switching a model, and the load-time check ---------------------------------------------------------------


def refusal(reference) -> str | None:
    """Why `reference`'s rows cannot be packed, known before any probe; None if the probe decides."""
    from klpipe.model.architecture import text_config

    config = text_config(reference.model.config)
    if reference.own_forward is not None or reference.rows_alone:
        return NOT_CAUSAL
    if getattr(config, "_attn_implementation", None) != "sdpa":  # checked before any attention of klpipe's
        return NOT_SDPA
    if reference.rope_length_limit is not None:
        return LONG_ROPE
    # A model whose code compares the implementation's name (cascade.branches_on_name) is not refused here, as the
    # cascade refuses it: Gemma 4 compares it only to slice positions off for `logits_to_keep`, which rows run whole
    # never pass, and the probe below runs exactly the call rows run whole make.
    try:
        if reference.keeps_state:
            return STATEFUL
    except Exception:  # noqa: BLE001 - a layout the tree's table does not know: the probe decides
        pass
    if probe_length(config) > PROBE_CAP:
        return WINDOW_TOO_LONG
    return None


def probe_length(config) -> int:
    """Long enough to cross every window or chunk the config names, so a window the packed path missed shows."""
    from klpipe.model.probes import PROBE_LENGTH

    spans = [int(value) for name, value in vars(config).items()
             if isinstance(value, int) and not isinstance(value, bool) and value > 0
             and ("window" in name or "chunk" in name)]
    return max([PROBE_LENGTH] + [span + 8 for span in spans])


def probe_ids(reference) -> tuple[np.ndarray, np.ndarray]:
    """(the probe's ids, the row packed before it): fixed seeds, the probe as long as probe_length, the other row at
    most 48 tokens (what it is there for, a row before the probe's, does not grow with a window)."""
    from klpipe.model.architecture import text_config

    length = probe_length(text_config(reference.model.config))
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, reference.vocab_size, (length,), generator=generator).numpy()
    return ids, torch.randint(0, reference.vocab_size, (min(length // 2 + 3, 48),), generator=generator).numpy()


def scored(reference, length: int) -> int:
    """The positions of the probe the check compares: its last head block's (every one, on a short probe or a GPU's
    block), so that the model's own forward scores them in one forward rather than one a block. A window or a packed
    row's boundary missed shows in the last positions: they are the ones past the window, and what an earlier
    position got wrong reaches them through every later layer."""
    return max(1, min(length - 1, reference.head.rows))


def probe_row(reference) -> tuple[np.ndarray, np.ndarray]:
    """The row the load-time check (packing_check.py) runs by the model's own forward first (probes.prefetch runs it
    ahead on a streamed model): the probe fed whole, its last `scored` tokens the response."""
    ids = probe_ids(reference)[0]
    cut = len(ids) - scored(reference, len(ids))
    return ids[:cut], ids[cut:]


def enable(model) -> None:
    model.set_attn_implementation(NAME)


def disable(model, implementation: str) -> None:
    model.set_attn_implementation(implementation)
