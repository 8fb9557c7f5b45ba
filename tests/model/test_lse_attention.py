"""Attention that returns its log-sum-exp (klpipe/model/attention/lse_attention.py): each backend that runs on CPU
against a naive fp64 attention written here, and the probe that keeps a kernel whose assumption does not hold from ever
computing a call (a causal mask aligned bottom-right, an lse in another base, a kernel that raises), the call then
computed by plain torch, exactly.
"""

import math

import pytest
import torch

from klpipe.model.attention import lse_attention
from klpipe.model.attention.lse_attention import Backend

# Bounds (out, lse), from the dtype's rounding: fp32 kernels sum in another order than fp64 (1e-5 on outputs and lse
# of order 1: ~1e-7 per operation, a few hundred deep); bf16 ones round their probabilities and output to bf16 (2^-9
# each, a few roundings deep: 2^-7 of the values' size), and may round within their lse as far as half a bf16 ulp
# (2^-9; torch's CPU flash kernel is 1.7e-5 of |lse| off on bf16 inputs, where math's fp32 is 1e-7).
BOUNDS = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2.0 ** -7, 2.0 ** -9)}


def naive(q, k, v, causal, scale, bottom_right=False):
    """(out, lse) in fp64: q (b, H, s, d) over k, v (b, h, t, ·), keys repeated per query head, query i seeing key j
    iff j <= i (top-left causal) or j <= i + t - s (bottom-right)."""
    groups = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(groups, dim=1)
    v = v.double().repeat_interleave(groups, dim=1)
    scores = q.double() @ k.transpose(-1, -2) * scale  # (b, H, s, t)
    if causal:
        s, t = scores.shape[-2:]
        i, j = torch.arange(s)[:, None], torch.arange(t)[None, :]
        scores = scores.masked_fill(j > i + (t - s if bottom_right else 0), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ v, lse


def inputs(s, t, heads, kv_heads, dim, dtype, seed=0):
    """Random q (2, H, s, d) as transformers hands it ((b, s, H, d) seen transposed), k, v (2, h, t, d)."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, s, heads, dim, generator=generator).to(dtype).transpose(1, 2)
    k = torch.randn(2, kv_heads, t, dim, generator=generator).to(dtype)
    v = torch.randn(2, kv_heads, t, dim, generator=generator).to(dtype)
    return q, k, v


@pytest.fixture(autouse=True)
def fresh():
    lse_attention.reset()
    yield
    lse_attention.reset()


def assert_close(got, expected, v, dtype):
    out, lse = got
    expected_out, expected_lse = expected
    out_bound, lse_bound = BOUNDS[dtype]
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == expected_out.shape
    assert float((out.double() - expected_out).abs().max()) <= out_bound * max(1.0, float(v.abs().max()))
    assert float((lse.double() - expected_lse).abs().max()) <= lse_bound * max(1.0, float(expected_lse.abs().max()))


@pytest.mark.parametrize("backend", ["cpu_flash", "math"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [16, 512])  # 512: Gemma 4's full layers
@pytest.mark.parametrize("causal, s, t", [(False, 9, 21), (True, 13, 13), (True, 5, 17), (True, 17, 5)])
@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (6, 1)])
def test_each_backend_matches_naive_attention(backend, dtype, dim, causal, s, t, heads, kv_heads):
    q, k, v = inputs(s, t, heads, kv_heads, dim, dtype)
    with lse_attention.forced(backend):
        got = lse_attention.attend(q, k, v, causal, dim ** -0.5)
    assert_close(got, naive(q, k, v, causal, dim ** -0.5), v, dtype)
    assert dict(lse_attention.CALLS) == {backend: 1} and not lse_attention.REJECTED


def test_the_math_backend_blocks_its_queries_and_stays_exact(monkeypatch):
    monkeypatch.setattr(lse_attention, "MATH_BLOCK", 2 * 4 * 17 * 3)  # 3 queries a block: 5 blocks, the last short
    q, k, v = inputs(13, 17, 4, 2, 16, torch.float32)
    for causal in (False, True):
        with lse_attention.forced("math"):
            got = lse_attention.attend(q, k, v, causal, 0.25)
        assert_close(got, naive(q, k, v, causal, 0.25), v, torch.float32)


@pytest.mark.parametrize("backend", ["cpu_flash", "math"])
def test_rows_over_shared_keys_read_them_once(backend):
    # Three rows' queries over one node's keys (h, t, d): folded along the queries, the keys never expanded.
    q, _, _ = inputs(5, 1, 4, 2, 16, torch.float32)
    q = torch.cat([q, q[:1] * 0.5])  # (3, H, s, d)
    generator = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 11, 16, generator=generator), torch.randn(2, 11, 16, generator=generator)
    with lse_attention.forced(backend):
        got = lse_attention.attend_shared(q, k, v, 0.25)
    assert_close(got, naive(q, k.expand(3, *k.shape), v.expand(3, *v.shape), False, 0.25), v, torch.float32)


def test_no_key_seen_weighs_nothing():
    q, k, v = inputs(3, 0, 4, 2, 16, torch.float32)
    out, lse = lse_attention.attend(q, k, v, True, 0.25)
    assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())


def from_naive(**changes):
    """A kernel computed by naive() in the inputs' dtype, changed as asked: a CPU stand-in for a CUDA kernel."""

    def run(q, k, v, causal, scale):
        if changes.get("raises_when") and changes["raises_when"](q, k):
            raise RuntimeError("no kernel for these inputs")
        out, lse = naive(q, k, v, causal, scale, changes.get("bottom_right", False))
        return out.to(q.dtype), (lse / math.log(2) if changes.get("log2") else lse).float()

    return Backend("stand_in", run, lambda q, k, v: q.device.type == "cpu", top_left=changes.get("top_left", True),
                   grouped=True)


def attend_with(backend, monkeypatch, q, k, v, causal):
    monkeypatch.setattr(lse_attention, "BACKENDS", [backend])
    got = lse_attention.attend(q, k, v, causal, 0.25)
    assert_close(got, naive(q, k, v, causal, 0.25), v, q.dtype)  # whatever ran it, the numbers are exact


@pytest.mark.parametrize("s, t", [(5, 17), (17, 5)])
def test_a_kernel_aligned_bottom_right_is_never_used_for_a_non_square_causal_call(s, t, monkeypatch):
    wrong = from_naive(bottom_right=True)  # claims top-left, as CUDA's flash kernel would if taken at its word
    q, k, v = inputs(s, t, 4, 2, 16, torch.float32)
    attend_with(wrong, monkeypatch, q, k, v, True)
    assert dict(lse_attention.CALLS) == {"math": 1}
    # Rejected with the heads grouped, and with the keys repeated.
    assert sorted(kind[5:] for kind in lse_attention.REJECTED) == [(True, False, False), (True, False, True)]
    assert all("disagrees with math" in why for why in lse_attention.REJECTED.values())
    # Square, bottom-right is top-left: the same kernel passes that kind's probe and runs it.
    q, k, v = inputs(9, 9, 4, 2, 16, torch.float32)
    attend_with(wrong, monkeypatch, q, k, v, True)
    assert lse_attention.CALLS["stand_in"] == 1 and len(lse_attention.REJECTED) == 2


@pytest.mark.parametrize("s, t", [(5, 17), (17, 5)])
def test_a_kernel_known_square_only_gets_causal_calls_square(s, t, monkeypatch):
    # As cuda_flash (top_left False): s < t drops the keys no query sees, s > t splits off the queries that see all.
    square_only = from_naive(bottom_right=True, top_left=False)
    q, k, v = inputs(s, t, 4, 2, 16, torch.float32)
    attend_with(square_only, monkeypatch, q, k, v, True)
    assert dict(lse_attention.CALLS) == {"stand_in": 1 if s < t else 2} and not lse_attention.REJECTED


def test_a_kernel_whose_lse_is_in_another_base_is_never_used(monkeypatch):
    q, k, v = inputs(7, 19, 4, 2, 16, torch.bfloat16)
    attend_with(from_naive(log2=True), monkeypatch, q, k, v, False)
    assert dict(lse_attention.CALLS) == {"math": 1}
    assert "disagrees with math" in next(iter(lse_attention.REJECTED.values()))


def test_a_kernel_that_raises_on_its_probe_or_on_a_call_leaves_it_to_math(monkeypatch):
    q, k, v = inputs(7, 7, 4, 2, 16, torch.float32)
    attend_with(from_naive(raises_when=lambda q, k: True), monkeypatch, q, k, v, True)
    assert lse_attention.CALLS["math"] == 1 and all("raised on the probe" in why
                                                    for why in lse_attention.REJECTED.values())
    lse_attention.reset()
    # Passes its probe (37 queries), raises on a longer call: that call, and every later one of its kind, is math's.
    long = from_naive(raises_when=lambda q, k: q.shape[2] > 40)
    q, k, v = inputs(50, 50, 2, 2, 16, torch.float32)
    attend_with(long, monkeypatch, q, k, v, True)
    assert dict(lse_attention.CALLS) == {"stand_in raised": 1, "math": 1}
    assert "raised on a call" in next(iter(lse_attention.REJECTED.values()))
    attend_with(long, monkeypatch, *inputs(9, 9, 2, 2, 16, torch.float32), True)
    assert lse_attention.CALLS["math"] == 2


def test_a_kernel_without_grouped_heads_gets_a_causal_calls_keys_repeated(monkeypatch):
    ungrouped = from_naive(raises_when=lambda q, k: q.shape[1] != k.shape[1])
    q, k, v = inputs(9, 9, 4, 2, 16, torch.float32)
    attend_with(ungrouped, monkeypatch, q, k, v, True)
    assert dict(lse_attention.CALLS) == {"stand_in": 1}
    (kind, why), = lse_attention.REJECTED.items()
    assert kind[-1] is True and "raised on the probe" in why  # grouped heads rejected, repeated keys passed
    lse_attention.reset()
    attend_with(ungrouped, monkeypatch, *inputs(9, 21, 4, 2, 16, torch.float32), False)  # folded: never grouped
    assert dict(lse_attention.CALLS) == {"stand_in": 1} and not lse_attention.REJECTED


def test_the_cpu_flash_backend_passes_its_probes_for_every_kind_the_cascade_makes():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for dim in (16, 512):
            for causal, square, grouped in ((False, True, False), (True, True, True), (True, False, True)):
                kind = ("cpu_flash", "cpu", dtype, dim, dim, causal, square, grouped)
                backend = next(b for b in lse_attention.BACKENDS if b.name == "cpu_flash")
                assert lse_attention._probe(backend, kind), lse_attention.REJECTED


def test_a_forced_backend_that_does_not_take_a_call_leaves_it_to_math():
    q, k, v = inputs(5, 5, 2, 2, 16, torch.float64)  # no kernel takes fp64
    with lse_attention.forced("cpu_flash"):
        got = lse_attention.attend(q, k, v, True, 0.25)
    expected = naive(q, k, v, True, 0.25)
    assert float((got[0] - expected[0]).abs().max()) < 1e-12 and dict(lse_attention.CALLS) == {"math": 1}


@pytest.mark.parametrize("name", ["cuda_flash", "efficient"])
def test_the_cuda_kernels_bind_their_arguments_and_return_one_lse_per_query(name):
    # No GPU here: torch's meta kernels give the shapes the CUDA ones return, and bind the arguments by the same
    # schema. The efficient kernel pads its lse along the queries (37 -> 64); the backend slices it off.
    backend = next(b for b in lse_attention.BACKENDS if b.name == name)
    q = torch.empty(2, 4, 37, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 4, 23, 64, device="meta", dtype=torch.bfloat16)
    for causal in (False, True):
        out, lse = backend.run(q, k, k, causal, 0.125)
        assert out.shape == (2, 4, 37, 64) and lse.shape == (2, 4, 37) and lse.dtype == torch.float32
    raw = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, k, None, True)[1]
    assert raw.shape == (2, 4, 64)
    assert not backend.takes(*inputs(5, 5, 2, 2, 16, torch.bfloat16))  # CPU tensors: CUDA kernels never tried
