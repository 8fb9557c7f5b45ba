"""Weights streamed layer by layer (klpipe/model/layer_major.py, weight_store.py): the same numbers as the model in
memory, each layer read once per group of passes, every pass through a layer before any goes through the next.

The streamed model is held to the in-memory model of the same dtype on the same plan (within 1e-5) and to the
oracle (an fp64 forward, allowing the fp32 oracle's own error + 1e-4), on the committed tiny Gemma 4 (its
KV-shared layers and per-layer embeddings; the hub's multimodal layout too), tiny Llama, and, from
tests/architectures.py, a MoE (experts stored one by one, fused at load), Qwen3-Next (Gated DeltaNet layers with
MoE) and Llama 4 (chunked attention, NoPE layers, MoE every other layer).
"""


from pathlib import Path

import numpy as np
import pytest
import torch

from klpipe.errors import ModelError
from klpipe.model import ModelSpec, ReferenceModel
from klpipe.model.table_rows import Resting
from klpipe.precompute.logprobs import plan_chunk, run_plan
from tests import helpers
from tests.architectures import ARCHITECTURES, save_tiny
from tests.helpers import TINY_GEMMA, TINY_GEMMA_MM, TINY_LLAMA, Fp64Oracle

SAME = 1e-5  # streamed against in memory, same dtype and plan
TOLERANCE = 1e-4  # against fp64, beyond the fp32 oracle's own error

MODELS = ["tiny-llama", "tiny-gemma4", "tiny-gemma4-mm", "qwen3_moe", "qwen3_next", "llama4"]
SAMPLES = {"tiny-llama": TINY_LLAMA, "tiny-gemma4": TINY_GEMMA, "tiny-gemma4-mm": TINY_GEMMA_MM}


# The rest of the architecture matrix, in make test-arch.
REST = [pytest.param(name, marks=pytest.mark.arch) for name in sorted(ARCHITECTURES) if name not in MODELS]


@pytest.fixture(scope="module", params=MODELS + REST)
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
    # Every decoder layer's weights on the meta device between forwards, Gemma's per-layer embeddings (read row by
    # row) too, and, where the head does not share the input embeddings, both (the head read a block at a time);
    # the rest loaded, and nothing else.
    tables = {n for n, _ in streamed.model.named_modules() if n.endswith("embed_tokens_per_layer")}
    model = in_memory.model
    inputs = next(n for n, m in model.named_modules() if m is model.get_input_embeddings())
    untied = model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    assert {t.path for t in store.tables} == tables | ({inputs} if untied else set())
    assert all(p.is_meta for p in store.layers.parameters())
    assert all(streamed.model.get_submodule(n).weight.is_meta for n in tables)
    resting = streamed.model.get_input_embeddings().weight
    # Untied input embeddings rest as a stand-in that says its device and dtype, and refuses to be read.
    assert isinstance(resting, Resting) == untied
    if untied:
        assert (resting.device, resting.dtype, resting.shape) == (torch.device("cpu"), torch.float32,
                                                                   model.get_input_embeddings().weight.shape)
        with pytest.raises(ModelError, match=f"^{inputs}'s weight, left in its file, was read outside its forward"):
            resting.sum()
        tables.add(inputs)
    head = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
    assert (store.head is not None and store.head.path) == (untied and head)
    assert isinstance(streamed.model.get_output_embeddings().weight, Resting) == untied
    if untied:
        tables.add(head)
    assert not any(p.is_meta for n, p in streamed.model.named_parameters()
                   if not n.startswith(store.layers_path) and n.removesuffix(".weight") not in tables)
    tensors = {id(t): t for t in [*in_memory.model.parameters(), *in_memory.model.buffers()]}.values()
    own = sum(t.numel() * t.element_size() for t in tensors)
    assert store.sizes.weights == own  # the store's sizes are the model's in memory, tensor for tensor
    table = sum(in_memory.model.get_submodule(n).weight.nbytes for n in tables)
    assert store.sizes.tables == table and (table > 0) == (name.startswith("tiny-gemma4") or untied)
    assert store.sizes.resident + sum(store.sizes.layers) + table == own and len(store.sizes.layers) >= 2


def test_the_causality_probe_reads_each_layer_once_for_all_its_rows(pair):
    # Its rows (the probe and three cuts of it) are passes of one layer-major group: the model's own forward of each,
    # as in memory, the weights read once rather than once a row.
    from klpipe.model import probes

    _name, in_memory, streamed, _ = pair
    rows = [(np.array([3]), np.arange(5, 5 + n) % in_memory.vocab_size) for n in (40, 31, 20)]
    reads = streamed.streamer.layer_reads
    got = probes.own_rows(streamed, rows)
    assert streamed.streamer.layer_reads - reads == layer_count(streamed)
    for a, b in zip(got, probes.own_logprobs(in_memory.model, rows), strict=True):
        assert a.shape == b.shape and float(np.max(np.abs(a - b))) <= SAME


def test_the_load_time_probes_by_the_models_own_forward_read_each_layer_once(pair):
    # The oracle's row, the causality probe's and packing's run ahead as one group (probes.prefetch); each probe then
    # takes its own from the memo, once, and reads nothing.
    from klpipe.model import probes
    from klpipe.model.attention import packing

    _name, in_memory, streamed, _ = pair
    block = streamed.head.rows
    wanted = [(probes.oracle_row(streamed), None)] + [(row, block) for row in probes.causal_rows(streamed)]
    if packing.refusal(streamed) is None:
        wanted.append((packing.probe_row(streamed), block))
    reads = streamed.streamer.layer_reads
    try:
        probes.prefetch(streamed, wanted[len(probes.causal_rows(streamed)) + 1:])
        assert streamed.streamer.layer_reads - reads == layer_count(streamed)
        assert len(streamed.own_memo) == len(wanted)
        reads = streamed.streamer.layer_reads
        for row, row_block in wanted:
            (got,) = probes.own_rows(streamed, [row], block=row_block)
            (expected,) = probes.own_logprobs(in_memory.model, [row], block=row_block)
            assert got.shape == expected.shape and float(np.max(np.abs(got - expected))) <= SAME
        assert streamed.streamer.layer_reads == reads and streamed.own_memo == {}
    finally:
        streamed.own_memo = {}


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
    gap = max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected, strict=True) if len(a))
    assert gap <= SAME, f"{name}: streamed differs from in memory by {gap:.3g}"
    ours, own = oracle.errors(rows, got)
    assert ours <= own + TOLERANCE, f"{name}: {ours:.3g} from fp64 (the fp32 oracle's own error {own:.3g})"


def test_a_temperature_and_a_tool_mask_stream_as_in_memory(pair):
    _name, in_memory, streamed, oracle = pair
    rows = chunk(in_memory.vocab_size, seed=4)
    rng = np.random.default_rng(4)
    needed = [rng.random(len(response)) < 0.6 for _, response in rows]  # a tool's tokens: context, never scored
    # Each response ends with a token of the policy's own: a masked tail makes klpipe feed a row shorter than its
    # own forward sees, which moves a LongRoPE model (Phi-3) across its limit in memory and streamed alike.
    for need in needed:
        need[-1:] = True
    plan = plan_chunk(in_memory, rows, 96, "off", needed=needed)
    expected, got = run_plan(in_memory, plan, rows, 0.7), run_plan(streamed, plan, rows, 0.7)
    for values, need in zip(got, needed, strict=True):
        assert np.isnan(values[~need]).all() and not np.isnan(values[need]).any()
    assert max(float(np.nanmax(np.abs(a - b)))
               for a, b in zip(got, expected, strict=True) if (~np.isnan(a)).any()) <= SAME
    ours, own = oracle.errors(rows, [np.where(np.isnan(v), e, v).astype(np.float32)
                                     for v, e in zip(got, oracle.expected(rows, 0.7)[0], strict=True)], 0.7)
    assert ours <= own + TOLERANCE


def test_a_group_limit_cuts_the_chunk_into_groups_that_each_read_the_weights_once(pair):
    _name, in_memory, streamed, _ = pair
    rows = chunk(in_memory.vocab_size, seed=1)
    plan = plan_chunk(in_memory, rows, 96, "off")
    expected = run_plan(in_memory, plan, rows, 1.0)
    streamed.stream_tokens = 200  # a few batches a group
    try:
        reads = streamed.streamer.layer_reads
        got = run_plan(streamed, plan, rows, 1.0)
    finally:
        streamed.stream_tokens = None
    # What each batch holds: its rows end to end where they run packed, else each padded to the batch's longest.
    fed = [sum(len(plan.fed[i]) for i in batch.tolist()) if streamed.packed
           else len(batch) * max(len(plan.fed[i]) for i in batch.tolist()) for batch in plan.batches]
    groups, tokens = 1, 0
    for n in fed:  # the cut by hand: a batch that would pass 200 tokens' worth opens a group
        if tokens and tokens + n > 200:
            groups, tokens = groups + 1, 0
        tokens += n
    assert 1 < groups < len(fed)
    assert streamed.streamer.layer_reads - reads == groups * layer_count(streamed)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected, strict=True) if len(a)) <= SAME


# make test: a plain Llama and Gemma 4 (KV-shared layers, the right layout); the rest in make test-arch.
TREE_QUICK = ["tiny-llama", "tiny-gemma4"]


@pytest.mark.parametrize("pair", TREE_QUICK + [pytest.param(name, marks=pytest.mark.arch)
                                               for name in MODELS if name not in TREE_QUICK] + REST, indirect=True)
def test_the_prefix_tree_streams_to_the_tree_in_memory(pair):
    """The tree's passes layer-major across its levels (model/attention/layered.py), Qwen3-Next's recurrent states
    too: the weights read once for the tree, not once per level or per pass; the numbers the tree's in memory."""
    from klpipe.precompute.sharing import Sharing

    name, in_memory, streamed, oracle = pair
    rows = chunk(in_memory.vocab_size, seed=2)
    sharing = {model: Sharing(model, "auto", 1 << 10, lambda line: None) for model in (in_memory, streamed)}
    plan = sharing[in_memory].plan(rows, 96, None)
    if plan.tree is None:
        pytest.skip(f"{name} runs rows whole under auto: no tree to stream")
    streamed_plan = sharing[streamed].plan(rows, 96, None)
    assert sharing[streamed].mode == sharing[in_memory].mode and streamed_plan.tree is not None
    expected = run_plan(in_memory, plan, rows, 1.0)
    reads, groups = streamed.streamer.layer_reads, streamed.streamer.groups
    got = run_plan(streamed, streamed_plan, rows, 1.0)
    ran = streamed.streamer.groups - groups
    depth = max(len(streamed_plan.tree.path(int(n))) for n in streamed_plan.tree.end_node if n >= 0)
    # Each group read each layer once at most (a pass that keeps only its last position may skip Gemma 4's last
    # layers); a wave per level of the tree at most, and one group of rows run whole.
    assert 0 < streamed.streamer.layer_reads - reads <= ran * layer_count(streamed)
    assert ran <= depth + 1 < len(streamed_plan.passes) + 1
    assert streamed.tree_layered and ran == 1 + bool(streamed_plan.batches)  # the tree in one group, rows in another
    gap = max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected, strict=True) if len(a))
    assert gap <= SAME, f"{name}: the streamed tree differs from the tree in memory by {gap:.3g}"
    ours, own = oracle.errors(rows, got)
    assert ours <= own + TOLERANCE, f"{name}: {ours:.3g} from fp64 (the fp32 oracle's own error {own:.3g})"


def test_a_call_packed_rows_cannot_take_mid_group_reruns_the_whole_group_padded(monkeypatch):
    from klpipe.model.attention import packing

    spec = ModelSpec(str(TINY_LLAMA), dtype="float32", device="cpu")
    in_memory, streamed = ReferenceModel.load(spec), ReferenceModel.load(spec, streamed=True)
    rows = chunk(in_memory.vocab_size, seed=3)
    plan = plan_chunk(streamed, rows, 96, "off")
    assert streamed.packed and len(plan.batches) > 2
    calls = []

    def refuse_the_third(*args, **kwargs):  # the first two passes packed through layer 0, then a call is refused
        calls.append(1)
        if len(calls) == 3:
            raise packing.NotPacked("LlamaAttention passes softcap to its attention")
        return attend(*args, **kwargs)
    attend = packing.attend
    monkeypatch.setattr(packing, "attend", refuse_the_third)
    got = run_plan(streamed, plan, rows, 1.0)
    assert not streamed.packed and len(calls) == 3  # padded from then on: no packed call after the refusal
    in_memory.drop_packing("the same batches, padded")
    expected = [None] * len(rows)
    for batch in plan.batches:
        for i, values in zip(batch.tolist(), in_memory.score_batch([rows[i] for i in batch]), strict=True):
            expected[i] = values
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected, strict=True) if len(a)) <= SAME


def test_a_repositorys_other_copy_of_the_weights_is_never_read(tmp_path):
    # Mistral's repositories ship consolidated.safetensors beside the shards, the same weights under other names:
    # from_pretrained reads the shards alone, and so must the store (it refused the other names as unexpected).
    import shutil

    import torch
    from safetensors.torch import save_file

    directory = tmp_path / "llama"
    shutil.copytree(TINY_LLAMA, directory)
    save_file({"tok_embeddings.weight": torch.ones(4, 4)}, str(directory / "consolidated.safetensors"))
    spec = ModelSpec(str(directory), dtype="float32", device="cpu")
    streamed, in_memory = ReferenceModel.load(spec, streamed=True), ReferenceModel.load(spec)
    rows = chunk(in_memory.vocab_size)[:8]
    got, expected = streamed.streamer.run([lambda: streamed.score_batch(rows)])[0], in_memory.score_batch(rows)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected, strict=True) if len(a)) <= SAME


def test_a_legacy_key_from_pretrained_leaves_is_left_streamed_too(tmp_path):
    # Older checkpoints kept RoPE's inv_freq in every layer; from_pretrained leaves those keys unread, by its rules.
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    directory = tmp_path / "llama"
    shutil.copytree(TINY_LLAMA, directory)
    weights = load_file(str(directory / "model.safetensors"))
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    spec = ModelSpec(str(directory), dtype="float32", device="cpu")
    streamed, in_memory = ReferenceModel.load(spec, streamed=True), ReferenceModel.load(spec)
    rows = chunk(in_memory.vocab_size)[:8]
    got, expected = streamed.streamer.run([lambda: streamed.score_batch(rows)])[0], in_memory.score_batch(rows)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected, strict=True) if len(a)) <= SAME


@pytest.mark.parametrize("change, words", [("drop", "1 missing keys loading it streamed (model.layers.1.mlp.up_proj"),
                                           ("add", "1 unexpected keys loading it streamed (model.layers.1.mlp.extra")])
def test_a_checkpoint_that_does_not_fit_its_class_is_refused_before_any_forward(tmp_path, change, words):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from klpipe.errors import ModelError

    directory = tmp_path / "llama"
    shutil.copytree(TINY_LLAMA, directory)
    weights = load_file(str(directory / "model.safetensors"))
    if change == "drop":
        del weights["model.layers.1.mlp.up_proj.weight"]
    else:
        weights["model.layers.1.mlp.extra.weight"] = torch.ones(4)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelError) as caught:
        ReferenceModel.load(ModelSpec(str(directory), dtype="float32", device="cpu"), streamed=True)
    assert f"LlamaForCausalLM: {words}" in str(caught.value) and "probe" not in str(caught.value)


def test_a_quantized_checkpoint_is_refused_streamed(tmp_path):
    # Its tensors mean something only through a quantizer (fp8 with block scales here): read as plain numbers they
    # would be wrong numbers.
    import json
    import shutil

    from klpipe.errors import ModelError

    directory = tmp_path / "llama"
    shutil.copytree(TINY_LLAMA, directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError) as caught:
        ReferenceModel.load(ModelSpec(str(directory), dtype="float32", device="cpu"), streamed=True)
    assert str(caught.value).endswith("streaming them does not run with a quantized checkpoint yet")


@pytest.mark.bf16
@pytest.mark.parametrize("path", [TINY_LLAMA, TINY_GEMMA], ids=["tiny-llama", "tiny-gemma4"])
def test_bfloat16_streams_to_the_bfloat16_run_in_memory(path):
    spec = ModelSpec(str(path), dtype="bfloat16", device="cpu")
    in_memory, streamed = ReferenceModel.load(spec), ReferenceModel.load(spec, streamed=True)
    assert {p.dtype for p in streamed.model.parameters() if not p.is_meta} == {p.dtype for p in
                                                                             in_memory.model.parameters()}
    rows = chunk(in_memory.vocab_size, seed=2)
    plan = plan_chunk(in_memory, rows, 96, "off")
    expected, got = run_plan(in_memory, plan, rows, 1.0), run_plan(streamed, plan, rows, 1.0)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected, strict=True) if len(a)) <= SAME


@pytest.fixture(scope="module")
def llama():
    return ReferenceModel.load(ModelSpec(str(TINY_LLAMA), dtype="float32", device="cpu"), streamed=True)


def test_every_pass_goes_through_a_layer_before_any_goes_through_the_next(llama):
    import greenlet

    seen = []  # (layer, the pass's greenlet): every pass runs on this thread, in a greenlet of its own
    hooks = [layer.register_forward_pre_hook(lambda module, args, k=k: seen.append(
        (k, greenlet.getcurrent()))) for k, layer in enumerate(llama.streamer.store.layers)]
    rng = np.random.default_rng(0)
    rows = [(rng.integers(0, 512, n), rng.integers(0, 512, 4)) for n in (5, 9, 14)]
    try:
        llama.streamer.run([lambda row=row: llama.score_batch([row]) for row in rows])
    finally:
        for hook in hooks:
            hook.remove()
    layers = [k for k, _ in seen]
    assert layers == sorted(layers) and len(seen) == 3 * len(llama.streamer.store.layers)
    first = [g for k, g in seen if k == 0]  # the passes in their order, the same through every layer
    assert len(set(first)) == 3 and greenlet.getcurrent() not in first
    assert all([g for k, g in seen if k == layer] == first for layer in set(layers))


def recorded(calls: list) -> tuple[list, list]:
    """(`calls`, each noting the greenlet it runs in first; the greenlets noted)."""
    import greenlet

    passes = []

    def noted(call):
        passes.append(greenlet.getcurrent())
        return call()
    return [lambda call=call: noted(call) for call in calls], passes


def test_a_failing_pass_stops_its_group_and_its_error_is_raised(llama):
    rng = np.random.default_rng(0)
    row = (rng.integers(0, 512, 6), rng.integers(0, 512, 3))

    def fails():
        llama.score_batch([(row[0], np.array([10_000]))])  # a token past the vocabulary: the head refuses it
    calls, passes = recorded([lambda: llama.score_batch([row]), fails, lambda: llama.score_batch([row])])
    with pytest.raises(Exception) as caught:
        llama.streamer.run(calls)
    assert not isinstance(caught.value, SystemExit)
    assert len(passes) == 3 and all(g.dead for g in passes)  # every pass ended
    assert not torch.is_inference_mode_enabled()  # the caller's torch state as it was
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
    calls, passes = recorded([lambda: llama.score_batch([row])] * 2)
    with pytest.raises(Stop):
        llama.streamer.run(calls, between=stop)
    assert len(passes) == 2 and all(g.dead for g in passes) and not torch.is_inference_mode_enabled()


def test_what_a_group_leaves_of_the_budget_keeps_the_first_layers_loaded_from_group_to_group():
    # The budget's room for a group's fed tokens (spare, at per_token bytes each), less what a group holds, keeps
    # layers loaded from one group to the next, the first first: each is read once, not once a group. A group that
    # holds more frees the last kept; the numbers are the same, bit for bit, whatever is kept.
    model = ReferenceModel.load(ModelSpec(str(TINY_GEMMA), dtype="float32", device="cpu"), streamed=True)
    streamer, store = model.streamer, model.streamer.store
    layers, sizes = len(store.layers), store.sizes.layers
    assert layers == 6
    rng = np.random.default_rng(0)
    rows = [(rng.integers(0, 512, n), rng.integers(0, 512, 4)) for n in (5, 9, 14)]
    calls = [lambda row=row: model.score_batch([row])[0] for row in rows]

    def group(tokens: int) -> tuple[list, int]:
        """The rows' logprobs, run as one group said to hold `tokens` fed tokens, and the layers it read."""
        before = streamer.layer_reads
        got = streamer.run(calls, tokens=tokens)
        return got, streamer.layer_reads - before

    expected, read = group(40)  # nothing kept: every layer read
    assert read == layers and streamer.kept == {}
    streamer.spare, streamer.per_token = 1000 * 40 + sizes[0] + sizes[1] + sizes[2] // 2, 1000
    for reads in (layers, layers - 2, layers - 2):  # the first group reads all and keeps 0 and 1; the next, the rest
        got, read = group(40)
        assert read == reads and sorted(streamer.kept) == [0, 1]
        assert [store.loaded(k) for k in range(layers)] == [True, True] + [False] * (layers - 2)
        assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))
        assert streamer.statistics()["kept"] == 2
    before = streamer.layer_reads
    alone = model.score_batch([rows[0]])[0]  # a forward on its own keeps them and keeps no more
    assert streamer.layer_reads - before == layers - 2 and sorted(streamer.kept) == [0, 1]
    assert np.array_equal(alone, expected[0])
    got, read = group(40 + sizes[1] // 1000)  # a group holding more leaves room for layer 0 alone
    assert read == layers - 1 and sorted(streamer.kept) == [0] and not store.loaded(1)
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))
    got, read = group(10 ** 9)  # and one holding the whole room, none
    assert read == layers and streamer.kept == {} and not any(store.loaded(k) for k in range(layers))
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))


def test_a_layer_read_that_fails_in_the_background_is_raised_and_leaves_nothing_half_loaded(monkeypatch):
    # A read ahead that fails (a disk error, a file cut short) raises its error in the group; its layer, which was to
    # be kept, is neither kept nor half loaded, nothing stays read ahead, and the next group runs as before.
    model = ReferenceModel.load(ModelSpec(str(TINY_GEMMA), dtype="float32", device="cpu"), streamed=True)
    streamer, store = model.streamer, model.streamer.store
    rng = np.random.default_rng(0)
    rows = [(rng.integers(0, 512, n), rng.integers(0, 512, 4)) for n in (5, 9)]
    calls = [lambda row=row: model.score_batch([row])[0] for row in rows]
    expected = streamer.run(calls)
    streamer.spare, streamer.per_token = sum(store.sizes.layers), 0  # every layer kept
    load, failed = store.load, []

    def fails_once(k, own=False):
        if k == 3 and not failed:
            failed.append(own)
            load(k, own)  # its tensors in, then the error: a layer half read would look loaded
            raise OSError("the disk said no")
        load(k, own)
    monkeypatch.setattr(store, "load", fails_once)
    with pytest.raises(OSError, match="the disk said no"):
        streamer.run(calls)
    assert failed == [True]  # it was read to be kept
    assert streamer._ahead is None and 3 not in streamer.kept and not store.loaded(3)
    assert all(store.loaded(k) for k in streamer.kept) and sorted(streamer.kept) == [0, 1, 2]
    got = streamer.run(calls)
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))
    assert sorted(streamer.kept) == list(range(6)) and all(store.loaded(k) for k in range(6))


@pytest.mark.slow
@pytest.mark.parametrize("trimmed", ["always", "over the budget"])
def test_a_groups_memory_stays_inside_what_the_budget_allows_for_it(tmp_path, trimmed):
    """What the process holds between layers, measured by the kernel (RssAnon), within what budget.py counts for a
    group: two layers, one pass's activations, and what each waiting pass keeps (per token, and its thread's own).
    glibc's malloc, left to itself, kept every pass's freed activations in the pass thread's arena (+440 to +680 MiB
    here, against about 320 allowed). Trimmed after every turn, or, as a run trims, only once the process holds more
    than the budget less one pass's activations (budget.decide's trim_above)."""
    from klpipe.model import streamed_load

    directory = big_llama(tmp_path / "wide", layers=4, hidden=256, intermediate=8192)  # a pass's MLP: 48 MiB
    spec = ModelSpec(str(directory), dtype="float32", device="cpu")
    model = ReferenceModel.load(spec, streamed=True)
    rng = np.random.default_rng(0)
    rows = [(rng.integers(0, 512, 400), rng.integers(0, 512, 112)) for _ in range(8)]  # 8 passes of 512 tokens
    calls = [lambda row=row: model.score_batch([row]) for row in rows]
    model.streamer.run(calls)  # torch's first kernels and the allocator's first blocks, outside the figure

    def anonymous() -> int:
        status = Path("/proc/self/status").read_text()
        return int(status.split("RssAnon:")[1].split()[0]) << 10
    before, seen = anonymous(), []
    sizes = streamed_load.measure(spec, 512)
    allowed = (2 * sizes.largest_layer + sizes.activations
               + 8 * (sizes.kept_per_token * 512 + streamed_load.PASS_OVERHEAD))
    model.streamer.trim_above = None if trimmed == "always" else before + allowed - sizes.activations
    model.streamer.run(calls, between=lambda: seen.append(anonymous()))
    assert len(seen) == 4 and max(seen) - before <= allowed, (
        f"held {(max(seen) - before) >> 20} MiB between layers, the budget allows {allowed >> 20} MiB")


def test_a_group_too_small_to_hide_its_read_says_how_many_tokens_would(llama):
    """The hint's arithmetic on the streamer's own clock, set by hand (timings themselves are the benchmark's)."""
    from klpipe.cli.precompute import _streamed

    streamer = llama.streamer
    streamer.reset_statistics()
    try:
        streamer.groups, streamer.tokens = 2, 2 * 500
        # Reads took 3 s, of which the passes waited 1.5 s; the groups took 3.5 s, so 2 s computed: a group of 500
        # tokens would need 500 x 3 / 2 = 750 to hide its read.
        streamer.read_seconds, streamer.waited_seconds, streamer.group_seconds = 3.0, 1.5, 3.5
        figures = streamer.statistics()
        assert figures["hidden"] == 0.5 and figures["tokens_per_group"] == 500 and figures["tokens_to_hide"] == 751
        line = _streamed(type("Summary", (), {"streamed": figures})())
        assert "groups held 500 fed tokens; about 751 would hide the read: a larger --max-memory" in line
        # Reads shorter than the compute: what did not hide is the first layer's read; no hint.
        streamer.read_seconds, streamer.waited_seconds, streamer.group_seconds = 1.0, 0.5, 3.5
        assert "tokens_to_hide" not in streamer.statistics()
    finally:
        streamer.reset_statistics()


def test_on_a_gpu_the_summary_says_what_was_read_and_not_what_share_hid(llama):
    """On a GPU a layer's copy waits behind the compute queued before it (layer_major.py): the host's clocks cannot
    split the two, so no share and no hint is said. The store's device is set by hand (no GPU here), the clocks too."""
    from klpipe.cli.precompute import _streamed
    from klpipe.model import layer_major

    streamer = llama.streamer
    streamer.reset_statistics()
    saved = streamer.store.device
    try:
        streamer.groups, streamer.tokens = 2, 2 * 500
        streamer.read_seconds, streamer.waited_seconds, streamer.group_seconds = 3.0, 1.5, 3.5
        streamer.store.reads = 3 << 20
        assert "tokens_to_hide" in streamer.statistics()  # on CPU these clocks give a hint (the test above)
        streamer.store.device = torch.device("cuda", 0)
        figures = streamer.statistics()
        assert figures["hidden"] is None and "tokens_to_hide" not in figures
        assert layer_major.figures([streamer])["hidden"] is None
        line = _streamed(type("Summary", (), {"streamed": layer_major.figures([streamer])})())
        assert line == "; weights streamed: 3 MiB read in 2 layer-major group(s), 2 MiB each"
    finally:
        streamer.store.device = saved
        streamer.reset_statistics()


def test_a_recurrent_layer_of_a_layer_major_tree_never_runs_from_a_state_it_was_not_given(tmp_path, monkeypatch):
    """Qwen3-Next's Gated DeltaNet layers continue each pass from its parents' recurrent and convolution states, which
    a parent in the same group leaves only as it goes past each layer: a pass's state layers are filled as each
    layer comes (ContextCache.fill). Unfilled, a layer would run from zeros, a fresh prefill's states, with no error:
    it raises instead, and the run stops rather than write that number."""
    from klpipe.model.attention import context_cache
    from klpipe.precompute.sharing import Sharing

    spec = ModelSpec(str(save_tiny("qwen3_next", tmp_path / "qwen3_next")), dtype="float32", device="cpu")
    in_memory, streamed = ReferenceModel.load(spec), ReferenceModel.load(spec, streamed=True)
    rows = chunk(in_memory.vocab_size, seed=2)
    plans = [Sharing(model, "auto", 1 << 10, lambda line: None).plan(rows, 96, None) for model in (in_memory, streamed)]
    assert plans[1].tree is not None and streamed.keeps_state and streamed.tree_layered
    filled, fill = [], context_cache.ContextCache.fill

    def counted(cache):
        before = len(cache.unfilled)
        fill(cache)
        filled.append(before - len(cache.unfilled))
    monkeypatch.setattr(context_cache.ContextCache, "fill", counted)
    got, expected = run_plan(streamed, plans[1], rows, 1.0), run_plan(in_memory, plans[0], rows, 1.0)
    assert sum(filled) > 0  # passes whose parents ran in their group, their states filled layer by layer
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected, strict=True) if len(a)) <= SAME
    monkeypatch.setattr(context_cache.ContextCache, "fill", lambda cache: None)
    with pytest.raises(RuntimeError, match="ran before its context's state was filled"):
        run_plan(streamed, plans[1], rows, 1.0)


def tree_depth(tree) -> int:
    """The most nodes on a path from the root (tree.path leaves the root out): the tree's levels."""
    return max(len(tree.path(node)) for node in range(1, tree.num_nodes))


def test_a_layer_major_tree_group_holds_two_layers_of_keys_where_a_pass_run_whole_held_every_layers(tmp_path,
                                                                                                   monkeypatch):
    """A streamed tree runs its levels layer-major in one group (model/attention/layered.py): a waiting pass holds,
    per slot of its batch, the budget's per token and two layers' keys and values (the one it is in, the one it
    leaves; the nodes it keeps are the tree cache's, in a budget of their own); a group holds at most the budget's
    spare. Eight layers: a pass waiting in a wave held all eight layers' keys."""

    spec = ModelSpec(str(big_llama(tmp_path / "llama", layers=8, hidden=256, intermediate=512)), dtype="float32",
                     device="cpu")
    in_memory, streamed = ReferenceModel.load(spec), ReferenceModel.load(spec, streamed=True)
    assert in_memory.use_cascade() is None and streamed.use_cascade() is None  # as --prefix-sharing installs it
    rows = chunk(in_memory.vocab_size, seed=2)
    plan = plan_chunk(streamed, rows, 96, "on")
    tree = plan.tree
    assert tree is not None and streamed.tree_layered
    expected = run_plan(in_memory, plan, rows, 1.0)
    layer = 2 * 2 * 128 * 4  # one layer's keys and values a token: 2 key/value heads of 128, fp32
    per_token = 1000
    own = tree.end - tree.start

    def held(step, layers: int) -> int:  # the pass's rows, each as long as its longest
        return len(step.nodes) * int(own[step.nodes].max()) * (per_token + layers * layer)
    whole = sum(held(step, 2) for step in plan.passes)
    seen = []
    run = streamed.streamer.run

    def noted(calls, between=lambda: None, tokens=0, held=None, **hooks):
        seen.append((len(calls), held))
        return run(calls, between, tokens, held, **hooks)
    monkeypatch.setattr(streamed.streamer, "run", noted)
    streamed.streamer.spare, streamed.streamer.per_token = whole, per_token
    try:
        got = run_plan(streamed, plan, rows, 1.0)
        assert streamed.cascade  # the context read in place: none gathered into the passes' slots
        tree_groups = [(calls, bytes_) for calls, bytes_ in seen if bytes_ is not None]
        assert tree_groups == [(len(plan.passes), whole)]  # every level of the tree in one group, by hand
        assert 2 * whole < sum(held(step, 8) for step in plan.passes)
        seen.clear()
        streamed.streamer.spare = whole // 3
        again = run_plan(streamed, plan, rows, 1.0)
    finally:
        streamed.streamer.spare = streamed.streamer.per_token = 0
    tree_groups = [(calls, bytes_) for calls, bytes_ in seen if bytes_ is not None]
    assert len(tree_groups) >= 3 and all(bytes_ <= whole // 3 or calls == 1 for calls, bytes_ in tree_groups)
    for result in (got, again):
        assert max(float(np.max(np.abs(a - b))) for a, b in zip(result, expected, strict=True) if len(a)) <= SAME


def test_a_layer_that_reuses_keys_the_layer_major_tree_freed_runs_the_tree_again_in_waves(monkeypatch):
    """Gemma 4's KV-shared layers reuse the keys of its "store" layers (layered.owners), held until the group ends.
    Told there are none, the layer-major group frees them: the first KV-shared layer finds them freed
    (cascade.FreedKeys), never reads what is gone, and the tree runs again in waves, at the in-memory result."""
    from klpipe.model.attention import layered

    spec = ModelSpec(str(TINY_GEMMA), dtype="float32", device="cpu")
    in_memory, streamed = ReferenceModel.load(spec), ReferenceModel.load(spec, streamed=True)
    assert in_memory.use_cascade() is None and streamed.use_cascade() is None  # as --prefix-sharing installs it
    rows = chunk(in_memory.vocab_size, seed=2)
    plan = plan_chunk(streamed, rows, 96, "on")
    assert plan.tree is not None and layered.owners(streamed)
    expected = run_plan(in_memory, plan, rows, 1.0)
    monkeypatch.setattr(layered, "owners", lambda reference: frozenset())
    groups = streamed.streamer.groups
    got = run_plan(streamed, plan, rows, 1.0)
    assert streamed.cascade and not streamed.tree_layered
    assert streamed.streamer.groups - groups >= 3  # the group abandoned, then the waves
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected, strict=True) if len(a)) <= SAME


def test_a_stop_between_layers_abandons_the_tree_with_no_layer_loaded_and_the_next_run_is_whole(llama):
    streamed = llama
    in_memory = ReferenceModel.load(ModelSpec(str(TINY_LLAMA), dtype="float32", device="cpu"))
    rows = chunk(in_memory.vocab_size, seed=6)
    plan = plan_chunk(in_memory, rows, 96, "on")
    groups, stops = streamed.streamer.groups, []

    def stop():  # after the group's first layer: every pass waits at the second, some kept nodes half written
        stops.append(streamed.streamer.groups - groups)
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        run_plan(streamed, plan, rows, 1.0, check_stop=stop)
    assert stops == [1]
    assert not any(streamed.streamer.store.loaded(k) for k in range(layer_count(streamed)))
    got, expected = run_plan(streamed, plan, rows, 1.0), run_plan(in_memory, plan, rows, 1.0)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected, strict=True) if len(a)) <= SAME


def test_a_call_the_tree_cannot_take_packed_mid_group_reruns_the_whole_tree_as_in_memory(monkeypatch):
    from klpipe.model.attention import packing

    spec = ModelSpec(str(TINY_LLAMA), dtype="float32", device="cpu")
    in_memory, streamed = ReferenceModel.load(spec), ReferenceModel.load(spec, streamed=True)
    rows = chunk(in_memory.vocab_size, seed=7)
    plan = plan_chunk(streamed, rows, 96, "on")
    assert streamed.packed and plan.tree is not None
    calls = []

    def refuse_the_third(*args, **kwargs):  # the passes without context packed through layer 0, then a call
        calls.append(1)                     # refused: inside a pass, mid-group
        if len(calls) == 3:
            raise packing.NotPacked("LlamaAttention passes softcap to its attention")
        return attend(*args, **kwargs)
    attend = packing.attend_spans
    monkeypatch.setattr(packing, "attend_spans", refuse_the_third)
    expected = run_plan(in_memory, plan, rows, 1.0)  # in memory, the same refusal: the whole tree again, padded
    assert not in_memory.packed and len(calls) == 3
    calls.clear()
    groups = streamed.streamer.groups
    got = run_plan(streamed, plan, rows, 1.0)
    assert not streamed.packed and len(calls) == 3  # padded from then on: no packed call after the refusal
    assert not plan.batches and streamed.streamer.groups - groups == 2  # the group refused, the whole tree again
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected, strict=True) if len(a)) <= SAME


# -- in a memory cgroup ------------------------------------------------------------------------------------------

CGROUP_LIMIT = 1000 << 20  # the job's memory: the interpreter, torch and transformers take about half of it
LAYERS = 44  # 44 layers of 61 MB (hidden 1,024, MLP 4,096, fp32): a 2.7 GB model, 2.6 times the limit


def big_llama(directory, layers: int = LAYERS, hidden: int = 1024, intermediate: int = 4096, kv_heads: int = 2):
    """A Llama of `layers` layers of 67 MB each (`kv_heads` key/value heads of 128), written as safetensors straight
    from numpy (four random layers, cycled: drawing 670M random numbers would take longer than the run), with the
    sample tokenizer."""
    import json
    import shutil

    import torch
    from safetensors.numpy import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.architectures import COMMON, TOKENIZER_FILES

    config = LlamaConfig(**{**COMMON, "hidden_size": hidden, "intermediate_size": intermediate,
                            "num_attention_heads": 8, "num_key_value_heads": kv_heads, "head_dim": 128,
                            "num_hidden_layers": layers})
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    rng = np.random.default_rng(0)
    variants = {}

    def tensor(key, shape):
        if len(shape) == 1:  # norms
            return np.ones(shape, dtype=np.float32)
        name = key.split(".", 3)[-1] if ".layers." in key else key
        variant = (int(key.split(".")[2]) % 4 if ".layers." in key else 0, name)
        if variant not in variants:
            scale = 2.0 / np.sqrt(shape[1])  # twice the usual init: logprobs spread over nats
            variants[variant] = (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float32)
        return variants[variant]
    directory.mkdir(parents=True)
    save_file({key: tensor(key, shape) for key, shape in shapes.items()}, str(directory / "model.safetensors"))
    drop_from_page_cache(directory / "model.safetensors")
    config.save_pretrained(directory)
    for file in TOKENIZER_FILES:
        shutil.copy(TINY_LLAMA / file, directory / file)
    assert json.loads((directory / "config.json").read_text())["num_hidden_layers"] == layers
    return directory


def drop_from_page_cache(path) -> None:
    """`path`'s pages out of the page cache (written to disk first): a process that reads it then is charged for
    them in its own memory cgroup, as it would be reading a model nobody has read since boot."""
    import os

    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def memory_cgroup(name: str, limit: int):
    """A v1 memory cgroup inside this process's own (v2: memory.max), limited to `limit` bytes: (its directory, the
    file a child writes its pid to, the file its peak usage is read from), or None where none can be made."""
    from pathlib import Path

    own = next((line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                if line.split(":")[1] == "memory"), None)
    if own is not None and Path("/sys/fs/cgroup/memory").is_dir():
        parent = Path("/sys/fs/cgroup/memory") / own.lstrip("/")
        limit_file, peak_file = "memory.limit_in_bytes", "memory.max_usage_in_bytes"
    elif Path("/sys/fs/cgroup/cgroup.controllers").is_file():
        own = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                   if line.startswith("0::"))
        parent = Path("/sys/fs/cgroup") / own.lstrip("/")
        limit_file, peak_file = "memory.max", "memory.peak"
    else:
        return None
    group = parent / name
    try:
        group.mkdir()
        (group / limit_file).write_text(str(limit))
    except OSError:
        return None
    return group, group / "cgroup.procs", group / peak_file


def streamed_in_a_cgroup_and_in_memory(tmp_path, command: list[str], name: str):
    """`python -m klpipe COMMAND` once inside a memory cgroup of CGROUP_LIMIT made for it (the unchanged command: the
    budget is the cgroup's limit, read by the process itself), once outside any: (the streamed run, the cgroup's
    peak use, the run in memory, each run's ref_logprobs). Skips where no cgroup can be made."""
    import os
    import subprocess
    import sys

    import pyarrow.parquet as pq

    from klpipe import cache
    from tests.helpers import with_checkout

    env = with_checkout({**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    made = memory_cgroup(f"klpipe-{name}-{os.getpid()}", CGROUP_LIMIT)
    if made is None:
        pytest.skip("no memory cgroup can be made here (needs root and cgroup v1 or v2)")
    group, procs, peak = made
    try:
        streamed = subprocess.run(
            ["sh", "-c", f'echo $$ > {procs} && exec "$0" -m klpipe "$@"', sys.executable, *command,
             "--output", str(tmp_path / "streamed.parquet")], capture_output=True, text=True, env=env, timeout=1200)
        used = int(peak.read_text())
    finally:
        group.rmdir()
    in_memory = subprocess.run([sys.executable, "-m", "klpipe", *command, "--output", str(tmp_path / "memory.parquet")],
                               capture_output=True, text=True, env=env, timeout=1200)
    read = [pq.read_table(tmp_path / f"{run}.parquet").column(cache.REF_LOGPROBS).to_pylist()
            if (tmp_path / f"{run}.parquet").is_file() else None for run in ("streamed", "memory")]
    return streamed, used, in_memory, *read


@pytest.mark.slow
def test_a_model_larger_than_its_memory_cgroup_streams_to_the_in_memory_result(tmp_path):
    import pyarrow.parquet as pq

    from tests.helpers import ROLLOUTS

    model = big_llama(tmp_path / "big")
    rows = tmp_path / "rows.parquet"
    pq.write_table(pq.read_table(ROLLOUTS).slice(0, 8), rows)
    assert (model / "model.safetensors").stat().st_size > 2.5 * CGROUP_LIMIT
    streamed, used, in_memory, got, expected = streamed_in_a_cgroup_and_in_memory(tmp_path, [
        "precompute", str(rows), "--model", str(model), "--progress", "none", "--max-tokens-per-batch", "256",
        "--prefix-sharing", "off"], "test")
    assert streamed.returncode == 0, streamed.stderr
    assert "its decoder layers stream from their files" in streamed.stderr and "memory cgroup's limit" in \
        streamed.stderr, streamed.stderr
    assert used <= CGROUP_LIMIT
    # The load-time checks' probes are one layer-major group: before its first row the run read its weights once
    # (each layer, and its untied head's blocks once a probe), never once a probe (the summary's own figure).
    import re

    read = re.search(r"([\d,]+) MiB of weights read\)", streamed.stderr)
    stored = (model / "model.safetensors").stat().st_size / 2**20
    assert read is not None and 0.98 * stored <= int(read.group(1).replace(",", "")) <= 1.02 * stored, read
    assert in_memory.returncode == 0 and "stream" not in in_memory.stderr, in_memory.stderr
    assert len(got) == len(expected) == 8
    values = np.concatenate([np.array(v) for v in expected if v])
    assert values.max() - values.min() > 2  # logprobs spread: a wrong computation cannot hide near log(1/V)
    assert max(float(np.max(np.abs(np.array(a) - np.array(b))))
               for a, b in zip(got, expected, strict=True) if a) <= SAME


@pytest.mark.slow
def test_a_prefix_tree_streamed_in_its_memory_cgroup_stays_inside_it_at_the_in_memory_result(tmp_path):
    """A tree's pass in a wave holds the keys and values of every layer it has been through: with 8 key/value heads
    of 128 over 44 layers, 352 KiB a token in fp32, 22 times what the budget counted per token for rows run whole.
    Its groups were sized as if it held only that, and the run was killed by its cgroup's OOM killer. Its groups are
    sized by what each pass holds now, and the passes run layer-major across the tree's levels (layered.py), each
    holding a layer or two of keys."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    model = big_llama(tmp_path / "big", kv_heads=8)
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(2):  # two GRPO groups of 8: a prompt of 350 tokens each, responses of 150
        prompt = rng.integers(10, 200, 350).tolist()
        rows += [{"prompt_ids": prompt, "response_ids": (response := rng.integers(10, 200, 150).tolist()),
                  "policy_logprobs": [-1.0] * len(response), "reward": 1.0} for _ in range(8)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    streamed, used, in_memory, got, expected = streamed_in_a_cgroup_and_in_memory(tmp_path, [
        "precompute", str(tmp_path / "rows.parquet"), "--model", str(model), "--progress", "none",
        "--max-tokens-per-batch", "256", "--prefix-sharing", "on"], "test-tree")
    assert streamed.returncode == 0, (streamed.returncode, streamed.stderr[-2000:])
    assert "its decoder layers stream from their files" in streamed.stderr
    assert "where running each row whole feeds" in streamed.stderr  # the tree ran
    assert used <= CGROUP_LIMIT
    assert in_memory.returncode == 0 and "decoder layers stream" not in in_memory.stderr, in_memory.stderr
    assert len(got) == len(expected) == 16
    assert max(float(np.max(np.abs(np.array(a) - np.array(b)))) for a, b in zip(got, expected, strict=True)) <= SAME


# -- the registry matrix (tests/matrix.py), streamed --------------------------------------------------------------

# The families whose layers streaming cannot find or free exactly: refused in one line when they load streamed.
NOT_STREAMED = {
    "cpmant": "no list of decoder layers to stream", "git": "no list of decoder layers to stream",
    "hrm_text": "no list of decoder layers to stream", "reformer": "no list of decoder layers to stream",
    "zamba": "decoder layers share weights, which streaming does not run yet",
}


def registry_families() -> list[str]:
    import json

    from tests import matrix

    return sorted(name for name, record in json.loads(matrix.RECORD.read_text()).items() if "oracle" in record)


@pytest.mark.arch
@pytest.mark.parametrize("family", registry_families())
def test_every_family_of_the_registry_streams_to_its_in_memory_result_or_is_refused(family, tmp_path):
    from klpipe.errors import ModelError
    from tests import matrix

    spec = ModelSpec(str(matrix.save_tiny(family, tmp_path / family)), dtype="float32", device="cpu")
    in_memory = ReferenceModel.load(spec)
    if family in NOT_STREAMED:
        with pytest.raises(ModelError) as caught:
            ReferenceModel.load(spec, streamed=True)
        assert str(caught.value).endswith(NOT_STREAMED[family]) and "\n" not in str(caught.value)
        return
    streamed = ReferenceModel.load(spec, streamed=True)
    rows = matrix.agent_rows(in_memory.vocab_size)
    plan = plan_chunk(in_memory, rows, 96, "off")
    expected, got = run_plan(in_memory, plan, rows, 1.0), run_plan(streamed, plan, rows, 1.0)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected, strict=True) if len(a)) <= SAME
    # The tree too, where the family shares (auto: its probe decides, the same way in both).
    from klpipe.precompute.sharing import Sharing

    plans = [Sharing(model, "auto", 1 << 10, lambda line: None).plan(rows, 96, None) for model in (in_memory, streamed)]
    assert (plans[0].tree is None) == (plans[1].tree is None)
    expected, got = run_plan(in_memory, plans[0], rows, 1.0), run_plan(streamed, plans[1], rows, 1.0)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected, strict=True) if len(a)) <= SAME


@pytest.mark.slow
def test_kill_9_then_rerun_resumes_a_streamed_run_to_the_in_memory_result(tmp_path):
    import re

    import pyarrow.parquet as pq

    from klpipe import cache
    from klpipe.precompute import PrecomputeConfig, precompute
    from klpipe.precompute.budget import parse_size
    from tests.helpers import kill_9_after_chunks, repeated_rollouts, run_cli

    model = big_llama(tmp_path / "llama", layers=8, hidden=256, intermediate=1024)  # 8 layers of 4 MB
    source = tmp_path / "rollouts.parquet"
    pq.write_table(repeated_rollouts(10), source, row_group_size=100)
    out, work = tmp_path / "cached.parquet", tmp_path / "cached.parquet.partial"
    # Rows whole in both runs, the same plan: the resume is what this test holds (the tree streamed plans with the
    # cache the budget leaves it, a plan of its own; it is held against the tree in memory above).
    args = ["precompute", "-m", str(model), str(source), "-o", str(out), "--chunk-rows", "8", "--device", "cpu",
            "--progress", "none", "--prefix-sharing", "off"]
    refused = run_cli(*args, "--max-memory", "1M")  # says the smallest budget: streams with a little more
    smallest = re.search(r"needs at least (\S+) ", refused.stderr).group(1)
    args += ["--max-memory", str(parse_size(smallest) + (12 << 20))]  # under the 31 MB the weights would need
    finished = kill_9_after_chunks(args, work, "chunk-*.parquet")
    assert not out.exists() and 3 <= finished < 60, finished
    rerun = run_cli(*args)
    assert rerun.returncode == 0, rerun.stderr
    assert f"resuming: {finished} of 60 chunks already done" in rerun.stderr
    assert "its decoder layers stream from their files" in rerun.stderr and "weights streamed:" in rerun.stderr
    in_memory = precompute(PrecomputeConfig(inputs=[source], output=tmp_path / "ref" / "cached.parquet",
                                            model=str(model), device="cpu", chunk_rows=8, progress="none",
                                            prefix_sharing="off"), log=lambda line: None)
    got, expected = pq.read_table(out), pq.read_table(in_memory.output)
    assert got.column("id").to_pylist() == expected.column("id").to_pylist() and got.num_rows == 480
    gap = max(float(np.max(np.abs(np.array(a) - np.array(b))))
              for a, b in zip(got.column(cache.REF_LOGPROBS).to_pylist(),
                              expected.column(cache.REF_LOGPROBS).to_pylist(), strict=True) if a)
    assert gap <= SAME
