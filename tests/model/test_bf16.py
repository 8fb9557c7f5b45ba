"""bf16 on CPU: the GPU's numerics (bf16 weights and activations, the head accumulating in fp32) through klpipe's
precompute path, tree on and off, on the architecture matrix's families (tests/matrix.py), against an fp64 forward
of the same bf16 weights.

The tolerance is derived per model, from bf16's own rounding, never picked:

    u = 2^-8     bf16's machine epsilon (8 significand bits; round-to-nearest errs by at most u/2 = 2^-9)

A bf16 forward rounds every linear layer's output to bf16 (relative error ≤ u/2) and its inputs were rounded before
(another u/2): at most u per linear output, before whatever the model does between them. How far that moves a
logprob depends on the model (a random tiny model with large weights is chaotic and amplifies it), so it is
measured: the fp64 model is run again with every linear layer's output multiplied by (1 + ε), ε drawn uniform in
[-u, u] per element (`spread`), DRAWS times, and the largest |Δ logprob| against the clean fp64 forward is the
model's spread under bf16-sized rounding. A random draw's worst element need not be the worst rounding can do, so
the bound is twice the spread, plus the fp32 head's own 1e-4:

    tolerance = 2 · spread + 1e-4

The head's part is not in the spread: it accumulates in fp32 (model/head.py), so its logits carry fp32 rounding, not
bf16's (bf16 logits would round a logit of 20 by 0.06: tests/model/test_head.py holds the head to 1e-4 with bf16
weights).

Some models round more than their linear outputs in bf16: a recurrent or chunked linear-attention kernel (Bailing's
KDA) runs its state in bf16 through every step, and its own one-row bf16 forward lands outside that bound of fp64
(bailing_hybrid: 1.06 against 0.50). klpipe cannot be closer to fp64 than the model's own forward is. So klpipe's
bf16 logprobs, in every mode, are held within the tolerance of one of two references: fp64, or the model's own
one-row bf16 forward, the naive oracle in the GPU's dtype (bailing_hybrid: 0.03 from it). A batching or sharing
bug is far from both.

Four families do not run in bf16 here, each refused in one line, and `REFUSED` records where and why: XLNet and
Reformer mix fp32 buffers into bf16 matmuls on CPU (their own forward fails at load), and under `on` the tree's
probe refuses Beam and Youtu, whose logprobs move by more than its bf16 tolerance once a prefix is continued or a
later token is added (never wrong numbers: `auto` runs them whole).
`make test` runs a few families; `make test-bf16` (in .ci/run) the whole matrix.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from tests import matrix
from tests.helpers import oracle_logprobs
from tests.model.test_matrix import RECORD

U = 2.0 ** -8
DRAWS = 2
HEAD = 1e-4
FAST = ["gemma4_text", "qwen3"]  # in `make test`: Gemma 4 (softcap, sliding windows, KV-shared layers), Qwen3


def spread(model64, rows, expected, draws: int = DRAWS, seed: int = 0) -> float:
    """The largest |Δ logprob| of the fp64 model with every linear output perturbed by bf16-sized rounding."""
    generator = torch.Generator().manual_seed(seed)

    def rounded(out: torch.Tensor) -> torch.Tensor:
        noise = torch.rand(out.shape, generator=generator, dtype=torch.float64) * 2 - 1
        return out * (1 + U * noise)

    def perturb(module, args, out):
        # A router is a Linear that returns a tuple (Llama 4: scores and logits; PhiMoE: weights and expert
        # indices): its floating outputs are stored in bf16 alike, its indices are not rounded.
        if isinstance(out, tuple):
            return tuple(rounded(o) if torch.is_floating_point(o) else o for o in out)
        return rounded(out)

    hooks = [m.register_forward_hook(perturb) for m in model64.modules() if isinstance(m, torch.nn.Linear)]
    try:
        worst = 0.0
        for _ in range(draws):
            for (prompt, response), exact in zip(rows, expected, strict=True):
                if len(response):
                    moved = oracle_logprobs(model64, prompt, response)
                    worst = max(worst, float(np.max(np.abs(moved - exact))))
        return worst
    finally:
        for hook in hooks:
            hook.remove()


def bf16_errors(directory: Path, modes=("off", "on")) -> tuple[dict, float, float, float, dict]:
    """({mode: klpipe's bf16 worst |error| against fp64}, the tolerance, the spread, the model's own one-row bf16
    forward's worst |error| against fp64, {mode: klpipe's worst |error| against that forward}) for the tiny model
    there."""
    from transformers import AutoModelForCausalLM

    from klpipe.errors import ModelError
    from klpipe.model import ModelSpec, ReferenceModel, wide
    from klpipe.precompute.logprobs import ForwardStats, plan_stats, run_plan
    from klpipe.precompute.sharing import Sharing

    reference = ReferenceModel.load(ModelSpec(str(directory), dtype="bfloat16", device="cpu"))
    rows = matrix.agent_rows(reference.vocab_size)[:12]
    # The oracle: the same bf16 weights, widened to fp64 (exactly), as transformers loads them.
    model64 = AutoModelForCausalLM.from_pretrained(directory, dtype="bfloat16").eval()
    model64 = copy.deepcopy(model64).to(torch.float64)
    if model64._can_set_experts_implementation():
        model64.set_experts_implementation("eager")
    # fp64 all the way through (model/wide.py), as Fp64Oracle: the model's own fp32 casts would otherwise round the
    # "fp64" forward, or stop it where they meet fp64 weights (Inkling 2).
    with wide.fp64():
        expected = [oracle_logprobs(model64, p, r) for p, r in rows]
        measured = spread(model64, rows, expected)
    tolerance = 2 * measured + HEAD
    own_model = AutoModelForCausalLM.from_pretrained(directory, dtype="bfloat16").eval()
    if own_model._can_set_experts_implementation():
        own_model.set_experts_implementation("eager")
    own = [oracle_logprobs(own_model, p, r) for p, r in rows]  # the model's own bf16 forward, a row at a time
    own_error = max(float(np.max(np.abs(o - e))) for o, e in zip(own, expected, strict=True) if len(e))
    errors, from_own = {}, {}
    for mode in modes:
        try:
            sharing = Sharing(reference, mode, 1 << 10, lambda line: None)
        except ModelError as exc:  # a mode klpipe refuses for this model in bf16: the caller says whether it may
            errors[mode] = from_own[mode] = f"refused: {exc}"
            continue
        plan = sharing.plan(rows, 96, None)
        stats = ForwardStats()
        plan_stats(plan, stats)
        assert mode == "off" or stats.tree_rows, "the tree ran no row"
        results = run_plan(reference, plan, rows, 1.0)
        errors[mode] = max(float(np.max(np.abs(v - e))) for v, e in zip(results, expected, strict=True) if len(e))
        from_own[mode] = max(float(np.max(np.abs(v - o)))
                             for v, o, e in zip(results, own, expected, strict=True) if len(e))
    return errors, tolerance, measured, own_error, from_own


# Where klpipe refuses a family in bf16 ("load": the model itself; a mode: that mode), and the words it says.
REFUSED = {
    "xlnet": ("load", ("its own forward fails on a probe sequence (RuntimeError: expected scalar type Float but found "
                       "BFloat16)")),
    "reformer": ("load", "its own forward fails on a probe sequence (RuntimeError: mixed dtype (CPU)"),
    "beam": ("on", "cannot share prefixes exactly (its forward is not causal"),
    "youtu": ("on", "cannot share prefixes exactly (continuing a prefix's keys and values changes the logprobs"),
}


def check(name: str) -> None:
    from klpipe.errors import ModelError

    modes = ("off", "on") if RECORD[name]["on"] == "shares" else ("off",)  # the tree where the family shares
    where, words = REFUSED.get(name, (None, None))
    with tempfile.TemporaryDirectory() as directory:
        matrix.save_tiny(name, Path(directory))
        if where == "load":
            with pytest.raises(ModelError) as refused:
                bf16_errors(Path(directory), modes)
            assert words in str(refused.value), str(refused.value)
            return
        errors, tolerance, measured, own_error, from_own = bf16_errors(Path(directory), modes)
    said = (f"{name}: bf16 worst |error| {errors} against fp64, {from_own} against the model's own bf16 forward "
            f"(itself {own_error:.3g} from fp64); tolerance 2 x {measured:.3g} + 1e-4 = {tolerance:.3g}")
    if where is not None:
        assert str(errors.pop(where)).startswith("refused: ") and words in from_own.pop(where), said
    assert errors, said
    for mode, error in errors.items():
        assert isinstance(error, float) and (error <= tolerance or from_own[mode] <= tolerance), said


@pytest.mark.parametrize("name", FAST)
def test_bf16_within_its_own_rounding_of_fp64(name):
    check(name)


# Every family the matrix holds to an fp64 oracle (the others' own code cannot run in fp64).
FAMILIES = sorted(name for name, entry in RECORD.items() if entry.get("oracle") == "fp64" and "wrong" not in entry)


@pytest.mark.bf16
@pytest.mark.parametrize("name", [n for n in FAMILIES if n not in FAST])
def test_bf16_within_its_own_rounding_of_fp64_every_family(name):
    check(name)
