"""The registry matrix (tests/matrix.py): every entry of transformers' causal LM registry, recorded in
tests/matrix.json, and the table on docs/architectures.md generated from that record.

The fast tests (in `make test`) run no model: the record covers the registry exactly, and the page's table is the
record's. The rest (marked `arch`, run by `make test-matrix`) build every family tiny again and hold it to the fp64
oracle in every mode and to its record: a family with a wrong number in any mode fails, whatever it was recorded as.
"""

import json
import tempfile
from pathlib import Path

import pytest

from tests import matrix

RECORD = json.loads(matrix.RECORD.read_text())


def test_the_record_covers_the_registry_exactly():
    """A transformers that adds or drops a family fails here until `python -m tests.matrix --record NAME` runs it."""
    names = set(matrix.registry())
    assert len(names) > 150  # the registry is read, not empty
    assert sorted(names - set(RECORD)) == [], "run: python -m tests.matrix --record NAME..."
    assert sorted(set(RECORD) - names) == []


def test_the_docs_table_is_the_records():
    text = matrix.PAGE.read_text()
    assert text.count(matrix.BEGIN) == text.count(matrix.END) == 1
    block = text[text.index(matrix.BEGIN):text.index(matrix.END) + len(matrix.END)]
    assert block == matrix.page_block(RECORD), "run: python -m tests.matrix --docs"


def test_the_table_states_every_outcome():
    """The table is told by the record, wrong numbers included: a family recorded wrong reads as wrong."""
    record = {"llama": {"oracle": "fp64", "auto": "shares", "on": "shares", "rows": "packed"},
              "qwen3": {"oracle": "fp64", "auto": "runs whole: a reason", "on": "refused: a reason",
                        "rows": "padded: a reason", "wrong": {"off": "8.81"}},
              "bart": {"not_run": "the decoder half of an encoder-decoder model"}}
    rows = {line.split(" | ")[0]: line for line in matrix.table(record).splitlines()}
    assert rows["| LlamaForCausalLM (`llama`)"] == (
        "| LlamaForCausalLM (`llama`) | at the fp64 oracle | shares | shares | packed |")
    assert rows["| Qwen3ForCausalLM (`qwen3`)"] == (
        "| Qwen3ForCausalLM (`qwen3`) | **wrong by 8.81** | runs whole: a reason | refused: a reason "
        "| padded: a reason |")
    assert "the decoder half of an encoder-decoder model" in rows["| BartForCausalLM (`bart`)"]
    assert "| GPT2LMHeadModel (`gpt2`) | not recorded" in matrix.table(record)
    assert "wrong numbers: qwen3" in matrix.tally(record)


RUN = sorted(name for name, entry in RECORD.items() if "not_run" not in entry)


@pytest.mark.arch
@pytest.mark.parametrize("name", RUN)
def test_every_family_is_exact_in_every_mode_and_as_recorded(name):
    """Under off and auto (and on, where it does not refuse) within the fp32 oracle's own error + 1e-4 of fp64, on
    agent-shaped rows; a refusal is one line, under on alone; and the outcome is the recorded one."""
    import warnings

    warnings.filterwarnings("ignore")
    families = matrix.registry()
    assert matrix.kind(families[name], families) is None
    with tempfile.TemporaryDirectory() as directory:
        if "not_built" in RECORD[name]:
            with pytest.raises(Exception) as raised:
                matrix.save_tiny(name, Path(directory))
            assert matrix._first_line(raised.value) == RECORD[name]["not_built"]
            return
        matrix.save_tiny(name, Path(directory))
        run = matrix.run_family(Path(directory))
    figures = {mode: f"{error:.3g}" for mode, error in run.errors.items()}
    assert not run.crashed, f"{name}: raw errors {run.crashed}"
    assert not run.wrong, f"{name}: worst |error| {figures} against the fp32 oracle's own {run.own:.3g}"
    assert run.off.startswith("runs whole") and not run.auto.startswith("refused")
    assert all("\n" not in said for said in (run.auto, run.on))
    assert run.record() == RECORD[name], f"{name}: {run.record()} (rerun python -m tests.matrix --record {name})"


@pytest.mark.arch
@pytest.mark.parametrize("name", sorted(name for name, entry in RECORD.items() if "not_run" in entry))
def test_every_family_not_run_is_not_a_decoder_only_model(name):
    families = matrix.registry()
    assert matrix.kind(families[name], families) == RECORD[name]["not_run"]
