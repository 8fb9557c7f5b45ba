"""Families beyond the matrix (tests/families.py) against an fp64 forward of the model as transformers loads it,
in every --prefix-sharing mode, through the path precompute takes (precompute/sharing.py: the load-time check,
the cascade installed only for a tree, the tree's probe): exact under off and auto, and under on either exact or
refused in one line that names the layer kind. Marked `arch`: `make test-arch` runs them.
"""

import numpy as np
import pytest

from klpipe.errors import ModelError
from klpipe.model import ModelSpec, ReferenceModel, head
from klpipe.precompute.logprobs import run_plan
from klpipe.precompute.sharing import Sharing
from tests import helpers
from tests.families import save_family
from tests.helpers import Fp64Oracle

pytestmark = pytest.mark.arch
TOLERANCE = 1e-4  # beyond the fp32 oracle's own error against fp64

# What `on` says of each family that cannot share: the layer kind, by name.
REFUSED = {
    "deepseek_v32": "the prefix tree does not know how a 'indexed_attention' cache layer (layer 0) continues a prefix",
    "recurrent_gemma": "the prefix tree cannot continue RG-LRU recurrent layers",
    "jamba": "the prefix tree cannot continue Mamba-1 SSM layers",
    "falcon_mamba": "the prefix tree cannot continue Mamba-1 SSM layers",
    "minimax": "the prefix tree cannot continue lightning-attention layers",
}


@pytest.fixture(scope="module", params=sorted(["deepseek_v32", "recurrent_gemma", "jamba", "falcon_mamba", "minimax",
                                               "deepseek_v3"]))
def family(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    directory = save_family(request.param, tmp_path_factory.mktemp(request.param))
    # The oracle is the model as transformers loads it, loaded apart: nothing klpipe does to its own copy reaches it.
    return request.param, directory, Fp64Oracle(AutoModelForCausalLM.from_pretrained(directory).eval())


def run(directory, mode: str):
    reference = ReferenceModel.load(ModelSpec(str(directory), dtype="float32", device="cpu"))
    lines = []
    sharing = Sharing(reference, mode, 1024, lines.append)
    rows = helpers.agent_rows(reference.vocab_size, 0, window=16, system=37, low=3, three_token_row=True)
    plan = sharing.plan(rows, 96, None)
    return reference, sharing, lines, rows, plan, run_plan(reference, plan, rows, 1.0)


@pytest.mark.parametrize("mode", ["off", "auto"])
def test_off_and_auto_match_the_fp64_forward(family, mode):
    name, directory, oracle = family
    reference, sharing, lines, rows, plan, results = run(directory, mode)
    ours, own = oracle.errors(rows, results)
    assert ours <= own + TOLERANCE, f"{name} {mode}: {ours:.3g} against the fp32 oracle's {own:.3g}"
    assert own < 1e-3
    values = np.concatenate([r for r in results if len(r)])
    assert values.max() - values.min() > 4  # logprobs spread over nats: a wrong computation cannot hide
    if mode == "off":
        assert not reference.cascade and lines == []
    if name in REFUSED and mode == "auto":  # auto says once why its rows run whole, and runs them so
        assert sharing.mode == "off" and plan.tree is None and not reference.cascade
        assert len(lines) == 1 and REFUSED[name] in lines[0] and lines[0].startswith("prefix sharing off: ")
    # RecurrentGemma caps its logits through `logits_soft_cap`: the model's own head computes them.
    assert isinstance(reference.head, head.ModelHead) == (name == "recurrent_gemma")


def test_on_is_exact_or_refused_in_one_line_naming_the_layer_kind(family):
    name, directory, oracle = family
    if name in REFUSED:
        with pytest.raises(ModelError) as refused:
            run(directory, "on")
        message = str(refused.value)
        assert "\n" not in message and REFUSED[name] in message and message.startswith("--prefix-sharing on: ")
        assert "RuntimeError" not in message
        return
    _reference, sharing, _lines, rows, plan, results = run(directory, "on")
    assert plan.tree is not None and sharing.mode == "on"
    ours, own = oracle.errors(rows, results)
    assert ours <= own + TOLERANCE, f"{name} on: {ours:.3g} against the fp32 oracle's {own:.3g}"
