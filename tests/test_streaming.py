"""Weights streamed layer by layer (klpipe/model/streaming.py, weight_store.py): the same numbers as the model in
memory, each layer read once per group of passes, every pass through a layer before any goes through the next.

The streamed model is held to the in-memory model of the same dtype on the same plan (within 1e-5) and to the
oracle (an fp64 forward, allowing the fp32 oracle's own error + 1e-4), on the committed tiny Gemma 4 (its
KV-shared layers and per-layer embeddings; the hub's multimodal layout too), tiny Llama, and, from
tests/architectures.py, a MoE (experts stored one by one, fused at load), Qwen3-Next (Gated DeltaNet layers with
MoE) and Llama 4 (chunked attention, NoPE layers, MoE every other layer).
"""

import threading

import numpy as np
import pytest

from klpipe.model import ModelSpec, ReferenceModel
from klpipe.precompute.logprobs import plan_chunk, run_plan
from tests import helpers
from tests.architectures import save_tiny
from tests.helpers import TINY_GEMMA, TINY_GEMMA_MM, TINY_LLAMA, Fp64Oracle

SAME = 1e-5  # streamed against in memory, same dtype and plan
TOLERANCE = 1e-4  # against fp64, beyond the fp32 oracle's own error

MODELS = ["tiny-llama", "tiny-gemma4", "tiny-gemma4-mm", "qwen3_moe", "qwen3_next", "llama4"]
SAMPLES = {"tiny-llama": TINY_LLAMA, "tiny-gemma4": TINY_GEMMA, "tiny-gemma4-mm": TINY_GEMMA_MM}


@pytest.fixture(scope="module", params=MODELS)
def pair(request, tmp_path_factory):
    """(name, the model in memory, the same model streamed, the fp64 oracle)."""
    name = request.param
    directory = SAMPLES.get(name) or save_tiny(name, tmp_path_factory.mktemp(name))
    spec = ModelSpec(str(directory), dtype="float32", device="cpu")
    in_memory = ReferenceModel.load(spec)
    return name, in_memory, ReferenceModel.load(spec, streamed=True), Fp64Oracle(in_memory.model)


def chunk(vocab: int, seed: int = 0):
    """An agent's chunk (a system prompt, GRPO groups, turns), lengths 3 to ~130 tokens."""
    return helpers.agent_rows(vocab, seed, window=16, system=37, low=3, three_token_row=True)


def layer_count(model) -> int:
    return len(model.streamer.store.layers)


def test_the_decoder_layers_stay_in_their_files(pair):
    name, in_memory, streamed, _ = pair
    store = streamed.streamer.store
    # Every decoder layer's weights on the meta device between forwards; the rest loaded, and nothing else.
    assert all(p.is_meta for p in store.layers.parameters())
    assert not any(p.is_meta for n, p in streamed.model.named_parameters() if not n.startswith(store.layers_path))
    tensors = {id(t): t for t in [*in_memory.model.parameters(), *in_memory.model.buffers()]}.values()
    own = sum(t.numel() * t.element_size() for t in tensors)
    assert store.sizes.weights == own  # the store's sizes are the model's in memory, tensor for tensor
    assert store.sizes.resident + sum(store.sizes.layers) == own and len(store.sizes.layers) >= 2


def test_streamed_rows_match_the_model_in_memory_and_the_oracle(pair):
    name, in_memory, streamed, oracle = pair
    rows = chunk(in_memory.vocab_size)
    plan = plan_chunk(in_memory, rows, 96, "off")
    assert len(plan.batches) > 2  # several passes share each layer's read
    assert plan_chunk(streamed, rows, 96, "off").batches[0].tolist() == plan.batches[0].tolist()
    expected = run_plan(in_memory, plan, rows, 1.0)
    reads = streamed.streamer.layer_reads
    got = run_plan(streamed, plan, rows, 1.0)
    # Layer-major: each layer read once for the whole chunk, however many passes, and freed after.
    assert streamed.streamer.layer_reads - reads == layer_count(streamed)
    assert not any(streamed.streamer.store.loaded(k) for k in range(layer_count(streamed)))
    gap = max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected) if len(a))
    assert gap <= SAME, f"{name}: streamed differs from in memory by {gap:.3g}"
    ours, own = oracle.errors(rows, got)
    assert ours <= own + TOLERANCE, f"{name}: {ours:.3g} from fp64 (the fp32 oracle's own error {own:.3g})"


def test_a_group_limit_cuts_the_chunk_into_groups_that_each_read_the_weights_once(pair):
    name, in_memory, streamed, _ = pair
    rows = chunk(in_memory.vocab_size, seed=1)
    plan = plan_chunk(in_memory, rows, 96, "off")
    expected = run_plan(in_memory, plan, rows, 1.0)
    streamed.stream_tokens = 200  # a few batches a group
    try:
        reads = streamed.streamer.layer_reads
        got = run_plan(streamed, plan, rows, 1.0)
    finally:
        streamed.stream_tokens = None
    fed = [sum(len(plan.fed[i]) for i in batch.tolist()) for batch in plan.batches]
    groups, tokens = 1, 0
    for n in fed:  # the cut by hand: a batch that would pass 200 fed tokens opens a group
        if tokens and tokens + n > 200:
            groups, tokens = groups + 1, 0
        tokens += n
    assert 1 < groups < len(fed)
    assert streamed.streamer.layer_reads - reads == groups * layer_count(streamed)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected) if len(a)) <= SAME


@pytest.fixture(scope="module")
def llama():
    return ReferenceModel.load(ModelSpec(str(TINY_LLAMA), dtype="float32", device="cpu"), streamed=True)


def test_every_pass_goes_through_a_layer_before_any_goes_through_the_next(llama):
    seen = []
    hooks = [layer.register_forward_pre_hook(lambda module, args, k=k: seen.append(
        (k, threading.current_thread().name))) for k, layer in enumerate(llama.streamer.store.layers)]
    rng = np.random.default_rng(0)
    rows = [(rng.integers(0, 512, n), rng.integers(0, 512, 4)) for n in (5, 9, 14)]
    try:
        llama.streamer.run([lambda row=row: llama.score_batch([row]) for row in rows])
    finally:
        for hook in hooks:
            hook.remove()
    layers = [k for k, _ in seen]
    assert layers == sorted(layers) and len(seen) == 3 * len(llama.streamer.store.layers)
    assert [name for k, name in seen if k == 0] == ["klpipe-pass-0", "klpipe-pass-1", "klpipe-pass-2"]


def test_a_failing_pass_stops_its_group_and_its_error_is_raised(llama):
    rng = np.random.default_rng(0)
    row = (rng.integers(0, 512, 6), rng.integers(0, 512, 3))

    def fails():
        llama.score_batch([(row[0], np.array([10_000]))])  # a token past the vocabulary: the head refuses it
    calls = [lambda: llama.score_batch([row]), fails, lambda: llama.score_batch([row])]
    with pytest.raises(Exception) as caught:
        llama.streamer.run(calls)
    assert not isinstance(caught.value, SystemExit)
    assert not any(t.name.startswith("klpipe-pass-") for t in threading.enumerate())  # every pass ended
    assert not any(llama.streamer.store.loaded(k) for k in range(len(llama.streamer.store.layers)))
    # The model still runs afterwards.
    assert llama.streamer.run([lambda: llama.score_batch([row])])[0][0].shape == (3,)


def test_a_stop_between_layers_abandons_the_group(llama):
    rng = np.random.default_rng(0)
    row = (rng.integers(0, 512, 6), rng.integers(0, 512, 3))

    class Stop(Exception):
        pass

    def stop():
        raise Stop()
    with pytest.raises(Stop):
        llama.streamer.run([lambda: llama.score_batch([row])] * 2, between=stop)
    assert not any(t.name.startswith("klpipe-pass-") for t in threading.enumerate())
