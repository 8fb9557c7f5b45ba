"""An untied LM head left in its file by a streamed model (klpipe/model/streamed_head.py): read a block of rows at a
time, for klpipe's chunked head and for the model's own forward, at the numbers of the head loaded whole by
transformers; which heads are left so is decided by the model's own modules."""

import numpy as np
import pytest
import torch

from klpipe.errors import ModelError
from klpipe.model import ModelSpec, ReferenceModel, streamed_head, streamed_load
from klpipe.model.architecture import decoder_body
from klpipe.model.head import HeadBlocks
from klpipe.model.table_rows import Resting
from klpipe.model.weight_store import decoder_layers
from tests.helpers import TINY_GEMMA, TINY_GEMMA_MM, TINY_LLAMA, Fp64Oracle


@pytest.fixture(scope="module", params=[(TINY_GEMMA, "float32"), (TINY_GEMMA, "bfloat16"), (TINY_LLAMA, "float32")],
                ids=["gemma4", "gemma4-bf16", "llama"])
def pair(request):
    path, dtype = request.param
    spec = ModelSpec(str(path), dtype=dtype, device="cpu")
    return ReferenceModel.load(spec, streamed=True), ReferenceModel.load(spec)


def small_blocks(model: ReferenceModel, rows: int = 96, vocab: int = 32, hidden_rows: int = 5) -> None:
    """Blocks far smaller than the tiny models' heads: several reads, several fused vocabulary blocks in each, and
    a ragged last one (the vocabularies are multiples of 32, not of 96)."""
    model.head.blocks = HeadBlocks(hidden_rows, vocab)
    if model.head.streamed is not None:
        model.head.streamed.rows = rows


def test_the_head_stays_in_its_file_and_rests_as_a_stand_in(pair):
    model, in_memory = pair
    store = model.streamer.store
    head = model.model.get_output_embeddings()
    assert store.head is not None and model.head.streamed is store.head
    whole = in_memory.model.get_output_embeddings().weight
    assert isinstance(head.weight, Resting) and (head.weight.shape, head.weight.dtype) == (whole.shape, whole.dtype)
    assert store.head.path == "lm_head" and store.sizes.tables >= whole.numel() * whole.element_size()
    with pytest.raises(ModelError, match=r"^lm_head's weight, left in its file, was read outside its forward"):
        head.weight[0]
    with pytest.raises(ModelError, match=r"^lm_head's weight"):  # a state_dict's copy says the same
        head.weight.detach() + 1


def test_the_chunked_head_read_in_blocks_gives_the_head_in_memory(pair):
    model, in_memory = pair
    small_blocks(model)
    small_blocks(in_memory)
    vocab, width = in_memory.head.vocab_size, in_memory.model.config.hidden_size
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(13, width, generator=generator).to(in_memory.dtype)
    # Both ends of the vocabulary, a block's first and last rows, rows read by several targets.
    targets = torch.tensor([0, vocab - 1, 95, 96, 191, 5, 5, 300 % vocab, 1, 2, 3, 4, 7, 8, vocab - 2])
    rows = torch.tensor([0, 1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 10, 11, 12, 12])
    reads = model.streamer.store.reads
    for temperature in (1.0, 0.7):
        got = model.head.logprobs(hidden, targets, temperature, rows)
        expected = in_memory.head.logprobs(hidden, targets, temperature, rows)
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
        assert float((got - expected).abs().max()) <= 1e-6
    head_bytes = in_memory.model.get_output_embeddings().weight.numel() * 4  # the fp32 checkpoint's
    assert model.streamer.store.reads - reads == 2 * head_bytes  # the whole head once a call, nothing else


def test_the_models_own_forward_reads_its_head_in_blocks(pair):
    model, in_memory = pair
    small_blocks(model)
    ids = torch.arange(40)[None] * 7 % in_memory.vocab_size
    with torch.inference_mode():
        got = model.model(input_ids=ids, use_cache=False).logits
        expected = in_memory.model(input_ids=ids, use_cache=False).logits
    assert got.shape == expected.shape
    assert float((got.float() - expected.float()).abs().max()) <= (1e-5 if model.dtype == torch.float32 else 0.05)
    assert isinstance(model.model.get_output_embeddings().weight, Resting)


def test_streamed_rows_with_small_head_blocks_stay_at_the_oracle(pair):
    model, in_memory = pair
    small_blocks(model)
    rng = np.random.default_rng(1)
    rows = [(rng.integers(0, in_memory.vocab_size, 9), rng.integers(0, in_memory.vocab_size, 17)) for _ in range(3)]
    got = model.score_batch(rows)
    expected = in_memory.score_batch(rows)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected, strict=True)) <= 1e-5
    if model.dtype == torch.float32:  # the fp64 oracle's bound is for fp32 runs (bf16: the run in memory, above)
        ours, own = Fp64Oracle(in_memory.model).errors(rows, got)
        assert ours <= own + 1e-4, f"{ours:.3g} from fp64 (the fp32 oracle's own error {own:.3g})"


def test_a_target_outside_the_vocabulary_is_refused_as_the_head_in_memory_refuses_it(pair):
    model, in_memory = pair
    hidden = torch.zeros(2, in_memory.model.config.hidden_size, dtype=in_memory.dtype)
    for head in (model.head, in_memory.head):
        with pytest.raises(IndexError):
            head.logprobs(hidden, torch.tensor([1, in_memory.vocab_size]))


def built(path):
    model = streamed_load._build(ModelSpec(str(path), dtype="float32", device="cpu"))[0]
    return model, decoder_layers(decoder_body(model))[1]


def test_only_an_untied_plain_linear_head_is_left_in_its_file():
    assert streamed_head.streamable(*built(TINY_LLAMA)) == "lm_head"
    assert streamed_head.streamable(*built(TINY_GEMMA_MM)) is None  # tied to the input embeddings

    class Scaled(torch.nn.Linear):  # a head whose forward does more than its weight (Dory's learned logit scale)
        def forward(self, hidden):
            return super().forward(hidden) * 2

    model, layers = built(TINY_LLAMA)
    head = model.lm_head
    model.lm_head = Scaled(head.in_features, head.out_features, bias=False, device="meta")
    assert streamed_head.streamable(model, layers) is None


def test_a_head_stored_under_another_name_stays_resident_as_the_budget_counts_it(tmp_path):
    # Inkling 2 stores its head as `model.llm.unembed`, converted at load: the budget, which reads only the
    # checkpoint's header before anything loads, counts it resident, and the store keeps it so.
    from tests import matrix

    path = matrix.save_tiny("inkling2_loop_text", tmp_path / "inkling")
    spec = ModelSpec(str(path), dtype="float32", device="cpu")
    sizes = streamed_load.measure(spec, 64)
    model = ReferenceModel.load(spec, streamed=True)
    head = model.model.get_output_embeddings().weight
    assert model.streamer.store.head is None and not isinstance(head, Resting) and not head.is_meta
    assert sizes.resident == model.streamer.store.sizes.resident >= head.numel() * head.element_size()
    # The tiny Llama's, stored as lm_head.weight, is left in its file by both: what stays is the final norm and RoPE's
    # frequencies.
    keys = streamed_load.checkpoint_keys(ModelSpec(str(TINY_LLAMA)))
    assert "lm_head.weight" in keys and streamed_head.stored_as_is("lm_head", keys)
    spec = ModelSpec(str(TINY_LLAMA), dtype="float32", device="cpu")
    whole = ReferenceModel.load(spec).model
    kept = whole.model.norm.weight.nbytes + sum(b.nbytes for b in whole.model.rotary_emb.buffers())
    store = ReferenceModel.load(spec, streamed=True).streamer.store
    assert streamed_load.measure(spec, 64).resident == kept == store.sizes.resident


def test_a_hub_names_head_is_budgeted_from_the_local_cache_with_no_request(tmp_path, monkeypatch):
    # Before anything loads, a hub name's checkpoint header is read from the local Hugging Face cache where its files
    # are there (the run would stream the head from them), never fetched: not cached yet, the head counts resident.
    import json
    import shutil

    from tests.helpers import run_python

    snapshot = tmp_path / "hub" / "models--someone--tiny" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    shutil.copy(TINY_GEMMA / "config.json", snapshot / "config.json")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # a request would fail
    code = """if True:
        import json, sys
        from klpipe.model import ModelSpec, streamed_load
        print(json.dumps([vars(streamed_load.measure(ModelSpec(name, dtype="float32", device="cpu"), 64))
                          for name in sys.argv[1:]]))"""

    def measured() -> list[dict]:
        result = run_python(code, str(TINY_GEMMA), "someone/tiny")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    local, hub = measured()  # the config alone in the cache: the head counted resident
    assert hub["resident"] == local["resident"] + 512 * 64 * 4 and hub["weights"] == local["weights"]
    shutil.copy(TINY_GEMMA / "model.safetensors", snapshot / "model.safetensors")
    local, hub = measured()  # the weights there too: the same sizes as the local path's
    assert hub == local
