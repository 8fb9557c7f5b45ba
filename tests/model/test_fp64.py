"""fp64 all the way through (--dtype float64, klpipe/model/wide.py) against an fp64 forward of the same weights,
within 1e-9: rounding there is ~1e-14, so anything beyond is a wrong formula, on every family, whatever its fp32
chaos. Every path runs in fp64: rows run whole (packed or padded), the prefix tree in both budgets, the cascade and
its plain-torch kernel (the CPU flash kernel takes no fp64), and each kind of continuation (keys and values, Gated
DeltaNet and Mamba-2 states, convolution windows).

The architecture matrix's fast half runs in `make test`; its slow half, every family of the registry matrix
(tests/matrix.py) and LoRA adapters' sides (against PEFT's merge in fp64) are marked `fp64` and run in `make test-fp64`.
"""

import json
import re
import tempfile
from pathlib import Path

import numpy as np
import pytest

from klpipe.model import ModelSpec, ReferenceModel
from klpipe.precompute.logprobs import ForwardStats, chunk_logprobs
from tests import matrix
from tests.architectures import ARCHITECTURES, FAST, save_tiny
from tests.model.test_architectures import IN_PLACE, SLIDING_IN_PLACE, agent_rows

EXACT = matrix.EXACT
RECORD = json.loads(matrix.RECORD.read_text())
# In make test beside the fast half: the family whose fp32 tree could not be told from rounding (issue 42).
IN_MAKE_TEST = set(FAST) | {"qwen3_next"}


def marked(names):
    return [pytest.param(n, marks=() if n in IN_MAKE_TEST else pytest.mark.fp64) for n in names]


@pytest.fixture(scope="module", params=marked(sorted(ARCHITECTURES)))
def tiny(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    directory = save_tiny(request.param, tmp_path_factory.mktemp(request.param))
    untouched = AutoModelForCausalLM.from_pretrained(directory, dtype="float64").eval()  # never klpipe's copy
    reference = ReferenceModel.load(ModelSpec(str(directory), dtype="float64", device="cpu"))
    reference.use_cascade()  # as a run that may share installs it (precompute/sharing.py)
    return request.param, reference, untouched, {}, directory


def expected(tiny, rows, temperature=1.0) -> list[np.ndarray]:
    _name, _, untouched, memo, _ = tiny
    key = (temperature, id(rows))
    if key not in memo:
        from klpipe.model import wide
        from tests.helpers import oracle_logprobs

        untouched.double()  # what a model keeps in fp32 too
        if untouched._can_set_experts_implementation():
            untouched.set_experts_implementation("eager")
        with wide.fp64():
            memo[key] = (rows, [oracle_logprobs(untouched, p, r, temperature) for p, r in rows])
    return memo[key][1]


def worst(results, exact) -> float:
    for values, want in zip(results, exact, strict=True):
        assert values.dtype == np.float64 and values.shape == want.shape
    return max(float(np.max(np.abs(values - want))) for values, want in zip(results, exact, strict=True) if len(want))


ROWS = agent_rows(512)  # the sample tokenizer's vocabulary, as every tiny model's


def test_every_mode_is_the_fp64_forward(tiny):
    from klpipe.model.attention import cascade

    name, reference, _, _, _ = tiny
    exact = expected(tiny, ROWS)
    for sharing, max_tokens, max_cache in (("off", 96, 10**9), ("auto", 96, 10**9), ("on", 96, 10**9),
                                           ("on", 24, 40)):
        stats = ForwardStats()
        cascade.CALLS.clear()
        results = chunk_logprobs(reference, ROWS, max_tokens, 1.0, sharing, stats, max_cache_tokens=max_cache)
        error = worst(results, exact)
        assert error <= EXACT, f"{name} {sharing} ({max_tokens}, {max_cache}): {error:.3g} from the fp64 forward"
        if sharing != "off":  # the tree ran, and in place where the fp32 one does: the paths of fp32, in fp64
            assert stats.tree_rows >= 6 and stats.fed_tokens < stats.per_row_tokens
            assert (cascade.CALLS["cascade"] > 0) == (name in IN_PLACE), dict(cascade.CALLS)
            assert (cascade.CALLS["window"] > 0) == (name in SLIDING_IN_PLACE), dict(cascade.CALLS)
            assert cascade.CALLS["gathered"] == 0


def test_with_temperature(tiny):
    name, reference, _, _, _ = tiny
    exact = expected(tiny, ROWS, temperature=1.5)
    for sharing in ("off", "on"):
        error = worst(chunk_logprobs(reference, ROWS, 64, 1.5, sharing, ForwardStats()), exact)
        assert error <= EXACT, f"{name} {sharing}: {error:.3g} from the fp64 forward"


def test_the_paths_of_fp32(tiny):
    """fp64 takes fp32's paths: rows run whole packed or padded alike, the same substitutes kept by the load-time
    check (none falls back to the model's own forward in fp64 alone)."""
    _name, reference, _, _, directory = tiny
    fp32 = ReferenceModel.load(ModelSpec(str(directory), dtype="float32", device="cpu"))
    assert (reference.packed, reference.padded_why) == (fp32.packed, fp32.padded_why)
    assert (reference.own_forward, reference.rows_alone, reference.notes) == (fp32.own_forward, fp32.rows_alone,
                                                                                 fp32.notes)


# -- the registry matrix in fp64 -------------------------------------------------------------------------

FP64 = sorted(name for name, entry in RECORD.items() if entry.get("oracle") == "fp64" and "not_built" not in entry)


@pytest.mark.fp64
@pytest.mark.parametrize("name", FP64)
def test_every_registry_family_is_the_fp64_forward(name):
    """Every family whose own code runs in fp64: off, auto and on within 1e-9 of its fp64 forward, through the
    same paths as in fp32 (its record: what auto and on do, how rows run whole)."""
    import warnings

    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as directory:
        matrix.save_tiny(name, Path(directory))
        run = matrix.run_family(Path(directory), "float64")
    figures = {mode: f"{error:.3g}" for mode, error in run.errors.items()}
    assert not run.crashed, f"{name}: raw errors {run.crashed}"
    assert not run.wrong, f"{name}: worst |error| {figures} from the fp64 forward"
    assert without_figures(run.record()) == without_figures(RECORD[name]), f"{name} in fp64: {run.record()}"


def without_figures(record: dict) -> dict:
    """A record with the figures its reasons quote (a probe's max |Δ logprob|) left out: fp64 measures other ones."""
    return {key: re.sub(r"= [-+0-9.e]+", "= …", value) if isinstance(value, str) else value
            for key, value in record.items()}


# -- LoRA adapters in fp64 ------------------------------------------------------------------------------

ADAPTERS = {"lora": {"rank": 4}, "dora": {"rank": 4, "dora": True}, "head": {"rank": 2, "modules_to_save": ["lm_head"]}}


@pytest.mark.fp64
@pytest.mark.parametrize("case", sorted(ADAPTERS))
def test_an_adapters_side_is_the_fp64_forward_of_peft_merge(tmp_path, case):
    """An adapter over fp64 weights (model/lora.py): its update in fp64 too, each mode of its side within 1e-9 of the
    fp64 forward of PEFT's own merge_and_unload done in fp64, and the base's side within 1e-9 of the base's."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.helpers import TINY_LLAMA
    from tests.model.test_lora import merged, save_adapter

    adapter = save_adapter(TINY_LLAMA, tmp_path / case, **ADAPTERS[case])
    config = json.loads((adapter / "adapter_config.json").read_text())
    reference = ReferenceModel.load(ModelSpec(str(TINY_LLAMA), dtype="float64", device="cpu"),
                                    adapters=(("policy", str(adapter), config),))
    reference.use_cascade()
    exact = matrix.fp64_forward(merged(TINY_LLAMA, adapter, torch.float64), ROWS)
    base = matrix.fp64_forward(AutoModelForCausalLM.from_pretrained(TINY_LLAMA, dtype=torch.float64).eval(), ROWS)
    assert worst(exact, base) > 0.01  # the adapter moves the logprobs
    for sharing in ("off", "on"):
        with reference.side("policy"):
            error = worst(chunk_logprobs(reference, ROWS, 96, 1.0, sharing, ForwardStats()), exact)
        assert error <= EXACT, f"{case} {sharing}: {error:.3g} from PEFT's fp64 merge"
        error = worst(chunk_logprobs(reference, ROWS, 96, 1.0, sharing, ForwardStats()), base)
        assert error <= EXACT, f"{case} {sharing}, the base's side: {error:.3g} from the base's fp64 forward"


# -- the fp32 tests' oracle ------------------------------------------------------------------------------


def test_the_fp32_tests_oracle_is_an_fp64_forward(tiny):
    """helpers.Fp64Oracle, the bound of every fp32 test (its own error + 1e-4), is fp64 all the way through. A
    model's own fp32 casts in an fp64 model (Qwen3-Next's and Qwen3.5's delta rule and gated norms, RoPE's angles)
    made it share the fp32 rounding of rows run whole, chunks aligned at position 0, and not the tree's: the tree's
    fp32 error against it was its own rounding plus those casts', beyond a bound that held only the fp32 oracle's
    (issue 42, Qwen3-Next). Here the fp64 tree, itself within 1e-9 of the fp64 forward, is held to the oracle's fp64
    logprobs: 1e-6 (RoPE's angles) to 2e-5 (the delta rule) off before."""
    import copy

    from tests.helpers import Fp64Oracle

    name, reference, untouched, _, _ = tiny
    oracle = Fp64Oracle(copy.deepcopy(untouched).float())  # as the fp32 tests give it the model: fp32
    fp64, _ = oracle.expected(ROWS)
    results = chunk_logprobs(reference, ROWS, 96, 1.0, "on", ForwardStats())
    assert worst(results, fp64) <= EXACT, name


# -- as a user runs it -----------------------------------------------------------------------------------


def test_precompute_dtype_float64(tmp_path):
    """`klpipe precompute --dtype float64` through the tree on agent rollouts: the cache holds the fp64 forward's
    logprobs rounded to float32 (half an fp32 ulp), and says the run was fp64."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM

    from klpipe import cache
    from tests.helpers import TINY_LLAMA, agent_rollouts, run_cli

    rollouts = agent_rollouts(tmp_path / "rollouts.parquet", tasks=3)
    output = tmp_path / "cached.parquet"
    result = run_cli("precompute", "--model", str(TINY_LLAMA), str(rollouts), "--output", str(output),
                     "--dtype", "float64", "--prefix-sharing", "on")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "Warning" not in result.stderr
    table = pq.read_table(output)
    assert json.loads(table.schema.metadata[b"klpipe"])["dtype"] == "float64"
    model = AutoModelForCausalLM.from_pretrained(TINY_LLAMA, dtype=torch.float64).eval()
    rows = table.to_pylist()
    exact = matrix.fp64_forward(model, [(np.array(r["prompt_ids"]), np.array(r["response_ids"])) for r in rows])
    for row, want in zip(rows, exact, strict=True):
        got = np.array(row[cache.REF_LOGPROBS], dtype=np.float64)
        assert got.shape == want.shape
        assert np.all(np.abs(got - want) <= np.spacing(np.abs(want).astype(np.float32)) / 2)
