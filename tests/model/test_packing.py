"""Packed rows (klpipe/model/attention/packing.py): each row's segment attended alone, a sliding layer's window as a
window, held to a dense masked attention written here and to the naive oracle; and the pairs they execute (pairs.py)."""

import pytest
import torch

from klpipe.model import ModelSpec, ReferenceModel
from klpipe.model.attention import packing, pairs
from klpipe.precompute.logprobs import ForwardStats, chunk_logprobs
from tests.helpers import TINY_GEMMA, TINY_LLAMA, agent_rows, worst_error


def dense(query, key, value, window):
    """(1, H, L, d) attention of one row through a full (L, L) mask, keys repeated per query head: the naive way."""
    length, groups = query.shape[2], query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    q = torch.arange(length)[:, None]
    k = torch.arange(length)[None, :]
    allowed = (k <= q) & ((q - k < window) if window else True)
    scores = (query.double() @ key.double().transpose(-1, -2)) * query.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ value.double()).float()


@pytest.mark.parametrize("length, window", [(1, None), (37, None), (5, 8), (8, 8), (9, 8), (40, 8), (47, 16),
                                            (300, 64), (77, 33)])
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 8), (2, 1, 512)])
def test_a_segment_is_the_dense_masked_attention(length, window, heads, kv_heads, dim):
    generator = torch.Generator().manual_seed(length)
    query = torch.randn(1, heads, length, dim, generator=generator)
    key, value = (torch.randn(1, kv_heads, length, dim, generator=generator) for _ in range(2))
    got = packing.segment(query, key, value, None, window, heads != kv_heads)
    assert torch.allclose(got, dense(query, key, value, window), atol=1e-5)


def test_rows_packed_side_by_side_never_see_each_other():
    lengths = [5, 1, 23, 12]
    rows = packing.Rows(lengths)
    assert rows.starts == [0, 5, 6, 29] and rows.total == 41
    assert rows.position_ids().tolist() == [*range(5), 0, *range(23), *range(12)]
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, rows.total, 8, generator=generator)
    key, value = (torch.randn(1, 2, rows.total, 8, generator=generator) for _ in range(2))
    module = torch.nn.Module()
    out = packing.attend(module, query, key, value, rows, 0.0, None, {"sliding_window": 8})  # (1, N, H, d)
    for start, length in zip(rows.starts, lengths, strict=True):
        span = slice(start, start + length)
        expected = dense(query[:, :, span], key[:, :, span], value[:, :, span], 8).transpose(1, 2)
        assert torch.allclose(out[:, span], expected, atol=1e-5)


@pytest.mark.parametrize("window", [None, 8])
def test_a_padded_pass_attends_each_rows_real_slots_alone(window):
    """A tree pass without context (packing.Spans): pads on either side never read; and the last slot's query alone,
    as Gemma 4's KV-shared layers run under logits_to_keep=1."""
    spans = packing.Spans([0, 3, 7], [20, 17, 13])  # left layout, then right-aligned rows
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(3, 4, 20, 8, generator=generator)
    key, value = (torch.randn(3, 2, 20, 8, generator=generator) for _ in range(2))
    kwargs = {"sliding_window": window}
    out = packing.attend_spans(torch.nn.Module(), query, key, value, spans, 0.0, None, kwargs)  # (b, T, H, d)
    last = packing.attend_spans(torch.nn.Module(), query[:, :, -1:], key, value, spans, 0.0, None, kwargs)
    for row, (start, length) in enumerate(zip(spans.starts, spans.lengths, strict=True)):
        span = slice(start, start + length)
        expected = dense(query[row:row + 1, :, span], key[row:row + 1, :, span], value[row:row + 1, :, span],
                         window).transpose(1, 2)
        assert torch.allclose(out[row:row + 1, span], expected, atol=1e-5)
        assert not out[row, :start].any()  # a pad's output: zeros, never read
        assert torch.allclose(last[row:row + 1], expected[:, -1:], atol=1e-5)


@pytest.mark.parametrize("kwargs", [{"softcap": 30.0}, {"s_aux": torch.zeros(1)}, {"is_causal": False}])
def test_a_call_packed_rows_cannot_take_is_refused(kwargs):
    rows = packing.Rows([3, 4])
    q = torch.zeros(1, 2, 7, 4)
    with pytest.raises(packing.NotPacked):
        packing.attend(torch.nn.Module(), q, q, q, rows, 0.0, None, kwargs)


def naive_pairs(lengths, window):
    """Pairs a causal row needs within a window: each query's keys counted one by one."""
    return sum(min(q + 1, window or q + 1) for length in lengths for q in range(length))


@pytest.mark.parametrize("window", [None, 512, 128])
def test_packed_rows_execute_at_most_a_tenth_more_pairs_than_needed(window):
    """Rows of 1–8k tokens, as GRPO and agent rows are: the pairs the kernels execute, read from their own calls,
    against the pairs each query needs."""
    lengths = [1024, 1900, 2047, 4100, 8000]
    assert pairs.needed(lengths, window) == naive_pairs(lengths, window)
    rows = packing.Rows(lengths)

    class Attention(torch.nn.Module):  # what PairCount knows an attention module by
        def __init__(self):
            super().__init__()
            self.layer_idx, self.q_proj, self.sliding_window = 0, torch.nn.Identity(), window
            self.config = type("Config", (), {"num_attention_heads": 4})()

        def forward(self, query, key):
            return packing.attend(self, query, key, key, rows, 0.0, None, {"sliding_window": window})

    query = torch.zeros(1, 4, rows.total, 4)
    key = torch.zeros(1, 2, rows.total, 4)
    module = Attention()
    with pairs.PairCount(module) as count:
        module(query, key)
    kind = "sliding" if window else "full"
    assert set(count.executed) == {kind} and count.window[kind] == window
    ratio = count.executed[kind] / naive_pairs(lengths, window)
    if window is None:
        assert ratio == 1.0  # the causal triangle, row by row
    else:
        assert 1.0 < ratio <= 1 + (window // packing.BLOCKS_PER_WINDOW) / window <= 1.1


@pytest.fixture(scope="module", params=["llama", "gemma4"])
def reference(request):
    path = {"llama": TINY_LLAMA, "gemma4": TINY_GEMMA}[request.param]
    return ReferenceModel.load(ModelSpec(str(path), dtype="float32", device="cpu"))


def test_rows_run_whole_go_packed_and_match_the_oracle(reference):
    assert reference.packed and reference.padded_why is None
    rows = agent_rows(reference.vocab_size)
    stats = ForwardStats()
    with pairs.PairCount(reference.model) as count:
        results = chunk_logprobs(reference, rows, 256, 1.0, "off", stats)
    assert worst_error(reference.model, rows, results) <= 1e-4
    assert stats.padded_tokens == stats.fed_tokens > 0  # no pad fed
    lengths = [len(p) + len(r) - 1 for p, r in rows if len(r)]  # what each row feeds: its last token is a target
    for kind, modules in count.layers.items():
        needed = pairs.needed(lengths, count.window[kind]) * len(modules)
        assert needed <= count.executed[kind] <= 1.1 * needed, kind
    assert count.executed["other"] == 0


def test_the_trees_passes_without_context_attend_each_row_alone_and_match_the_oracle(reference):
    rows = agent_rows(reference.vocab_size, seed=3)
    packing.CALLS.clear()
    results = chunk_logprobs(reference, rows, 64, 1.0, "on", ForwardStats(), max_cache_tokens=10**9)
    assert worst_error(reference.model, rows, results) <= 1e-4
    assert packing.CALLS["spans"] > 0 and reference.packed


def test_packed_rows_that_disagree_with_the_oracle_keep_rows_padded(monkeypatch):
    right = packing.segment
    monkeypatch.setattr(packing, "segment", lambda q, k, v, scaling, window, gqa: right(q, k, v, 0.5, window, gqa))
    reference = ReferenceModel.load(ModelSpec(str(TINY_LLAMA), dtype="float32", device="cpu"))
    assert not reference.packed and reference.padded_why.startswith("packed rows disagree with its own forward")
    assert reference.model.config._attn_implementation == "sdpa"
    rows = agent_rows(reference.vocab_size)[:6]
    assert worst_error(reference.model, rows, reference.score_batch(rows)) <= 1e-4


def test_a_call_refused_mid_run_runs_the_batch_padded_with_a_note(monkeypatch):
    reference = ReferenceModel.load(ModelSpec(str(TINY_LLAMA), dtype="float32", device="cpu"))
    assert reference.packed

    def refuse(*args, **kwargs):
        raise packing.NotPacked("LlamaAttention passes softcap to its attention")

    monkeypatch.setattr(packing, "attend", refuse)
    rows = agent_rows(reference.vocab_size)[:6]
    assert worst_error(reference.model, rows, reference.score_batch(rows)) <= 1e-4
    assert not reference.packed and reference.model.config._attn_implementation == "sdpa"
    assert reference.notes == [("LlamaForCausalLM: rows run whole go padded (LlamaAttention passes softcap to its "
                                "attention)")]


def test_a_stateful_model_keeps_its_rows_padded():
    class Stateful:
        own_forward, rows_alone, rope_length_limit, keeps_state = None, False, None, True
        model = torch.nn.Linear(1, 1)
        model.config = type("Config", (), {"_attn_implementation": "sdpa"})()

    assert packing.refusal(Stateful()) == packing.STATEFUL
    Stateful.keeps_state, Stateful.rope_length_limit = False, 4096
    assert packing.refusal(Stateful()) == packing.LONG_ROPE
    Stateful.rope_length_limit = None
    Stateful.model.config._attn_implementation = "eager"
    assert packing.refusal(Stateful()) == packing.NOT_SDPA
