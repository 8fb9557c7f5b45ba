"""Cascade attention (klpipe/model/cascade.py): a tree pass's rows attend over their context where it lies.

Against naive softmax attention over each row's explicit keys, and end to end against the fp32 oracle,
both when the cascade takes a call and when it hands it back to transformers' sdpa over gathered slots.
"""

import numpy as np
import pytest
import torch

from klpipe.model import ModelSpec, ReferenceModel, cascade, packing
from klpipe.model.context_cache import Kept, _by_parent, _context_parts
from klpipe.precompute.logprobs import ForwardStats, chunk_logprobs
from tests.helpers import TINY_GEMMA, TINY_LLAMA, agent_rows, worst_error

HEADS, KV_HEADS, DIM = 4, 2, 16


def naive(q, keys, values, own):
    """One row: q (H, T, d) over context keys (h, C, d) then its `own` real slots' keys (h, own, d), causal
    over its own, softmax in fp64."""
    groups = HEADS // KV_HEADS
    k = keys.repeat_interleave(groups, dim=0).double()
    v = values.repeat_interleave(groups, dim=0).double()
    q = q[:, :own].double()
    scores = q @ k.transpose(-1, -2) * DIM ** -0.5
    context = k.shape[1] - own
    allowed = torch.arange(k.shape[1])[None, :] <= context + torch.arange(own)[:, None]
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v


@pytest.mark.parametrize("layout", ["b H T d", "b T H d"])
@pytest.mark.parametrize("native_gqa", [True, False])  # False: a kernel that needs the own keys repeated
@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])  # bf16: its rounding (worst seen 0.0065)
def test_attend_matches_naive_attention_over_each_rows_own_path(layout, native_gqa, dtype, bound, monkeypatch):
    if native_gqa and not cascade._native_gqa():
        pytest.skip("this torch's CPU flash kernel does not take fewer key heads than query heads")
    monkeypatch.setattr(cascade, "_native_gqa", lambda: native_gqa)
    torch.manual_seed(0)
    layer = 0
    # Nodes' own lengths: 2 and 3 continue 1; 4 continues 2; 6 continues 5; 7 and 8 continue 6.
    lengths = {1: 30, 2: 7, 3: 12, 4: 1, 5: 10, 6: 4, 7: 3, 8: 2}
    kept = {n: [Kept(keys=torch.randn(KV_HEADS, m, DIM, dtype=dtype), values=torch.randn(KV_HEADS, m, DIM, dtype=dtype))]
            for n, m in lengths.items()}
    # Rows' ancestors: six parents under two roots, a row without one, and parent 2's rows in two runs.
    paths = [[1, 2], [1, 2], [1], [1, 2, 4], [], [1, 3], [1, 2], [5, 6, 7], [5, 6, 8]]
    own = np.array([5, 9, 1, 6, 9, 3, 4, 2, 7])  # real fed slots per row; the rest of T = 9 are pads after them
    fed = int(own.max())
    if layout == "b H T d":
        q = torch.randn(len(paths), HEADS, fed, DIM, dtype=dtype)
    else:  # transformers' queries: a (b, T, H, d) projection seen as (b, H, T, d)
        q = torch.randn(len(paths), fed, HEADS, DIM, dtype=dtype).transpose(1, 2)
    k = torch.randn(len(paths), KV_HEADS, fed, DIM, dtype=dtype)
    v = torch.randn(len(paths), KV_HEADS, fed, DIM, dtype=dtype)
    parts = _context_parts(paths)
    # Each row's path in parts: what adjacent runs open with (the row without context parts them), then the rest;
    # row 3 merges three times, and two parts join nodes.
    assert parts == [(slice(0, 4), [1]), (slice(5, 7), [1]), (slice(7, 9), [5, 6]), (slice(0, 2), [2]),
                     (slice(3, 4), [2, 4]), (slice(5, 6), [3]), (slice(6, 7), [2]), (slice(7, 8), [7]),
                     (slice(8, 9), [8])]
    out = cascade.PassContexts(parts, kept, layer).attend(q, k, v, None)  # (b, T, H, d)
    assert out.shape == (len(paths), fed, HEADS, DIM) and out.is_contiguous() and out.dtype == dtype
    worst = 0.0
    for row, path in enumerate(paths):
        keys = torch.cat([kept[n][layer].keys for n in path] + [k[row, :, :own[row]]], dim=1)
        values = torch.cat([kept[n][layer].values for n in path] + [v[row, :, :own[row]]], dim=1)
        expected = naive(q[row], keys, values, int(own[row]))  # (H, own, d)
        got = out[row, :own[row]].transpose(0, 1)
        worst = max(worst, float((got.double() - expected).abs().max()))
    assert worst < bound


def test_one_parent_for_every_row_is_one_run_and_one_part():
    assert _by_parent([[3, 5], [3, 5], [3, 5]]) == [(slice(0, 3), [3, 5])]
    assert _context_parts([[3, 5], [3, 5], [3, 5]]) == [(slice(0, 3), [3, 5])]


def test_runs_share_only_the_nodes_they_all_open_with():
    # A run whose whole path is shared has no part of its own; runs under two roots share nothing.
    assert _context_parts([[3, 5, 7], [3, 5, 8], [3, 5]]) == [(slice(0, 3), [3, 5]), (slice(0, 1), [7]),
                                                              (slice(1, 2), [8])]
    assert _context_parts([[1, 2], [9, 4]]) == [(slice(0, 1), [1, 2]), (slice(1, 2), [9, 4])]
    assert _context_parts([[], []]) == []


@pytest.fixture(scope="module")
def llama():
    reference = ReferenceModel.load(ModelSpec(str(TINY_LLAMA), dtype="float32", device="cpu"))
    # At load, only packed rows' attention (sdpa outside a packed batch); the cascade comes only for a tree
    # (precompute/sharing.py).
    assert not reference.cascade and reference.packed
    assert reference.model.config._attn_implementation == packing.NAME
    assert reference.use_cascade() is None  # the probe agrees: nothing to log
    return reference


def test_the_llama_attends_in_place_on_cpu_and_matches_the_oracle(llama):
    assert llama.cascade and llama.model.config._attn_implementation == cascade.NAME
    rows = agent_rows(llama.vocab_size)
    cascade.CALLS.clear()
    results = chunk_logprobs(llama, rows, 24, 1.0, "on", ForwardStats(), max_cache_tokens=10**9)
    assert worst_error(llama.model, rows, results) <= 1e-4
    assert cascade.CALLS["cascade"] > 0 and cascade.CALLS["gathered"] == 0
    cascade.CALLS.clear()
    llama.score_batch(rows)  # rows run whole: packed (packing.py), no tree pass
    assert not cascade.CALLS


def test_a_call_the_cascade_cannot_take_gets_the_gathered_slots(llama, monkeypatch):
    monkeypatch.setattr(cascade, "_exact_here", lambda *args: False)
    rows = agent_rows(llama.vocab_size, seed=1)
    cascade.CALLS.clear()
    results = chunk_logprobs(llama, rows, 24, 1.0, "on", ForwardStats(), max_cache_tokens=10**9)
    assert worst_error(llama.model, rows, results) <= 1e-4
    assert cascade.CALLS["gathered"] > 0 and cascade.CALLS["cascade"] == 0


@pytest.mark.parametrize("kwargs, exact", [({}, True), ({"position_ids": 1, "sliding_window": None}, True),
                                           ({"softcap": 30.0}, False), ({"s_aux": 1}, False),
                                           ({"sliding_window": 8}, False), ({"anything_new": 1}, False),
                                           ({"is_causal": True}, True), ({"is_causal": False}, False)])
def test_only_plain_causal_attention_takes_the_cascade(kwargs, exact):
    module = torch.nn.Module()
    q, kv = torch.zeros(1, 4, 3, 8), torch.zeros(1, 2, 3, 8)
    assert cascade._exact_here(module, q, kv, kv, 0.0, kwargs) is exact
    assert not cascade._exact_here(module, q, kv, kv, 0.1, {})  # dropout
    assert not cascade._exact_here(module, q, kv, torch.zeros(1, 2, 3, 4), 0.0, {})  # another value head size
    module.is_causal = False
    assert not cascade._exact_here(module, q, kv, kv, 0.0, {})


def test_gemma4_keeps_its_right_layout_and_transformers_sdpa():
    # Its KV-shared layers read the full keys update returns, and its prefill skips layers: no cascade.
    gemma = ReferenceModel.load(ModelSpec(str(TINY_GEMMA), dtype="float32", device="cpu"))
    assert gemma.use_cascade() is None
    assert not gemma.cascade and gemma.model.config.get_text_config()._attn_implementation != cascade.NAME
