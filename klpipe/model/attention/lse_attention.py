"""Attention that returns its log-sum-exp, on any device: what the tree's cascade (cascade.py, window_cascade.py)
merges its parts by.

    out, lse = attend(q, k, v, causal, scale)      q (b, H, s, d), k (b, h, t, d), v (b, h, t, d_v), H % h == 0
                                                   out (b, H, s, d_v) in q's dtype, lse (b, H, s) fp32

is softmax(q·kᵀ·scale) @ v and logsumexp(q·kᵀ·scale) over the keys each query sees: all of them, or with `causal`
the keys j <= i (top-left: query i of s sees key j, as torch's SDPA and CPU flash kernel mean it, whatever s and t).
`attend_shared` is the unmasked product of many rows over one set of keys (h, t, d), such as a node's kept keys
read where they lie. Grouped-query attention never expands the keys: an unmasked product folds the query heads of
a KV head (and the rows sharing the keys) into the query axis, (r, H, s, d) -> (1, h, g·r·s, d).

Backends, tried in order for the call's device (cpu_flash, cuda_flash, efficient, then math: plain torch, every
device and dtype, the reference every probe is held to); the first that takes the call and has passed its probe for
that kind of call runs it. A kernel that raises or disagrees is never used for that kind again (`REJECTED` says
why): a wrong assumption about a kernel costs speed, never a wrong logprob. `CALLS` counts the backend each call
took. docs/precompute.md, "Prefix sharing", says what each backend takes and how the probe is bounded.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from klpipe.errors import first_line

# The backend each call ran on ("cpu_flash", "cuda_flash", "efficient", "math"); a rejected kernel's real call
# that raised counts as "<name> raised" too.
CALLS: Counter = Counter()
# (backend, device, dtype, d, d_v, causal, square, grouped) -> why that kernel is not used for calls of that kind.
REJECTED: dict[tuple, str] = {}
_PASSED: set[tuple] = set()
_LOCK = threading.Lock()
_FORCED: str | None = None  # `forced`: only this backend (then math)
MATH_BLOCK = 1 << 24  # fp32 scores the math backend holds at once: 64 MiB


@dataclass(frozen=True)
class Backend:
    """A kernel that returns the log-sum-exp, and what it may be tried on (the probe decides whether it is used)."""

    name: str
    run: Callable  # (q, k, v, causal, scale) -> (out (b, H, s, d_v), lse (b, H, s) fp32)
    takes: Callable  # (q, k, v) -> whether to try it on such tensors (device, dtype, head sizes)
    top_left: bool  # its causal mask is top-left when s != t; if not, a causal call reaches it square only
    grouped: bool  # may be tried with fewer key heads than query heads (else its causal calls get keys repeated)


def _math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """Plain torch: q (b, H, s, d) over k (b, h, t, d), v (b, h, t, d_v), scores in fp32 (fp64 for fp64 inputs), a block
    of queries at a time (at most MATH_BLOCK scores held). The query heads of a KV head are folded into the query
    axis: no key repeated."""
    b, heads, s, dim = q.shape
    kv_heads, t = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    wide = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty((b, heads, s, v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, heads, s), dtype=torch.float32, device=q.device)
    keys_t = k.to(wide).transpose(-1, -2)  # (b, h, d, t): the keys in fp32 (a copy only where they are not fp32)
    values = v.to(wide)  # (b, h, t, d_v)
    step = max(1, MATH_BLOCK // max(1, b * heads * t))
    for low in range(0, s, step):
        high = min(s, low + step)
        block = q[:, :, low:high].to(wide).reshape(b, kv_heads, groups * (high - low), dim)  # (b, h, g·n, d)
        scores = (block @ keys_t).mul_(scale)  # (b, h, g·n, t)
        if causal:
            i = torch.arange(low, high, device=q.device)[:, None]
            j = torch.arange(t, device=q.device)[None, :]
            scores = scores.view(b, kv_heads, groups, high - low, t).masked_fill_(j > i, float("-inf")).view(
                b, kv_heads, groups * (high - low), t)
        block_lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # (b, h, g·n, 1)
        got = scores.sub_(block_lse).exp_() @ values  # (b, h, g·n, d_v)
        out[:, :, low:high] = got.view(b, heads, high - low, -1)
        lse[:, :, low:high] = block_lse.view(b, heads, high - low)
    return out, lse


def _cpu_flash(q, k, v, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


# The CUDA kernels by their schemas' argument names (the same in torch 2.11 and 2.13), so that a torch whose positions
# moved raises instead of binding another argument.
def _cuda_flash(q, k, v, causal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, dropout_p=0.0, is_causal=causal, return_debug_mask=False, scale=scale)[:2]
    return out, lse[..., :q.shape[2]]


def _efficient(q, k, v, causal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, attn_bias=None, compute_log_sumexp=True, dropout_p=0.0, is_causal=causal, scale=scale)[:2]
    return out, lse[..., :q.shape[2]]  # padded along the queries (to a multiple of 32)


def _low_precision_or_fp32(q, k, v) -> bool:
    return q.dtype in (torch.float32, torch.bfloat16, torch.float16) and q.dtype == k.dtype == v.dtype


MATH = Backend("math", _math, lambda q, k, v: True, top_left=True, grouped=True)
BACKENDS: list[Backend] = [
    Backend("cpu_flash", _cpu_flash,
            lambda q, k, v: (q.device.type == "cpu" and _low_precision_or_fp32(q, k, v)
                             and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
                             and q.shape[-1] == k.shape[-1] == v.shape[-1]),
            top_left=True, grouped=True),
    Backend("cuda_flash", _cuda_flash,
            lambda q, k, v: (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16)
                             and q.dtype == k.dtype == v.dtype and q.shape[-1] == k.shape[-1] == v.shape[-1] <= 256),
            top_left=False, grouped=True),
    Backend("efficient", _efficient,
            lambda q, k, v: q.device.type == "cuda" and _low_precision_or_fp32(q, k, v) and q.shape[-1] == k.shape[-1],
            top_left=True, grouped=True),
]


@contextmanager
def forced(name: str):
    """Calls inside run on backend `name` alone (math where it does not take a call or fails its probe): tests hold
    the path a GPU takes (a backend other than cpu_flash) to the oracle on CPU with forced("math")."""
    global _FORCED
    before, _FORCED = _FORCED, name
    try:
        yield
    finally:
        _FORCED = before


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """(out (b, H, s, d_v), lse (b, H, s) fp32): q (b, H, s, d) over k, v (b, h, t, ·), top-left causal if asked."""
    b, heads, s, _ = q.shape
    kv_heads, t = k.shape[1], k.shape[2]
    if not t or not s:  # nothing seen: a zero output that weighs nothing in a merge
        return (q.new_zeros((b, heads, s, v.shape[-1])),
                torch.full((b, heads, s), float("-inf"), dtype=torch.float32, device=q.device))
    groups = heads // kv_heads
    if not causal and groups > 1:
        # Every query sees every key: the query heads of a KV head stack along the queries, a plain multi-head call.
        out, lse = attend(q.reshape(b, kv_heads, groups * s, q.shape[-1]), k, v, False, scale)  # (b, h, g·s, ·)
        return out.reshape(b, heads, s, -1), lse.reshape(b, heads, s)
    for backend in _candidates():
        if not backend.takes(q, k, v):
            continue
        got = _try(backend, q, k, v, causal, scale)
        if got is not None:
            return got
    CALLS["math"] += 1
    return run(MATH, q, k, v, causal, scale)


def run(backend: Backend, q, k, v, causal: bool, scale: float):
    """One kernel call of a real attention call (pairs.py counts the pairs each executes; a probe's are not here)."""
    return backend.run(q, k, v, causal, scale)


def attend_shared(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """(out (r, H, s, d_v), lse (r, H, s) fp32): rows q (r, H, s, d) over one set of keys k, v (h, t, ·) that each of
    their queries sees whole (a node's kept keys, read where they lie). Rows, slots and the query heads of a KV head
    stack along the queries: one product (1, h, g·r·s, d) against the keys as they are, never expanded."""
    r, heads, s, dim = q.shape
    kv_heads = k.shape[0]
    groups = heads // kv_heads
    stacked = q.reshape(r, kv_heads, groups, s, dim).permute(1, 2, 0, 3, 4).reshape(1, kv_heads, groups * r * s, dim)
    out, lse = attend(stacked, k[None], v[None], False, scale)  # (1, h, g·r·s, d_v), (1, h, g·r·s)
    out = out.reshape(kv_heads, groups, r, s, -1).permute(2, 0, 1, 3, 4).reshape(r, heads, s, -1)
    lse = lse.reshape(kv_heads, groups, r, s).permute(2, 0, 1, 3).reshape(r, heads, s)
    return out, lse


def _candidates() -> list[Backend]:
    if _FORCED is None:
        return BACKENDS
    return [backend for backend in BACKENDS if backend.name == _FORCED]


def _try(backend: Backend, q, k, v, causal: bool, scale: float):
    """The call on `backend` in the first way its probe passed (grouped heads as given, then keys repeated), or
    None where none did or it raised."""
    heads, kv_heads, s, t = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    square = not causal or s == t
    if causal and not square and not backend.top_left:
        if s < t:  # keys after the last query are seen by none: drop them, and the call is square
            k, v, t, square = k[:, :, :s], v[:, :, :s], s, True
        else:  # s > t: queries t .. s - 1 see every key; split into a square causal call and an unmasked one
            return _split(backend, q, k, v, scale)
    ways = [True, False] if heads != kv_heads and causal else [heads != kv_heads]
    for grouped in ways:
        if grouped and not backend.grouped:
            continue
        kind = (backend.name, str(q.device), q.dtype, q.shape[-1], v.shape[-1], causal, square, grouped)
        if not _probe(backend, kind):
            continue
        keys, values = k, v
        if heads != kv_heads and not grouped:
            # A kernel that does not take fewer key heads: only a causal call gets here, whose keys are a pass's own
            # (or a window's last context keys, part B of window_cascade): those are repeated, never a context whole.
            keys = k.repeat_interleave(heads // kv_heads, dim=1)
            values = v.repeat_interleave(heads // kv_heads, dim=1)
        try:
            out, lse = run(backend, q, keys, values, causal, scale)
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            with _LOCK:
                _PASSED.discard(kind)
                REJECTED[kind] = f"raised on a call: {type(exc).__name__}: {first_line(exc)}"
            CALLS[f"{backend.name} raised"] += 1
            continue
        CALLS[backend.name] += 1
        return out, lse.float()
    return None


def _split(backend: Backend, q, k, v, scale: float):
    """Top-left causal with more queries than keys, on a kernel whose causal mask is square-only: queries 0 .. t - 1
    causal (square), the rest over every key (unmasked); None where either way has not passed its probe."""
    t = k.shape[2]
    head = _try(backend, q[:, :, :t], k, v, True, scale)
    if head is None:
        return None
    tail = attend(q[:, :, t:], k, v, False, scale)
    return torch.cat([head[0], tail[0]], dim=2), torch.cat([head[1], tail[1]], dim=2)


def _bound(dtype: torch.dtype, magnitude: float) -> float:
    """How far a kernel may be from `math` on the probe: a kernel rounds its probabilities (and its output) to the
    dtype before the product with the values, at most half an ulp each, a few roundings deep; fp32 kernels sum in
    another order (scores of up to 512 terms, at ~1e-7 each). 2 ulps of the dtype, at least 64 of fp32, times the
    magnitude compared (max |v| for the output, max |lse| for the lse, at least 1). A kernel aligned otherwise, or
    whose lse is in another base, is off by a good part of the values' own size."""
    ulp = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return max(2 * ulp, 64 * torch.finfo(torch.float32).eps) * max(1.0, magnitude)


def _probe(backend: Backend, kind: tuple) -> bool:
    """Whether `backend` computes calls of `kind` as math does; run once per kind, on small random inputs."""
    if kind in _PASSED:  # every call after the first of its kind: no lock (a set's membership test is atomic)
        return True
    with _LOCK:
        if kind in _PASSED:
            return True
        if kind in REJECTED:
            return False
    _name, device, dtype, dim, value_dim, causal, square, grouped = kind
    heads, kv_heads = (4, 2) if grouped else (2, 2)
    # Lengths off any tile size (the efficient kernel pads its lse to 32); a non-square causal kind both ways.
    shapes = [(37, 37)] if square else [(5, 23), (23, 5)]
    generator = torch.Generator().manual_seed(35)
    why = None
    for s, t in shapes:
        # The layouts the cascade passes: transformers' (b, s, H, d) queries seen as (b, H, s, d), keys a slice.
        q = (torch.randn(2, s, heads, dim, generator=generator) * 2).to(device=device, dtype=dtype).transpose(1, 2)
        k = torch.randn(2, kv_heads, t + 3, dim, generator=generator).to(device=device, dtype=dtype)[:, :, 3:]
        v = torch.randn(2, kv_heads, t + 3, value_dim, generator=generator).to(device=device, dtype=dtype)[:, :, 3:]
        scale = dim ** -0.5
        expected, expected_lse = _math(q, k, v, causal, scale)
        try:
            out, lse = backend.run(q, k, v, causal, scale)
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            why = f"raised on the probe: {type(exc).__name__}: {first_line(exc)}"
            break
        if out.shape != expected.shape or lse.shape != expected_lse.shape:
            why = f"returned shapes {tuple(out.shape)}, {tuple(lse.shape)} on the probe"
            break
        out_error = float((out.float() - expected.float()).abs().max())
        lse_error = float((lse.float() - expected_lse).abs().max())
        if not (out_error <= _bound(dtype, float(v.float().abs().max()))
                and lse_error <= _bound(dtype, float(expected_lse.abs().max()))):
            why = f"disagrees with math on the probe (max |Δ out| = {out_error:.3g}, |Δ lse| = {lse_error:.3g})"
            break
    with _LOCK:
        if why is None:
            _PASSED.add(kind)
        else:
            REJECTED[kind] = why
    return why is None


def reset() -> None:
    """Forget every probe's verdict and the counts (tests)."""
    with _LOCK:
        _PASSED.clear()
        REJECTED.clear()
    CALLS.clear()
