"""A streamed layer loaded again by its plan (klpipe/model/weight_store.py) holds, tensor for tensor and bit for bit,
what transformers' own loader put there the first time: same values, dtype, shape, type and flags. A layer the
loader had to convert (experts stored one by one, fused at load) has no plan and goes through the loader again."""

import pytest
import torch

from klpipe.model import ModelSpec, ReferenceModel
from klpipe.model.table_rows import Resting
from tests.architectures import save_tiny
from tests.helpers import TINY_GEMMA, TINY_LLAMA

# (the model, the layers that must have a plan): every layer, but where the checkpoint stores experts one by one.
MODELS = {"tiny-llama": (TINY_LLAMA, None), "tiny-gemma4": (TINY_GEMMA, None), "qwen3_moe": (None, set())}


def layer_state(layer) -> dict:
    """name -> (a copy of the tensor, its type, dtype, requires_grad) of every parameter and buffer of `layer`."""
    return {name: (t.detach().clone(), type(t), t.dtype, t.requires_grad)
            for name, t in [*layer.named_parameters(), *layer.named_buffers()]}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_planned_load_holds_what_the_loader_made(name, tmp_path):
    path, planned = MODELS[name]
    path = path or save_tiny(name, tmp_path)
    model = ReferenceModel.load(ModelSpec(str(path), dtype="float32", device="cpu"), streamed=True)
    store = model.streamer.store
    layers = range(len(store.layers))
    # The load-time checks loaded every layer once, through the loader: the plans are made by now.
    assert set(store._plans) == (set(layers) if planned is None else planned)
    for k in layers:
        store.load(k)  # by its plan, where it has one
        by_plan = layer_state(store.layers[k])
        store.release(k)
        plan = store._plans.pop(k, None)
        store.load(k)  # through transformers' loader
        by_loader = layer_state(store.layers[k])
        store.release(k)
        assert (k in store._plans) == (plan is not None)  # the loader makes the plan again
        assert by_plan.keys() == by_loader.keys() and by_plan
        for key, (tensor, kind, dtype, grad) in by_loader.items():
            got = by_plan[key]
            assert (got[1], got[2], got[3]) == (kind, dtype, grad), f"layer {k} {key}"
            assert torch.equal(got[0], tensor), f"layer {k} {key}: differs from the loader's"


def test_a_bfloat16_checkpoint_streamed_in_float32_is_cast_as_the_loader_casts_it(tmp_path):
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(TINY_LLAMA, dtype=torch.bfloat16).save_pretrained(tmp_path)
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / file).write_bytes((TINY_LLAMA / file).read_bytes())
    spec = ModelSpec(str(tmp_path), dtype="float32", device="cpu")
    streamed, in_memory = ReferenceModel.load(spec, streamed=True), ReferenceModel.load(spec)
    store = streamed.streamer.store
    assert set(store._plans) == set(range(len(store.layers)))
    assert {dtype for plan in store._plans.values() for *_, dtype in plan} == {torch.float32}
    store.load(1)  # by its plan: read as bf16, cast to fp32
    try:
        own = dict(in_memory.model.named_parameters())
        for name, parameter in store.layers[1].named_parameters():
            expected = own[f"{store.layers_path}.1.{name}"]
            assert parameter.dtype == torch.float32 and torch.equal(parameter, expected), name
    finally:
        store.release(1)


def test_layer_of_names_the_decoder_layer_a_path_lies_in():
    model = ReferenceModel.load(ModelSpec(str(TINY_LLAMA), dtype="float32", device="cpu"), streamed=True)
    store = model.streamer.store
    assert store.layers_path == "model.layers"
    assert store.layer_of("model.layers.1.self_attn.q_proj") == 1
    assert store.layer_of("model.layers.1") == 1
    assert store.layer_of("model.layers.10.mlp.up_proj.weight") == 10
    assert store.layer_of("model.embed_tokens") is None
    assert store.layer_of("model.layers_norm.1.weight") is None  # a prefix of the path alone is not the list


def test_a_one_position_pass_streamed_gives_the_bits_of_the_model_in_memory():
    # Gemma 4 runs its KV-shared layers over the last position alone (logits_to_keep = 1), so matrices multiply one
    # position's vector, whose rounding depends on where the matrix lies (tensor_files._place). Every weight streamed
    # lies where from_pretrained's does, modulo 64, and the hidden state is the same, bit for bit (the per-layer
    # projection read into fresh memory put it 3e-7 apart before).
    spec = ModelSpec(str(TINY_GEMMA), dtype="float32", device="cpu")
    memory, streamed = ReferenceModel.load(spec), ReferenceModel.load(spec, streamed=True)
    own = dict(memory.model.named_parameters())
    resident = {n: p for n, p in streamed.model.named_parameters()
                if not p.is_meta and not isinstance(p, Resting) and n in own}
    assert "model.per_layer_model_projection.weight" in resident
    assert all(p.data_ptr() % 64 == own[n].data_ptr() % 64 for n, p in resident.items() if p.numel() > 1)
    ids = torch.tensor([[5, 3, 9, 100, 7, 8, 2, 11, 400, 12]])
    with torch.inference_mode():
        expected = memory.body(input_ids=ids, logits_to_keep=1, use_cache=False).last_hidden_state
        got = streamed.body(input_ids=ids, logits_to_keep=1, use_cache=False).last_hidden_state
    assert expected.shape == (1, 1, 64) and torch.equal(got, expected)
