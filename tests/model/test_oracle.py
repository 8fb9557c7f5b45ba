"""The load-time check (klpipe/model/probes.py): the model's own forward, taken before klpipe installs anything, is
the oracle; a substitute of klpipe's that disagrees with it is dropped for the model's own code, with one line.

Each test installs a deliberately wrong substitute (an attention function, a chunked head), and checks that the
check drops it and that the numbers stay at the naive one-row oracle.
"""

import numpy as np
import pytest
import torch

from klpipe.model import ModelSpec, ReferenceModel, head
from klpipe.model.attention import cascade, packing
from klpipe.precompute.logprobs import ForwardStats, chunk_logprobs
from klpipe.precompute.sharing import Sharing
from tests.helpers import TINY_LLAMA, agent_rows, worst_error

TOLERANCE = 1e-4


def load():
    return ReferenceModel.load(ModelSpec(str(TINY_LLAMA), dtype="float32", device="cpu"))


def test_only_packed_rows_attention_is_installed_at_load_and_under_off():
    reference = load()
    assert reference.notes == [] and isinstance(reference.head, head.LMHead) and not reference.rows_alone
    lines = []
    Sharing(reference, "off", 1024, lines.append)
    # Only packed rows' attention is installed at load (transformers' sdpa outside a packed batch).
    assert not reference.cascade and reference.model.config._attn_implementation == packing.NAME and lines == []
    Sharing(reference, "auto", 1024, lines.append)
    assert reference.cascade and reference.model.config._attn_implementation == cascade.NAME and lines == []


def test_a_wrong_attention_substitute_is_dropped_with_one_line(monkeypatch):
    reference = load()
    right = packing.attention

    def wrong(module, query, key, value, attention_mask, **kwargs):  # twice the scores' scale
        kwargs["scaling"] = 2 * (kwargs.get("scaling") or query.shape[-1] ** -0.5)
        return right(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(packing, "attention", wrong)  # what the cascade's attention runs for packed rows
    lines = []
    sharing = Sharing(reference, "on", 1024, lines.append)
    assert len(lines) == 1 and lines[0].startswith("LlamaForCausalLM: klpipe's cascade attention disagrees with "
                                                   "the model's own sdpa attention (max |Δ logprob| = ")
    assert not reference.cascade and reference.model.config._attn_implementation == packing.NAME
    assert sharing.mode == "on"  # the tree stays: with the model's own attention it agrees
    rows = agent_rows(reference.vocab_size)[:10]
    cascade.CALLS.clear()
    for mode in ("on", "off"):
        results = chunk_logprobs(reference, rows, 48, 1.0, mode, ForwardStats(), max_cache_tokens=10**9)
        assert worst_error(reference.model, rows, results) <= TOLERANCE, mode
    assert not cascade.CALLS  # klpipe's attention is never called again


def test_a_wrong_head_substitute_is_dropped_for_the_models_own_head(monkeypatch):
    right = head.HeadView.transform  # the fused head's logit transforms, of every block and every target
    monkeypatch.setattr(head.HeadView, "transform", lambda self, logits, t: right(self, logits, t).mul_(1.25))  # wrong
    reference = load()
    assert isinstance(reference.head, head.ModelHead)
    assert len(reference.notes) == 1 and reference.notes[0].startswith(
        "LlamaForCausalLM: klpipe's chunked LM head disagrees with the model's own logits (max |Δ logprob| = ")
    rows = agent_rows(reference.vocab_size, seed=2)[:10]
    for mode in ("off", "on"):
        results = chunk_logprobs(reference, rows, 48, 1.0, mode, ForwardStats(), max_cache_tokens=10**9)
        assert worst_error(reference.model, rows, results) <= TOLERANCE, mode
    # The wrong head was live: with it, the same rows are far off (the test would catch keeping it).
    reference.head = head.LMHead(reference.model, reference.model.config, "cpu")
    results = chunk_logprobs(reference, rows, 48, 1.0, "off", ForwardStats())
    assert worst_error(reference.model, rows, results) > 0.1


def test_the_models_own_head_is_bounded_by_blocks_and_gives_back_its_body(monkeypatch):
    reference = load()
    own = head.ModelHead(reference.model, reference.body, "cpu", logits_budget=3 * reference.vocab_size)
    assert own.rows == 3
    shapes = []
    lm_head = reference.model.get_output_embeddings()
    handle = lm_head.register_forward_hook(lambda module, args, out: shapes.append(tuple(out.shape)))
    rows = agent_rows(reference.vocab_size, seed=4)[:5]
    expected = chunk_logprobs(reference, rows, 10_000, 1.0, "off", ForwardStats())
    handle.remove()
    monkeypatch.setattr(reference, "head", own)
    handle = lm_head.register_forward_hook(lambda module, args, out: shapes.append(tuple(out.shape)))
    shapes.clear()
    got = chunk_logprobs(reference, rows, 10_000, 1.0, "off", ForwardStats())
    handle.remove()
    assert shapes and all(s[:2] == (1, 3) or (s[0] == 1 and s[1] < 3) for s in shapes)  # never more than a block
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected, strict=True) if len(a)) <= 1e-5
    assert reference.model.get_decoder() is reference.body  # the body is back


@pytest.mark.parametrize("source, branches", [
    ('if self.config._attn_implementation in ("eager", "sdpa"):', True),
    ('if config._attn_implementation == "sdpa" and not output_attentions:', True),
    ('elif "flex_attention" != self.config._attn_implementation:', True),
    ("fn = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)", False),
])
def test_code_that_compares_the_implementations_name_is_told_apart(source, branches):
    assert bool(cascade._NAME_TEST.search(source)) is branches


def test_a_model_whose_code_compares_the_name_never_gets_klpipes_attention():
    from transformers import AutoModelForCausalLM

    from tests.families import config

    model = AutoModelForCausalLM.from_config(config("deepseek_v32")).eval()
    assert cascade.branches_on_name(model)
    assert not cascade.enable(model, model.config) and model.config._attn_implementation == "sdpa"
    llama = load()
    assert not cascade.branches_on_name(llama.model)


def test_a_forward_that_fails_for_a_known_reason_in_the_config_is_refused_in_klpipes_words(tmp_path):
    # DeepSeek-V3's latent attention makes keys for every query head; a config asking for fewer key/value heads makes
    # transformers' own sdpa call fail with a bare "The size of tensor a (4) must match the size of tensor b (8)".
    from klpipe.errors import ModelError
    from tests import families

    name, fields = families.FAMILIES["deepseek_v3"]
    families.FAMILIES["deepseek_v3"] = (name, {**fields, "num_key_value_heads": 2})
    try:
        directory = families.save_family("deepseek_v3", tmp_path / "deepseek_v3")
    finally:
        families.FAMILIES["deepseek_v3"] = (name, fields)
    with pytest.raises(RuntimeError, match=r"The size of tensor a \(4\) must match the size of tensor b \(8\)"):
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(directory)(input_ids=torch.tensor([[1, 2, 3]]))  # the model's own code
    with pytest.raises(ModelError) as refused:
        ReferenceModel.load(ModelSpec(str(directory), dtype="float32", device="cpu"))
    assert str(refused.value) == (
        "DeepseekV3ForCausalLM: its own forward fails on a probe sequence (its multi-head latent attention "
        "(kv_lora_rank 16) makes keys and values for each of its 4 query heads, and its config asks for 2 key/value "
        "heads, so transformers repeats them into 8; set num_key_value_heads to num_attention_heads (4), as "
        "DeepSeek's own configs do)")
