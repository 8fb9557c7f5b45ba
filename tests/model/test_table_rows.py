"""Embedding tables left in their files by a streamed model (klpipe/model/table_rows.py: Gemma's per-layer table,
input embeddings the head does not share): each forward reads the rows its ids name, and gives, bit for bit, what the
table loaded whole by transformers gives; which tables are left so is decided by the model's own modules."""

import pytest
import torch

from klpipe.model import ModelSpec, ReferenceModel, streamed_load
from klpipe.model.architecture import decoder_body
from klpipe.model.table_rows import Resting, streamable
from klpipe.model.weight_store import decoder_layers
from tests.architectures import save_tiny
from tests.helpers import TINY_GEMMA, TINY_GEMMA_MM, TINY_LLAMA


def ids(vocab: int) -> torch.Tensor:
    """(2, 24) ids: repeats, both ends of the vocabulary, runs and gaps."""
    row = torch.tensor([5, 3, 3, 0, vocab - 1, 7, 8, 9, 5, 100, 101, 102])
    return torch.stack([torch.cat([row, row.flip(0)]), torch.cat([row.roll(3), row])])


@pytest.mark.parametrize("path,checkpoint,dtype", [
    (TINY_GEMMA, None, "float32"),
    (TINY_GEMMA, None, "bfloat16"),  # the fp32 checkpoint's rows rounded as the loader rounds the whole table
    (TINY_GEMMA, torch.bfloat16, "float32"),  # a bf16 checkpoint's rows widened
    (TINY_GEMMA_MM, None, "float32"),  # the text part of a multimodal checkpoint: its keys renamed at load
], ids=["fp32", "fp32-as-bf16", "bf16-as-fp32", "multimodal"])
def test_rows_read_give_the_table_loaded_whole(tmp_path, path, checkpoint, dtype):
    if checkpoint is not None:
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(path, dtype=checkpoint).save_pretrained(tmp_path)
        for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            (tmp_path / file).write_bytes((path / file).read_bytes())
        path = tmp_path
    spec = ModelSpec(str(path), dtype=dtype, device="cpu")
    model, in_memory = ReferenceModel.load(spec, streamed=True), ReferenceModel.load(spec)
    store = model.streamer.store
    inputs = model.model.get_input_embeddings()
    # Gemma 4's per-layer table, and its input embeddings where its head is untied (the committed tiny one's; the
    # multimodal one ties them, as the hub's checkpoints do)
    whole_model = in_memory.model
    untied = whole_model.get_output_embeddings().weight is not whole_model.get_input_embeddings().weight
    assert untied != (path == TINY_GEMMA_MM)
    assert len(store.tables) == 1 + untied
    assert any(model.model.get_submodule(t.path) is inputs for t in store.tables) == untied
    for table in store.tables:
        module, whole = model.model.get_submodule(table.path), in_memory.model.get_submodule(table.path)
        before = store.reads
        got = module(ids(module.num_embeddings))
        expected = whole(ids(module.num_embeddings))
        assert got.dtype == expected.dtype == getattr(torch, dtype) and torch.equal(got, expected)
        # the rows are freed once the forward is over: meta again, or the input embeddings' stand-in
        assert module.weight.is_meta != (module is inputs)
        assert module.weight is table.meta and (module is not inputs or isinstance(module.weight, Resting))
        # 10 distinct ids read, at the checkpoint's dtype
        assert store.reads - before == 10 * module.embedding_dim * (checkpoint or torch.float32).itemsize


def test_an_id_past_the_table_is_refused_as_the_table_refuses_it():
    model = ReferenceModel.load(ModelSpec(str(TINY_GEMMA), dtype="float32", device="cpu"), streamed=True)
    for table in model.streamer.store.tables:
        module = model.model.get_submodule(table.path)
        with pytest.raises(IndexError):
            module(torch.tensor([[1, module.num_embeddings]]))
        assert module.weight is table.meta


def built(path):
    model = streamed_load._build(ModelSpec(str(path), dtype="float32", device="cpu"))[0]
    return model, decoder_layers(decoder_body(model))[1]


def test_only_tables_a_forward_gathers_rows_of_are_left_in_their_files(tmp_path):
    # Gemma 4's per-layer table, input embeddings the head does not share; never a tied head's, or a table whose
    # class computes its own ids (OPT's learned positions add an offset inside their forward).
    model, layers = built(TINY_GEMMA)
    assert set(streamable(model, layers)) == {"model.embed_tokens_per_layer", "model.embed_tokens"}
    assert set(streamable(*built(TINY_LLAMA))) == {"model.embed_tokens"}
    assert set(streamable(*built(save_tiny("gemma3", tmp_path / "gemma3")))) == {"model.embed_tokens"}  # scaled
    assert set(streamable(*built(TINY_GEMMA_MM))) == {"model.embed_tokens_per_layer"}  # the input ones tied to the head

    class Positions(torch.nn.Embedding):
        def forward(self, mask):  # ids made inside: the rows it needs are not its argument's
            return super().forward(mask.cumsum(-1) + 2)

    table = model.model.embed_tokens_per_layer
    model.model.embed_tokens_per_layer = Positions(table.num_embeddings, table.embedding_dim, device="meta")
    assert set(streamable(model, layers)) == {"model.embed_tokens"}


@pytest.mark.parametrize("key", ["model.embed_tokens_per_layer.weight", "model.embed_tokens.weight", "lm_head.weight"])
def test_a_table_read_by_rows_of_another_shape_is_refused_before_anything_loads(tmp_path, key):
    # The loader, which would refuse a tensor of the wrong shape, never sees a table read by rows: the store checks it.
    import shutil

    from safetensors.torch import load_file, save_file

    from klpipe.errors import ModelError

    shutil.copytree(TINY_GEMMA, tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    expected = tuple(tensors[key].shape)
    tensors[key] = tensors[key][:-1].clone()  # one vocabulary row short
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError) as caught:
        streamed_load.load(ModelSpec(str(tmp_path), dtype="float32", device="cpu"))
    shape = (expected[0] - 1, expected[1])
    assert str(caught.value) == (f"{key} is {shape} in the checkpoint, and the model's {key.removesuffix('.weight')} "
                                 f"{expected}: the checkpoint does not match the model class")
