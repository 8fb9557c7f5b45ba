"""Cascade attention (klpipe/model/attention/cascade.py): a tree pass's rows attend over their context where it lies.

Against naive softmax attention over each row's explicit keys, and end to end against the fp32 oracle,
both when the cascade takes a call and when it hands it back to transformers' sdpa over gathered slots.
"""

import dataclasses
from contextlib import contextmanager, nullcontext

import numpy as np
import pytest
import torch

from klpipe.model import ModelSpec, ReferenceModel
from klpipe.model.attention import cascade, lse_attention, packing
from klpipe.model.attention.context_cache import Kept
from klpipe.model.attention.context_parts import by_parent, context_parts
from klpipe.precompute.logprobs import ForwardStats, chunk_logprobs
from tests.helpers import TINY_GEMMA, TINY_LLAMA, agent_rows, worst_error

HEADS, KV_HEADS, DIM = 4, 2, 16


def naive(q, keys, values, own):
    """One row: q (H, T, d) over context keys (h, C, d) then its `own` real slots' keys (h, own, d), causal
    over its own, softmax in fp64."""
    context = keys.shape[1] - own
    return naive_windowed(q[:, :own], keys, values, torch.arange(keys.shape[1]), context + torch.arange(own), None)


BACKENDS = ["cpu_flash", "cpu_flash, keys repeated", "math"]


@contextmanager
def backend(name: str, monkeypatch):
    """The cascade's kernels as `name` alone: torch's CPU flash kernel taking fewer key heads than query heads, the
    same kernel as one that needs them repeated (a causal call's keys repeated), or plain torch (the path a GPU takes
    where no kernel passed its probe). Asserts that calls ran there."""
    lse_attention.reset()
    if name == "cpu_flash, keys repeated":
        flash = next(b for b in lse_attention.BACKENDS if b.name == "cpu_flash")
        monkeypatch.setattr(lse_attention, "BACKENDS", [dataclasses.replace(flash, grouped=False)])
    with lse_attention.forced(name.split(",")[0]):
        yield
    assert lse_attention.CALLS[name.split(",")[0]] > 0 and set(lse_attention.CALLS) == {name.split(",")[0]}
    assert not lse_attention.REJECTED


@pytest.mark.parametrize("layout", ["b H T d", "b T H d"])
@pytest.mark.parametrize("kernel", BACKENDS)
# bf16: its rounding (worst seen 0.0065)
@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_attend_matches_naive_attention_over_each_rows_own_path(layout, kernel, dtype, bound, monkeypatch):
    torch.manual_seed(0)
    layer = 0
    # Nodes' own lengths: 2 and 3 continue 1; 4 continues 2; 6 continues 5; 7 and 8 continue 6.
    lengths = {1: 30, 2: 7, 3: 12, 4: 1, 5: 10, 6: 4, 7: 3, 8: 2}
    kept = {n: [Kept(keys=torch.randn(KV_HEADS, m, DIM, dtype=dtype),
                     values=torch.randn(KV_HEADS, m, DIM, dtype=dtype))]
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
    parts = context_parts(paths)
    # Each row's path in parts: what adjacent runs open with (the row without context parts them), then the rest;
    # row 3 merges three times, and two parts join nodes.
    assert parts == [(slice(0, 4), [1], None), (slice(5, 7), [1], None), (slice(7, 9), [5, 6], None),
                     (slice(0, 2), [2], None), (slice(3, 4), [2, 4], None), (slice(5, 6), [3], None),
                     (slice(6, 7), [2], None), (slice(7, 8), [7], None), (slice(8, 9), [8], None)]
    with backend(kernel, monkeypatch):
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
    assert by_parent([[3, 5], [3, 5], [3, 5]]) == [(slice(0, 3), [3, 5], None)]
    assert context_parts([[3, 5], [3, 5], [3, 5]]) == [(slice(0, 3), [3, 5], None)]


def test_runs_share_only_the_nodes_they_all_open_with():
    # A run whose whole path is shared has no part of its own; runs under two roots share nothing.
    assert context_parts([[3, 5, 7], [3, 5, 8], [3, 5]]) == [(slice(0, 3), [3, 5], None), (slice(0, 1), [7], None),
                                                              (slice(1, 2), [8], None)]
    assert context_parts([[1, 2], [9, 4]]) == [(slice(0, 1), [1, 2], None), (slice(1, 2), [9, 4], None)]
    assert context_parts([[], []]) == []


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
    assert cascade.CALLS["cascade"] > 0 and cascade.CALLS["gathered"] == 0 and cascade.CALLS["packed"] > 0
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
    # The first packed pass met the call and ran again as a batch; so did every later pass.
    assert not llama.tree_passes_packed
    llama.tree_passes_packed = True


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
    # A sliding layer's call: exact only with the window its cache knows.
    assert cascade._exact_here(module, q, kv, kv, 0.0, {"sliding_window": 8}, 8)
    assert not cascade._exact_here(module, q, kv, kv, 0.0, {"sliding_window": 9}, 8)
    assert not cascade._exact_here(module, q, kv, kv, 0.0, {}, 8)  # a window the model does not pass
    assert cascade._exact_here(module, q[:, :, -1:], kv, kv, 0.0, {})  # the last slot's query alone
    # On any device (lse_attention picks a kernel there, or plain torch): a GPU's tensors as the meta device's.
    assert cascade._exact_here(module, q.to("meta"), kv.to("meta"), kv.to("meta"), 0.0, {})
    assert not cascade._exact_here(module, q[:, :, -2:], kv, kv, 0.0, {})
    module.is_causal = False
    assert not cascade._exact_here(module, q, kv, kv, 0.0, {})


def naive_windowed(q, keys, values, positions, query_positions, window):
    """One row: q (H, n, d) at query_positions (n,) over keys, values (h, m, d) at positions (m,), each query over the
    keys at (p − window, p] (at most p where window is None), softmax in fp64."""
    groups = q.shape[0] // keys.shape[0]
    k = keys.repeat_interleave(groups, dim=0).double()
    v = values.repeat_interleave(groups, dim=0).double()
    scores = q.double() @ k.transpose(-1, -2) * DIM ** -0.5
    p, j = query_positions[:, None], positions[None, :]
    allowed = (j <= p) & ((j > p - window) if window is not None else True)
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v


@pytest.mark.parametrize("window", [None, 4, 6, 16])  # shorter than the own tokens, than the contexts; longer
@pytest.mark.parametrize("layout, last_only", [("left", False), ("right", False), ("right", True)])
@pytest.mark.parametrize("kernel", BACKENDS)
def test_attend_in_either_layout_and_any_window_matches_naive_attention(window, layout, last_only, kernel,
                                                                        monkeypatch):
    torch.manual_seed(1)
    layer = 0
    lengths = {1: 30, 2: 7, 3: 12, 4: 1, 5: 10, 6: 4, 7: 3, 8: 2}
    parent = {2: 1, 3: 1, 4: 2, 6: 5, 7: 6, 8: 6}
    starts = np.zeros(9, dtype=np.int64)
    for node in sorted(lengths):
        starts[node] = starts[parent[node]] + lengths[parent[node]] if node in parent else 0
    ends = starts + np.array([0] + [lengths[n] for n in range(1, 9)])
    kept = {n: [Kept(keys=torch.randn(KV_HEADS, m, DIM), values=torch.randn(KV_HEADS, m, DIM))]
            for n, m in lengths.items()}
    paths = [[1, 2], [1, 2], [1], [1, 2, 4], [], [1, 3], [1, 2], [5, 6, 7], [5, 6, 8]]
    own = np.array([5, 9, 1, 6, 9, 3, 4, 2, 7])
    fed = int(own.max())
    node_start = np.array([ends[path[-1]] if path else 0 for path in paths])
    if layout == "left":  # each row's own tokens first, pads after
        cached = node_start
        real = np.stack([np.zeros_like(own), own])
    else:  # rows end at the last slot; a short node feeds the end of its context again, or pads before it
        cached = np.maximum(node_start - (fed - own), 0)
        count = node_start + own - cached
        real = np.stack([fed - count, count])
    q = torch.randn(len(paths), fed, HEADS, DIM).transpose(1, 2)  # transformers' (b, T, H, d) seen as (b, H, T, d)
    k = torch.randn(len(paths), KV_HEADS, fed, DIM)
    v = torch.randn(len(paths), KV_HEADS, fed, DIM)
    runs = by_parent(paths, cached)
    parts = context_parts(paths, cached, ends)
    if layout == "right":  # rows 0 and 1 share a parent but not a context length; row 2 ends inside node 1
        assert runs[0][0] == slice(0, 1) and runs[1][0] == slice(1, 2) and cached[2] < ends[1]
    contexts = cascade.PassContexts(parts, kept, layer, starts, real, runs, window)
    query = q[:, :, -1:] if last_only else q
    with backend(kernel, monkeypatch):
        out = contexts.attend(query, k, v, None)  # (b, q, H, d)
    assert out.shape == (len(paths), query.shape[2], HEADS, DIM) and out.is_contiguous()
    worst = 0.0
    for row, path in enumerate(paths):
        first, count = int(real[0, row]), int(real[1, row])
        context_k, context_v = (torch.cat([kept[n][layer].keys for n in path], dim=1),
                                torch.cat([kept[n][layer].values for n in path], dim=1)) if path else (
            torch.zeros(KV_HEADS, 0, DIM), torch.zeros(KV_HEADS, 0, DIM))
        stop = int(cached[row])
        keys = torch.cat([context_k[:, :stop], k[row, :, first:first + count]], dim=1)
        values = torch.cat([context_v[:, :stop], v[row, :, first:first + count]], dim=1)
        positions = torch.arange(stop + count)
        query_positions = positions[stop:]
        expected = naive_windowed(q[row, :, first:first + count], keys, values, positions, query_positions, window)
        got = out[row].transpose(0, 1)  # (H, q, d)
        if last_only:
            expected, got = expected[:, -1:], got
        else:
            got = got[:, first:first + count]
        worst = max(worst, float((got.double() - expected).abs().max()))
    assert worst < 1e-5


def test_a_kv_shared_layer_reads_the_context_of_the_layer_whose_keys_it_reuses():
    # transformers hands a KV-shared layer what the sharing layer's update returned: the pass's own keys.
    cache = type("Cache", (), {})()
    own = (torch.zeros(1), torch.zeros(1))
    sharing = type("Layer", (), {"new": own, "cascade": object()})()
    gathered = type("Layer", (), {"new": (torch.zeros(1), torch.zeros(1)), "cascade": None})()
    cache.layers = [gathered, sharing, object()]
    assert cascade._owner(cache, *own) is sharing
    assert cascade._owner(cache, *gathered.new) is None  # a layer that gathered its context has no cascade
    assert cascade._owner(cache, torch.zeros(1), own[1]) is None


GEMMA_WINDOW = 12


@pytest.fixture(scope="module")
def gemma_without_shared_layers(tmp_path_factory):
    """A Gemma 4 pattern without KV-shared layers, window 12, GQA: its prefill skips nothing, so the left layout."""
    from transformers import AutoTokenizer, Gemma4ForCausalLM, Gemma4TextConfig

    config = Gemma4TextConfig(
        vocab_size=512, hidden_size=64, hidden_size_per_layer_input=8, intermediate_size=128, num_hidden_layers=5,
        layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32, num_kv_shared_layers=0,
        final_logit_softcapping=30.0, sliding_window=GEMMA_WINDOW, max_position_embeddings=1024)
    path = tmp_path_factory.mktemp("gemma4-left")
    torch.manual_seed(0)
    Gemma4ForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(TINY_LLAMA).save_pretrained(path)
    return ReferenceModel.load(ModelSpec(str(path), dtype="float32", device="cpu"))


def grpo_rows(vocab: int, window: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """GRPO groups: prompts of several windows, eight responses each, from empty to longer than three windows."""
    rng = np.random.default_rng(seed)
    rows = []
    for prompt_len in (3 * window + 5, window - 3):
        prompt = rng.integers(0, vocab, prompt_len)
        rows += [(prompt, rng.integers(0, vocab, n)) for n in (0, 1, 2, window - 1, window, window + 1, 2 * window,
                                                                 3 * window + 4)]
    return [rows[i] for i in rng.permutation(len(rows))]


@pytest.mark.parametrize("model", ["tiny-gemma4", "without shared layers"])
@pytest.mark.parametrize("shape", ["agent", "GRPO"])
def test_gemma4s_sliding_and_kv_shared_layers_take_the_cascade_and_match_the_oracle(model, shape, request):
    if model == "tiny-gemma4":  # window 8, two KV-shared layers: the right layout
        gemma = ReferenceModel.load(ModelSpec(str(TINY_GEMMA), dtype="float32", device="cpu"))
    else:
        gemma = request.getfixturevalue("gemma_without_shared_layers")
    assert gemma.use_cascade() is None  # installed: the probe agrees
    assert gemma.cascade and gemma.model.config.get_text_config()._attn_implementation == cascade.NAME
    window = gemma.model.config.get_text_config().sliding_window
    rows = agent_rows(gemma.vocab_size, window=window) if shape == "agent" else grpo_rows(gemma.vocab_size, window)
    # Small passes, many of them, and wide ones; passes that continue a context packed (tree._run_packed) or, as
    # after a call the cascade cannot take in one, as padded batches.
    for budget, packed in ((3 * window, True), (10 * window, True), (3 * window, False)):
        gemma.tree_passes_packed = packed
        cascade.CALLS.clear()
        results = chunk_logprobs(gemma, rows, budget, 1.0, "on", ForwardStats(), max_cache_tokens=10**9)
        assert worst_error(gemma.model, rows, results) <= 1e-4
        assert cascade.CALLS["gathered"] == 0 and cascade.CALLS["window"] > 0
        assert cascade.CALLS["cascade"] > cascade.CALLS["window"]  # the full layers too
        assert (cascade.CALLS["packed"] > 0) == packed
        if model == "tiny-gemma4":
            assert cascade.CALLS["shared"] > 0
    gemma.tree_passes_packed = True


def _fed_slots(reference, monkeypatch) -> list[int]:
    """Slots each forward of `reference` is fed (input ids, pads included), recorded as the forwards run."""
    fed = []
    body = reference.body

    def counting(*args, **kwargs):
        fed.append(int(kwargs["input_ids"].numel()))
        return body(*args, **kwargs)

    monkeypatch.setattr(reference, "body", counting)
    return fed


@pytest.mark.parametrize("model", ["llama", "without shared layers", "tiny-gemma4"])
@pytest.mark.parametrize("shape", ["agent", "GRPO"])
def test_the_trees_passes_feed_no_pad_and_the_plan_counts_what_was_fed(model, shape, request, monkeypatch):
    """Every pass runs packed, with or without a context, except where a model skips layers for all but each node's
    last position (Gemma 4's KV-shared layers: the right layout); the plan's count of what it feeds (the summary's
    and bench_pairs' figure) is what the forwards were given."""
    if model == "tiny-gemma4":
        reference = ReferenceModel.load(ModelSpec(str(TINY_GEMMA), dtype="float32", device="cpu"))
    else:
        reference = request.getfixturevalue("llama" if model == "llama" else "gemma_without_shared_layers")
    window = getattr(reference.model.config.get_text_config(), "sliding_window", None) or 8
    rows = agent_rows(reference.vocab_size, window=window) if shape == "agent" else grpo_rows(reference.vocab_size,
                                                                                               window)
    reference.use_cascade()
    fed = _fed_slots(reference, monkeypatch)
    stats = ForwardStats()
    results = chunk_logprobs(reference, rows, 6 * window, 1.0, "on", stats, max_cache_tokens=10**9)
    assert worst_error(reference.model, rows, results) <= 1e-4
    assert stats.tree_rows > len(rows) // 2  # rows that need no logprob feed nothing
    assert sum(fed) == stats.padded_tokens
    if model == "tiny-gemma4":  # its prompt passes keep the right layout: some pads, all of them counted
        assert stats.early_only_tokens > 0
    else:
        assert stats.padded_tokens == stats.fed_tokens


@pytest.fixture(scope="module")
def gemma_head_512(tmp_path_factory):
    """Gemma 4 laid out as E2B is, tiny: sliding layers (window 8), full layers of head size 512, two KV-shared
    layers, GQA."""
    from transformers import AutoTokenizer, Gemma4ForCausalLM, Gemma4TextConfig

    config = Gemma4TextConfig(
        vocab_size=512, hidden_size=64, hidden_size_per_layer_input=8, intermediate_size=128, num_hidden_layers=6,
        layer_types=(["sliding_attention"] * 2 + ["full_attention"]) * 2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=512, num_kv_shared_layers=2,
        final_logit_softcapping=30.0, sliding_window=8, max_position_embeddings=1024)
    path = tmp_path_factory.mktemp("gemma4-head-512")
    torch.manual_seed(0)
    Gemma4ForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(TINY_LLAMA).save_pretrained(path)
    return path


def held_to(kernel: str | None):
    """Calls inside on `kernel` (None: the default, torch's CPU flash kernel here; "math": plain torch, the path a GPU
    takes where no kernel passed its probe)."""
    lse_attention.reset()
    cascade.CALLS.clear()
    return lse_attention.forced(kernel) if kernel else nullcontext()


def assert_ran_on(kernel: str | None) -> None:
    assert cascade.CALLS["cascade"] > 0 and cascade.CALLS["gathered"] == 0
    assert set(lse_attention.CALLS) == {kernel or "cpu_flash"} and not lse_attention.REJECTED, lse_attention.CALLS


@pytest.mark.parametrize("model", ["tiny-llama", "gemma4 head 512"])
def test_the_tree_matches_the_oracle_on_either_kernel(model, request):
    if model == "tiny-llama":  # GQA, full layers
        reference = request.getfixturevalue("llama")
    else:
        reference = ReferenceModel.load(ModelSpec(str(request.getfixturevalue("gemma_head_512")), dtype="float32",
                                                  device="cpu"))
    assert reference.use_cascade() is None and reference.cascade
    rows = agent_rows(reference.vocab_size, window=8)[:8]
    for kernel in (None, "math"):
        with held_to(kernel):
            results = chunk_logprobs(reference, rows, 24, 1.0, "on", ForwardStats(), max_cache_tokens=10**9)
        assert worst_error(reference.model, rows, results) <= 1e-4
        assert_ran_on(kernel)
        if model != "tiny-llama":
            assert cascade.CALLS["window"] > 0 and cascade.CALLS["shared"] > 0


# bf16 runs the spread of an fp64 model (tests/model/test_bf16.py): about 20 s for the four on one thread, several times
# that on a busy machine's two, so under make test-bf16 (.ci/run) rather than make test.
@pytest.mark.bf16
@pytest.mark.parametrize("kernel", [None, "math"])
@pytest.mark.parametrize("model", ["tiny-llama", "gemma4 head 512"])
def test_the_tree_in_bf16_is_within_bf16s_rounding_on_either_kernel(model, kernel, gemma_head_512):
    from tests.model.test_bf16 import bf16_errors

    path = TINY_LLAMA if model == "tiny-llama" else gemma_head_512
    with held_to(kernel):
        errors, tolerance, measured, _own_error, from_own = bf16_errors(path, ("on",))
    said = (f"bf16 worst |error| {errors['on']} against fp64, {from_own['on']} against the model's own bf16 forward; "
            f"tolerance 2 x {measured:.3g} + 1e-4 = {tolerance:.3g}")
    assert errors["on"] <= tolerance or from_own["on"] <= tolerance, said
    assert_ran_on(kernel)
