"""The load-time checks as one record (klpipe/model/checks.py, verdict.py): what they decide is applied in one place,
a remembered verdict is held to the model's own forward before it is taken, and a streamed model's probes run as one
layer-major group, each under its own attention implementation."""

import numpy as np
import pytest

from klpipe.model import ModelSpec, ReferenceModel, head
from klpipe.model.attention import packing
from klpipe.model.verdict import OWN, Verdict
from tests.helpers import TINY_GEMMA, TINY_LLAMA, agent_rows, worst_error

SPEC = ModelSpec(str(TINY_LLAMA), dtype="float32", device="cpu")


def state(reference) -> tuple:
    """What the checks' decisions set on a model, as it runs rows."""
    return (type(reference.head).__name__, reference.own_forward, reference.rows_alone, reference.packed,
            reference.padded_why, reference.notes, reference.model.config._attn_implementation)


def test_a_verdict_reads_back_as_written_and_nothing_else_reads_as_one():
    verdict = Verdict(head=OWN, packed=True, padded_why=None, compiled=("LlamaMLP",), cascade=False, tree_probed=True,
                      tree="why not", notes=("a line", "another"))
    assert Verdict.from_json(verdict.to_json()) == verdict
    written = verdict.to_json()
    for broken in ({**written, "packed": "yes"}, {**written, "head": "theirs"}, {**written, "notes": [1]},
                   {k: v for k, v in written.items() if k != "tree"}, {**written, "more": 1}, [written]):
        with pytest.raises(ValueError):
            Verdict.from_json(broken)


@pytest.mark.parametrize("path", [TINY_LLAMA, TINY_GEMMA], ids=["llama", "gemma4"])
def test_a_remembered_verdict_applied_is_the_checked_model(path):
    spec = ModelSpec(str(path), dtype="float32", device="cpu")
    checked = ReferenceModel.load(spec)
    assert not checked.verdict_reused and checked.check_seconds > 0
    reused = ReferenceModel.load(spec, remembered=lambda model: checked.verdict)
    assert reused.verdict_reused and reused.recheck_why is None and reused.verdict == checked.verdict
    assert state(reused) == state(checked)
    rows = agent_rows(checked.vocab_size)[:8]
    for a, b in zip(reused.score_batch(rows), checked.score_batch(rows), strict=True):
        assert np.array_equal(a, b)


def test_a_remembered_verdict_the_model_disagrees_with_runs_every_check(monkeypatch):
    # Packed rows made wrong after the verdict was remembered (a change the key cannot see): the short probe, run
    # through the packed rows the verdict installs, disagrees with the model's own forward; the checks keep rows padded.
    remembered = ReferenceModel.load(SPEC).verdict
    assert remembered.packed
    right = packing.segment
    monkeypatch.setattr(packing, "segment", lambda q, k, v, scaling, window, gqa: right(q, k, v, 0.5, window, gqa))
    reference = ReferenceModel.load(SPEC, remembered=lambda model: remembered)
    assert not reference.verdict_reused and reference.recheck_why.startswith(
        "they disagree with its own forward on the short probe (max |Δ logprob| = ")
    assert not reference.packed and reference.padded_why.startswith("packed rows disagree with its own forward")
    rows = agent_rows(reference.vocab_size)[:6]
    assert worst_error(reference.model, rows, reference.score_batch(rows)) <= 1e-4


def test_a_remembered_head_that_turned_wrong_is_caught_and_the_models_own_head_runs(monkeypatch):
    right = head.HeadView.transform
    remembered = ReferenceModel.load(SPEC).verdict
    monkeypatch.setattr(head.HeadView, "transform", lambda self, logits, t: right(self, logits, t).mul_(1.25))
    reference = ReferenceModel.load(SPEC, remembered=lambda model: remembered)
    assert not reference.verdict_reused and isinstance(reference.head, head.ModelHead)


def test_a_streamed_models_checks_read_each_layer_once_and_decide_as_in_memory():
    in_memory = ReferenceModel.load(SPEC)
    streamed = ReferenceModel.load(SPEC, streamed=True)
    layers = len(streamed.streamer.store.layers)
    assert streamed.streamer.layer_reads == layers  # every probe, own and klpipe's, in one group
    assert streamed.verdict == in_memory.verdict and streamed.packed  # the packed pass ran packed
    reused = ReferenceModel.load(SPEC, streamed=True, remembered=lambda model: streamed.verdict)
    assert reused.verdict_reused and reused.streamer.layer_reads == layers  # the short probe: one group too


def test_each_pass_of_a_streamed_group_runs_under_its_own_implementation(monkeypatch):
    # The model's own forwards run transformers' sdpa, as loaded; the packed pass runs klpipe's packed rows: the
    # implementation each attention call saw, in the order the group ran them, layer by layer.
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen = []

    def own(*args, **kwargs):
        seen.append("sdpa")
        return sdpa_attention_forward(*args, **kwargs)

    def ours(*args, **kwargs):
        seen.append("packed" if packing.is_packed() else "packed name, unpacked")
        return packing.attention(*args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "sdpa", own)
    monkeypatch.setitem(AttentionInterface._global_mapping, packing.NAME, ours)
    streamed = ReferenceModel.load(SPEC, streamed=True)
    assert streamed.packed and "sdpa" in seen and "packed name, unpacked" not in seen
    assert seen.count("packed") == len(streamed.streamer.store.layers)  # one packed pass, each layer once


def test_a_remembered_verdict_that_gave_up_the_chunked_head_it_agrees_with_is_checked_again():
    # A verdict reached once on a probe that went wrong (the chunked head dropped for the model's own forward) would
    # otherwise stay: every later run slower, or refused under --prefix-sharing on. The short probe holds the chunked
    # head to the model's own forward too, and the checks run again where it agrees.
    from klpipe.model import probes

    wrong = Verdict(own_forward=probes.NO_HEAD, padded_why=packing.NOT_CAUSAL, notes=("a probe that went wrong",))
    reference = ReferenceModel.load(SPEC, remembered=lambda model: wrong)
    assert not reference.verdict_reused and reference.recheck_why.startswith(
        "they dropped klpipe's chunked head, which agrees with its own forward on the short probe")
    assert reference.own_forward is None and isinstance(reference.head, head.LMHead) and reference.packed
    assert reference.verdict == ReferenceModel.load(SPEC).verdict
