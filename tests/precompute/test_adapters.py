"""PEFT adapter folders as users have them (precompute/adapters.py): a folder with its weights alone, a base recorded
as a relative path, a config whose settings the saved tensors do not use. Folders saved by PEFT itself."""

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from klpipe.cache import read_provenance
from klpipe.errors import ModelError
from klpipe.precompute import PrecomputeConfig
from tests.helpers import TINY_LLAMA
from tests.model.test_lora import ATTENTION, assert_at_oracle, bare_rollouts, mean_gap, merged, run, save_adapter

WITHOUT_CONFIG = ("holds an adapter's weights (adapter_model.safetensors) without its adapter_config.json, which "
                  "says its base, rank and scaling; copy it in from where PEFT saved the two together")


def test_an_adapters_weights_without_its_config_are_said_to_be_that(tmp_path):
    # adapter_model.safetensors copied apart from its adapter_config.json: no model folder either (no config.json),
    # whichever option names it.
    adapter = save_adapter(TINY_LLAMA, tmp_path / "adapter", rank=2)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(adapter / "adapter_model.safetensors", bare)
    rollouts = bare_rollouts(tmp_path)
    with pytest.raises(ModelError) as caught:
        run(tmp_path, [rollouts], TINY_LLAMA, bare)
    assert str(caught.value) == f"--policy {bare}: {WITHOUT_CONFIG}"
    with pytest.raises(ModelError) as caught:
        run(tmp_path, [rollouts], bare, None)
    assert str(caught.value) == f"--model {bare}: {WITHOUT_CONFIG}"
    with pytest.raises(ModelError) as caught:  # no --model: the reference would be the base its config records
        PrecomputeConfig(inputs=[rollouts], policy=str(bare))
    assert str(caught.value) == f"--policy {bare}: {WITHOUT_CONFIG}"
    assert not list(tmp_path.glob("out.parquet*"))


def test_a_base_recorded_as_a_relative_path(tmp_path, monkeypatch):
    # TRL and PEFT record base_model_name_or_path as the trainer was given it: here `../base`, from the training
    # directory beside the base and the adapter. From elsewhere, it is found from the adapter's folder.
    project = tmp_path / "project"
    shutil.copytree(TINY_LLAMA, project / "base")
    (project / "train").mkdir()
    monkeypatch.chdir(project / "train")
    adapter = save_adapter(Path("../base"), project / "adapter", rank=2)
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == "../base"
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    summary = run(tmp_path, [bare_rollouts(tmp_path)], None, adapter)
    assert read_provenance(summary.output).model == str(project / "base")
    table = pq.read_table(summary.output)
    assert_at_oracle(table, "ref_logprobs", AutoModelForCausalLM.from_pretrained(TINY_LLAMA).eval())
    assert_at_oracle(table, "policy_logprobs", merged(TINY_LLAMA, adapter))
    # Moved where `../base` leads nowhere: said so, and what to do.
    lone = tmp_path / "lone" / "adapter"
    shutil.copytree(adapter, lone)
    with pytest.raises(ModelError) as caught:
        run(tmp_path, [bare_rollouts(tmp_path)], None, lone, name="lone.parquet")
    assert str(caught.value) == (f"--policy {lone}: records its base model as ../base, a relative path found neither "
                                 "from here nor from the adapter's folder; pass the base as --model")
    # As --model (an SFT adapter): its base can come from nowhere else.
    with pytest.raises(ModelError, match=r"--model .*: records its base model as \.\./base, a relative path found "
                                         "neither from here nor from the adapter's folder; set base_model_name_or_path "
                                         "in its adapter_config.json to the base's path"):
        run(tmp_path, [bare_rollouts(tmp_path)], lone, None, name="lone.parquet")
    # --model given: the base to run, checked by its name as before (`base`, as the record's last part).
    passed = run(tmp_path, [bare_rollouts(tmp_path)], project / "base", lone, name="given.parquet")
    assert pq.read_table(passed.output).column("policy_logprobs").equals(table.column("policy_logprobs"))


def test_bias_all_over_a_base_without_biases_runs(tmp_path):
    # PEFT's bias="all" trains the base's biases and saves them beside the adapter: on Llama (no biases) there are
    # none in the file, and the adapter is its LoRA alone, held to PEFT's merge of the folder.
    adapter = save_adapter(TINY_LLAMA, tmp_path / "adapter", rank=4, bias="all")
    assert json.loads((adapter / "adapter_config.json").read_text())["bias"] == "all"
    assert all("lora_" in key for key in load_file(adapter / "adapter_model.safetensors"))
    table = pq.read_table(run(tmp_path, [bare_rollouts(tmp_path)], TINY_LLAMA, adapter, chunk_rows=5).output)
    assert_at_oracle(table, "policy_logprobs", merged(TINY_LLAMA, adapter))
    assert mean_gap(table) > 0.05


def test_trained_biases_in_the_file_are_refused(tmp_path):
    # Over a base with biases, bias="all" saves them: what the file holds is refused, in one line, naming it.
    config = AutoConfig.from_pretrained(TINY_LLAMA)
    config.attention_bias = True
    base = tmp_path / "biased"
    AutoModelForCausalLM.from_config(config).save_pretrained(base)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_LLAMA / name, base)
    adapter = save_adapter(base, tmp_path / "adapter", rank=2, targets=ATTENTION, bias="all")
    assert any(key.endswith(".bias") for key in load_file(adapter / "adapter_model.safetensors"))
    with pytest.raises(ModelError, match=r"holds base_model\.model\.model\.layers\.\d\.self_attn\.\w_proj\."
                                         r"base_layer\.bias, a trained bias \(bias='all'\), which klpipe does not "
                                         "apply"):
        run(tmp_path, [bare_rollouts(tmp_path)], base, adapter)
    assert not list(tmp_path.glob("out.parquet*"))

