"""`--policy ADAPTER` and `--model ADAPTER`: PEFT LoRA folders over one copy of the base weights.

Adapters are made at test time with PEFT itself (non-zero lora_B, so the adapter moves the logprobs), and the oracle
is PEFT's own `merge_and_unload()` of the same folder, run in fp64 beside the base's fp64 forward.
"""

import json
import warnings
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from klpipe.cache import read_provenance
from klpipe.errors import ModelError, OutputError
from klpipe.model import loading
from klpipe.precompute import PrecomputeConfig, precompute
from klpipe.score import ScoreConfig, score
from tests.architectures import save_tiny
from tests.helpers import (
    ROLLOUTS,
    RUN_KLPIPE,
    TINY_GEMMA,
    TINY_GEMMA_MM,
    TINY_LLAMA,
    Fp64Oracle,
    agent_rollouts,
    assert_mismatch_figures,
    run_python,
    sampled_logprobs,
)

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
TOLERANCE = 1e-4


def save_adapter(base: Path, directory: Path, rank: int = 4, targets=ATTENTION + MLP, modules_to_save=None,
                 dora: bool = False, seed: int = 0, spread: float = 0.05, **options) -> Path:
    """A PEFT LoRA adapter over `base`, saved by PEFT, with random non-zero B (and modules_to_save moved too)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, modules_to_save=modules_to_save,
                        use_dora=dora, task_type="CAUSAL_LM", **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # PEFT's call of a transformers method deprecated in v6
        peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=spread * 4 / rank ** 0.5)
            elif "modules_to_save" in name or "lora_magnitude_vector" in name:
                parameter.mul_(1 + spread * torch.randn_like(parameter))
    peft_model.save_pretrained(directory)
    return directory


def merged(base: Path, adapter: Path, dtype: torch.dtype | None = None):
    """PEFT's own merge of the adapter into the base: the policy the oracle runs. `dtype`: the base and the adapter in
    it, the merge done in it (fp64: W + s·B A rounded in fp64, not in the adapter's fp32)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # PEFT's call of a transformers method deprecated in v6
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=dtype), adapter)
        return (model if dtype is None else model.to(dtype)).merge_and_unload().eval()


def run(tmp_path, inputs, model, policy, name="out.parquet", log=lambda message: None, **kwargs):
    config = PrecomputeConfig(inputs=[Path(p) for p in inputs], output=tmp_path / name,
                              model=None if model is None else str(model),
                              policy=None if policy is None else str(policy), device="cpu", progress="none", **kwargs)
    return precompute(config, log=log)


def bare_rollouts(tmp_path) -> Path:
    source = agent_rollouts(tmp_path / "agent.parquet", tasks=2, group=3, turns=2)
    path = tmp_path / "bare.parquet"
    pq.write_table(pq.read_table(source).drop_columns(["policy_logprobs"]), path)
    return path


def assert_at_oracle(table, column, model):
    rows = [(np.array(r["prompt_ids"]), np.array(r["response_ids"])) for r in table.to_pylist()]
    got = [np.array(v, dtype=np.float32) for v in table.column(column).to_pylist()]
    ours, own = Fp64Oracle(model).errors(rows, got)
    assert ours <= own + TOLERANCE, (column, ours, own)


def mean_gap(table) -> float:
    ref, policy = (np.concatenate(table.column(c).to_pylist()) for c in ("ref_logprobs", "policy_logprobs"))
    return float(np.mean(np.abs(ref - policy)))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return save_tiny("qwen3", tmp_path_factory.mktemp("qwen3"))


# Llama, Qwen3 and Gemma 4; rank 1 and 64; attention alone and attention + MLP; the head as modules_to_save; rows
# run whole (packed), the prefix tree (its caches per side), and auto. make test runs the first; make test-slow all.
FAST = "llama-r1-attention-whole"
CASES = {
    "llama-r1-attention-whole": (TINY_LLAMA, 1, ATTENTION, None, "off"),
    "llama-r64-all-tree-head": (TINY_LLAMA, 64, ATTENTION + MLP, ["lm_head"], "on"),
    "qwen3-r8-all-auto-head": ("qwen3", 8, ATTENTION + MLP, ["lm_head"], "auto"),
    "gemma4-r4-all-tree-head": (TINY_GEMMA, 4, ATTENTION + MLP, ["lm_head"], "on"),
}


@pytest.mark.parametrize("case", [pytest.param(case, marks=() if case == FAST else pytest.mark.slow)
                                  for case in sorted(CASES)])
def test_both_columns_at_their_oracles_with_one_copy_of_the_base(tmp_path, qwen3, monkeypatch, case):
    base, rank, targets, to_save, sharing = CASES[case]
    base = qwen3 if base == "qwen3" else base
    adapter = save_adapter(base, tmp_path / "adapter", rank=rank, targets=targets, modules_to_save=to_save)
    loads = []
    load_model = loading.load_model
    monkeypatch.setattr(loading, "load_model", lambda spec: loads.append(spec.name) or load_model(spec))
    summary = run(tmp_path, [bare_rollouts(tmp_path)], base, adapter, prefix_sharing=sharing,
                  max_tokens_per_batch=96, chunk_rows=5)
    assert loads == [str(base)]  # one copy of the base weights: the policy is the same model, its adapter on
    table = pq.read_table(summary.output)
    assert_at_oracle(table, "ref_logprobs", AutoModelForCausalLM.from_pretrained(base).eval())
    assert_at_oracle(table, "policy_logprobs", merged(base, adapter))
    assert mean_gap(table) > 0.05  # the adapter moves the logprobs: the policy is not the reference again


# PEFT over the hub's Gemma 4 (Gemma4ForConditionalGeneration), its language model's MLPs by a regex as users write it.
LANGUAGE_MLP = r".*language_model.*\.(gate_proj|up_proj|down_proj)"


def test_adapters_saved_over_the_hubs_multimodal_gemma4(tmp_path):
    # PEFT over the multimodal checkpoint names its modules (model.language_model.layers.N...), renamed to the text
    # model's as the checkpoint's keys are; the reference's adapter trains its head too (tied to the embeddings in
    # the checkpoint: PEFT's copy is the head's alone). all-linear adapts the vision and audio towers and their
    # projectors too, which text rows never run: left out, in one line, and the policy is still PEFT's merge of all
    # of it (towers included) run by the whole multimodal model's own forward on the text rows.
    sft = save_adapter(TINY_GEMMA_MM, tmp_path / "sft", rank=4, targets=LANGUAGE_MLP, modules_to_save=["lm_head"],
                       seed=1)
    policy = save_adapter(TINY_GEMMA_MM, tmp_path / "policy", rank=4, targets="all-linear", seed=2)
    keys = list(load_file(policy / "adapter_model.safetensors"))
    language_model = "base_model.model.model.language_model."  # PEFT's prefix, then the full model's names
    assert all(k.startswith(language_model + "layers.") or k == "base_model.model.lm_head.weight"
               for k in load_file(sft / "adapter_model.safetensors"))
    towers = {k.split(".")[3] for k in keys if not k.startswith(language_model)}
    assert towers == {"audio_tower", "embed_audio", "embed_vision", "vision_tower"}, towers  # what is left out
    lines = []
    summary = run(tmp_path, [bare_rollouts(tmp_path)], sft, policy, log=lines.append, prefix_sharing="auto",
                  chunk_rows=5)
    table = pq.read_table(summary.output)
    assert_at_oracle(table, "ref_logprobs", merged(TINY_GEMMA_MM, sft))
    assert_at_oracle(table, "policy_logprobs", merged(TINY_GEMMA_MM, policy))
    assert mean_gap(table) > 0.05
    left_out = [line for line in lines if "towers" in line]
    tower_modules = {k.split(".lora_")[0] for k in keys if k.split(".")[3] in towers}
    assert left_out == [(f"{policy}: {len(tower_modules)} of its modules lie in the multimodal checkpoint's towers and "
                         "projectors (model.audio_tower, model.embed_audio, model.embed_vision, model.vision_tower), "
                         "which text rows never run: left out")], lines
    # An adapter of the towers alone changes no text row: refused, saying so.
    towers_only = save_adapter(TINY_GEMMA_MM, tmp_path / "towers", rank=2, targets=r".*vision_tower.*\.q_proj\.linear")
    with pytest.raises(ModelError, match="holds no LoRA weights but its multimodal checkpoint's towers'"):
        run(tmp_path, [bare_rollouts(tmp_path)], TINY_GEMMA_MM, towers_only, name="towers.parquet")


def test_rslora_and_per_module_rank_and_alpha(tmp_path):
    # rsLoRA scales by alpha / sqrt(r), and rank_pattern / alpha_pattern give some modules their own r and alpha:
    # each a scale that, read wrong, moves the policy's logprobs silently. Held to PEFT's merge of the same folder.
    adapter = save_adapter(TINY_LLAMA, tmp_path / "adapter", rank=4, use_rslora=True,
                           rank_pattern={"q_proj": 2, "down_proj": 8}, alpha_pattern={"v_proj": 3, "up_proj": 32})
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["use_rslora"] and config["rank_pattern"] and config["alpha_pattern"]  # what the case is about
    table = pq.read_table(run(tmp_path, [bare_rollouts(tmp_path)], TINY_LLAMA, adapter, chunk_rows=5).output)
    assert_at_oracle(table, "policy_logprobs", merged(TINY_LLAMA, adapter))
    assert mean_gap(table) > 0.05


def test_adapters_under_dtype_float64(tmp_path):
    # --dtype float64 (model/wide.py): each side's update in fp64 too, an SFT adapter as the reference and a DoRA
    # adapter with a trained head as the policy. The cache holds the fp64 forward of PEFT's fp64 merge of each,
    # rounded to float32 (within 1e-9 of it before rounding: tests/model/test_fp64.py holds the adapters there).
    from tests.matrix import EXACT, fp64_forward

    sft = save_adapter(TINY_LLAMA, tmp_path / "sft", rank=8, targets=MLP, seed=1)
    dora = save_adapter(TINY_LLAMA, tmp_path / "dora", rank=4, dora=True, modules_to_save=["lm_head"], seed=2)
    table = pq.read_table(run(tmp_path, [bare_rollouts(tmp_path)], sft, dora, dtype="float64", prefix_sharing="on",
                              chunk_rows=5).output)
    assert json.loads(table.schema.metadata[b"klpipe"])["dtype"] == "float64"
    rows = [(np.array(r["prompt_ids"]), np.array(r["response_ids"])) for r in table.to_pylist()]
    for column, adapter in (("ref_logprobs", sft), ("policy_logprobs", dora)):
        exact = fp64_forward(merged(TINY_LLAMA, adapter, torch.float64), rows)
        for got, want in zip(table.column(column).to_pylist(), exact, strict=True):
            got = np.array(got, dtype=np.float64)
            assert got.shape == want.shape
            assert np.all(np.abs(got - want) <= np.spacing(np.abs(want).astype(np.float32)) / 2 + EXACT), column
    assert mean_gap(table) > 0.05


# An adapter's update one input column short: its hook, in klpipe/model/lora.py, fails on the load-time probe.
BROKEN_UPDATE = """
import sys
from klpipe.model import lora
update = lora._update
def broken(*args, **kwargs):
    found = update(*args, **kwargs)
    found.down = found.down[:, 1:]
    return found
lora._update = broken
"""


def test_a_failure_in_klpipes_adapter_code_is_a_klpipe_bug(tmp_path):
    # --model ADAPTER: the adapter is on while the probe runs the model's own forward, in fp64 through wide.py's mode
    # too (every torch call's innermost frame). What fails there in klpipe's own code is klpipe's bug (exit 1), never
    # the model's forward failing (exit 2).
    adapter = save_adapter(TINY_LLAMA, tmp_path / "adapter", rank=2)
    output = tmp_path / "out.parquet"
    result = run_python(BROKEN_UPDATE + RUN_KLPIPE, "precompute", "--model", str(adapter), str(bare_rollouts(tmp_path)),
                        "-o", str(output), "--device", "cpu", "--progress", "none", "--dtype", "float64")
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("Error: ") and len(result.stderr.splitlines()) == 1, result.stderr
    assert "klpipe bug: klpipe/model/lora.py fails in LlamaForCausalLM's forward" in result.stderr, result.stderr
    assert "its own forward fails" not in result.stderr
    assert not list(tmp_path.glob("out.parquet*"))


@pytest.mark.slow
def test_dora_and_a_reference_adapter_under_the_policys(tmp_path):
    # --model ADAPTER (an SFT adapter over the base) and --policy a DoRA adapter over the same base: each side with
    # its own adapter on, each at PEFT's merge of it.
    sft = save_adapter(TINY_LLAMA, tmp_path / "sft", rank=8, targets=MLP, seed=1)
    dora = save_adapter(TINY_LLAMA, tmp_path / "dora", rank=4, dora=True, modules_to_save=["lm_head"], seed=2)
    summary = run(tmp_path, [bare_rollouts(tmp_path)], sft, dora, prefix_sharing="auto", chunk_rows=5)
    table = pq.read_table(summary.output)
    assert_at_oracle(table, "ref_logprobs", merged(TINY_LLAMA, sft))
    assert_at_oracle(table, "policy_logprobs", merged(TINY_LLAMA, dora))
    assert mean_gap(table) > 0.05
    # The reference's adapter alone, no policy.
    alone = pq.read_table(run(tmp_path, [bare_rollouts(tmp_path)], sft, None, name="sft.parquet").output)
    assert alone.column("ref_logprobs").to_pylist() == table.column("ref_logprobs").to_pylist()


def test_without_model_the_reference_is_the_base_the_adapter_records(tmp_path):
    adapter = save_adapter(TINY_LLAMA, tmp_path / "adapter", rank=2)
    recorded = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert recorded == str(TINY_LLAMA)
    summary = run(tmp_path, [bare_rollouts(tmp_path)], None, adapter)
    provenance = read_provenance(summary.output)
    assert provenance.model == str(TINY_LLAMA) and provenance.policy_model == str(adapter)


def test_the_adapters_bytes_are_in_the_policys_fingerprint(tmp_path):
    rollouts = bare_rollouts(tmp_path)
    adapter = save_adapter(TINY_LLAMA, tmp_path / "adapter", rank=2)
    summary = run(tmp_path, [rollouts], TINY_LLAMA, adapter)
    first = read_provenance(summary.output).policy_revision
    assert first.startswith(read_provenance(summary.output).revision + " + adapter local:")
    # The same folder, other weights (a later checkpoint saved over it): the cache is another run's, refused.
    save_adapter(TINY_LLAMA, adapter, rank=2, seed=5)
    with pytest.raises(OutputError, match=r"made by a different run .*policy"):
        run(tmp_path, [rollouts], TINY_LLAMA, adapter)
    second = read_provenance(run(tmp_path, [rollouts], TINY_LLAMA, adapter, overwrite=True).output).policy_revision
    assert second != first


def test_an_adapter_for_another_base_is_refused_before_anything_runs(tmp_path, qwen3):
    rollouts = bare_rollouts(tmp_path)
    adapter = save_adapter(TINY_LLAMA, tmp_path / "adapter", rank=2)
    # Recorded on another base than --model: refused by its config, naming both.
    with pytest.raises(ModelError, match=rf"an adapter trained on {TINY_LLAMA} .*not on {qwen3}"):
        run(tmp_path, [rollouts], qwen3, adapter)
    # Shapes that do not fit the base (a Llama with a wider MLP, its record edited to claim the sample Llama): refused
    # by the tensors, before any row runs.
    config = AutoConfig.from_pretrained(TINY_LLAMA)
    config.intermediate_size = 96
    wide_base = tmp_path / "wide-base"
    AutoModelForCausalLM.from_config(config).save_pretrained(wide_base)
    wide = save_adapter(wide_base, tmp_path / "wide", rank=2)
    recorded = json.loads((wide / "adapter_config.json").read_text())
    (wide / "adapter_config.json").write_text(json.dumps({**recorded, "base_model_name_or_path": str(TINY_LLAMA)}))
    with pytest.raises(ModelError, match=r"down_proj's lora_A is \(2, 96\) and lora_B \(64, 2\), for a base layer "
                                         r"of 128 in and 64 out: an adapter for another base model"):
        run(tmp_path, [rollouts], TINY_LLAMA, wide)
    assert not (tmp_path / "out.parquet").exists() and not (tmp_path / "out.parquet.partial").exists()


@pytest.mark.parametrize("field, value, words", [
    ("alora_invocation_tokens", [5, 6], "sets alora_invocation_tokens, which klpipe does not apply"),
    ("fan_in_fan_out", True, "fan_in_fan_out=True"),
    ("peft_type", "IA3", "a IA3 adapter"),
    ("auto_mapping", {"base_model_class": "MyModel"}, "ships its own code .*--trust-remote-code"),
])
def test_what_klpipe_does_not_apply_is_refused(tmp_path, field, value, words):
    adapter = save_adapter(TINY_LLAMA, tmp_path / "adapter", rank=2)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ModelError, match=words):
        run(tmp_path, [bare_rollouts(tmp_path)], TINY_LLAMA, adapter)


@pytest.mark.slow
def test_an_adapter_runs_where_peft_is_not_installed(tmp_path):
    # klpipe reads the folder itself: PEFT (110 MiB of RSS imported) is the tests' oracle, never a dependency.
    adapter = save_adapter(TINY_LLAMA, tmp_path / "adapter", rank=2)
    rollouts = bare_rollouts(tmp_path)
    # Uninstalled as the import system sees it: importlib.util.find_spec says None (transformers asks whether PEFT is
    # available), and an import fails.
    code = "import sys\nsys.modules['peft'] = None\n" + RUN_KLPIPE
    result = run_python(code, "precompute", "-m", str(TINY_LLAMA), "--policy", str(adapter), str(rollouts),
                        "-o", str(tmp_path / "out.parquet"), "--device", "cpu", "--progress", "none")
    assert result.returncode == 0, result.stderr
    assert "peft" not in result.stderr.lower()
    expected = pq.read_table(run(tmp_path, [rollouts], TINY_LLAMA, adapter, name="here.parquet").output)
    assert pq.read_table(tmp_path / "out.parquet").column("policy_logprobs").equals(expected.column("policy_logprobs"))


@pytest.mark.slow
def test_the_mismatch_section_works_with_an_adapter_policy(tmp_path):
    # The rollouts' own policy_logprobs are the sampler's: kept as sampler_logprobs beside the adapter's computed ones.
    adapter = save_adapter(TINY_GEMMA, tmp_path / "adapter", rank=2, targets=["q_proj", "v_proj"], spread=0.01)
    summary = run(tmp_path, [ROLLOUTS], TINY_GEMMA, adapter)
    scored = score(ScoreConfig(inputs=[summary.output], output=tmp_path / "scored.parquet"))
    section = scored.report["mismatch"]
    assert section["trainer_computed_by"] == str(adapter) and section["kl_from"] == "trainer"
    assert_mismatch_figures(section["run"], sampled_logprobs(summary.output))


@pytest.mark.slow
def test_an_adapter_saved_by_trls_own_trainer(tmp_path):
    # TRL's SFTTrainer with peft_config, one optimizer step from PEFT's zero B, saved by its save_model: the folder a
    # LoRA run's checkpoint is (adapter, config, tokenizer), taken as it is.
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's and transformers' deprecation notes about their own defaults
        args = SFTConfig(output_dir=str(tmp_path / "run"), max_steps=1, learning_rate=0.05,
                         per_device_train_batch_size=2, report_to=[], use_cpu=True, bf16=False, logging_steps=1000,
                         save_strategy="no")
        rows = [{"prompt": "The sky is", "completion": " blue today."}] * 4
        trainer = SFTTrainer(model=str(TINY_LLAMA), args=args, train_dataset=Dataset.from_list(rows),
                             peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                    task_type="CAUSAL_LM"))
        trainer.train()
        trainer.save_model(str(tmp_path / "checkpoint"))
    adapter = tmp_path / "checkpoint"
    assert (adapter / "adapter_model.safetensors").is_file() and (adapter / "tokenizer.json").is_file()
    summary = run(tmp_path, [bare_rollouts(tmp_path)], None, adapter, prefix_sharing="on")
    table = pq.read_table(summary.output)
    assert_at_oracle(table, "ref_logprobs", AutoModelForCausalLM.from_pretrained(TINY_LLAMA).eval())
    assert_at_oracle(table, "policy_logprobs", merged(TINY_LLAMA, adapter))
    assert mean_gap(table) > 1e-3


@pytest.mark.compile
@pytest.mark.parametrize("targets", [ATTENTION, ATTENTION + MLP], ids=["attention", "attention-mlp"])
def test_compile_with_an_adapter(tmp_path, targets):
    # --compile on: the MLPs an adapter changes run eager (a hook per side), the others compiled, both sides at their
    # oracles.
    adapter = save_adapter(TINY_LLAMA, tmp_path / "adapter", rank=4, targets=targets, modules_to_save=["lm_head"])
    lines = []
    summary = run(tmp_path, [bare_rollouts(tmp_path)], TINY_LLAMA, adapter, compile="on", prefix_sharing="auto",
                  log=lines.append)
    compiled = next(line for line in lines if "compiled (torch.compile)" in line)
    assert ("LlamaMLP" in compiled) == (targets == ATTENTION), compiled
    table = pq.read_table(summary.output)
    assert_at_oracle(table, "ref_logprobs", AutoModelForCausalLM.from_pretrained(TINY_LLAMA).eval())
    assert_at_oracle(table, "policy_logprobs", merged(TINY_LLAMA, adapter))
    assert mean_gap(table) > 0.05


@pytest.mark.slow
def test_shards_of_an_adapter_run_are_the_whole_run_cut(tmp_path):
    # Two shards (a Slurm array's tasks), each loading the base and the adapter: their parts, in order, are the
    # unsharded cache's rows, both columns bit for bit.
    from klpipe.sharding import Shard

    rollouts = bare_rollouts(tmp_path)
    adapter = save_adapter(TINY_LLAMA, tmp_path / "adapter", rank=4, modules_to_save=["lm_head"])
    whole = pq.read_table(run(tmp_path, [rollouts], TINY_LLAMA, adapter, chunk_rows=4).output)
    parts = [pq.read_table(run(tmp_path, [rollouts], TINY_LLAMA, adapter, name="sharded", chunk_rows=4,
                               shard=Shard(index, 2)).output) for index in range(2)]
    assert sum(part.num_rows for part in parts) == whole.num_rows and all(part.num_rows for part in parts)
    for column in ("ref_logprobs", "policy_logprobs"):
        assert [v for part in parts for v in part.column(column).to_pylist()] == whole.column(column).to_pylist()


def streaming_budget(monkeypatch, adapters) -> int:
    """The smallest budget that streams the tiny Gemma 4 with `adapters` resident (4 bytes an element, as lora.py
    keeps them), this process counted as tests/precompute/test_budget.py counts it."""
    from klpipe import process_memory
    from klpipe.precompute import budget
    from tests.precompute.test_budget import FOOTPRINT, activations, sizes_in_memory

    monkeypatch.setattr(process_memory, "resident", lambda: FOOTPRINT)
    weights, resident, largest = sizes_in_memory(TINY_GEMMA)
    held = sum(4 * tensor.numel() for adapter in adapters
               for tensor in load_file(adapter / "adapter_model.safetensors").values())
    streams = FOOTPRINT + budget.GROWTH + resident + held + 2 * largest + activations(TINY_GEMMA, 256)
    assert streams < FOOTPRINT + budget.GROWTH + weights + held + activations(TINY_GEMMA, 256)
    return streams


@pytest.mark.parametrize("case", ["lora-policy", pytest.param("dora-policy-sft-reference", marks=pytest.mark.slow)])
def test_adapters_over_a_streamed_base_give_the_in_memory_run(tmp_path, monkeypatch, case):
    # The base's decoder layers stream from their files under a budget too small for its weights; the adapters stay
    # resident and hook each layer's Linears as it computes. Both columns equal the same adapters over the base in
    # memory (1e-5) and PEFT's merge of them.
    if case == "lora-policy":
        reference, policy = TINY_GEMMA, save_adapter(TINY_GEMMA, tmp_path / "lora", rank=4)
    else:  # a DoRA policy (its norm needs each base layer once, at load) under an SFT adapter as the reference
        reference = save_adapter(TINY_GEMMA, tmp_path / "sft", rank=8, targets=MLP, seed=1)
        policy = save_adapter(TINY_GEMMA, tmp_path / "dora", rank=4, dora=True, modules_to_save=["lm_head"], seed=2)
    streams = streaming_budget(monkeypatch, [a for a in (reference, policy) if a is not TINY_GEMMA])
    rows, lines = bare_rollouts(tmp_path), []
    # The tree's cache as small as the smallest budget leaves a streamed run (none), in both runs: the same plan.
    streamed = run(tmp_path, [rows], reference, policy, name="streamed.parquet", log=lines.append,
                   max_memory=str(streams), max_tokens_per_batch=256, chunk_rows=5, max_cache_mib=0)
    assert any("its decoder layers stream from their files" in line for line in lines), lines
    assert any("its weights and adapters (" in line for line in lines), lines  # the bytes it names count both
    assert streamed.streamed["groups"] >= 1
    in_memory = run(tmp_path, [rows], reference, policy, name="memory.parquet", max_tokens_per_batch=256, chunk_rows=5,
                    max_cache_mib=0)
    got, expected = pq.read_table(streamed.output), pq.read_table(in_memory.output)
    for column in ("ref_logprobs", "policy_logprobs"):
        gap = max(float(np.max(np.abs(np.array(a) - np.array(b))))
                  for a, b in zip(got.column(column).to_pylist(), expected.column(column).to_pylist(), strict=True)
                  if a)
        assert gap <= 1e-5, f"{column}: streamed differs from in memory by {gap:.3g}"
    base = TINY_GEMMA if case == "lora-policy" else reference
    assert_at_oracle(got, "policy_logprobs", merged(TINY_GEMMA, policy))
    if base is not TINY_GEMMA:
        assert_at_oracle(got, "ref_logprobs", merged(TINY_GEMMA, reference))
    assert mean_gap(got) > 0.05  # the policy's adapter moved the logprobs


def test_modules_to_save_inside_a_streamed_layer_is_refused_in_one_line(tmp_path, monkeypatch):
    adapter = save_adapter(TINY_GEMMA, tmp_path / "adapter", rank=2, targets=ATTENTION, modules_to_save=["down_proj"])
    streams = streaming_budget(monkeypatch, [adapter])
    with pytest.raises(ModelError) as caught:
        run(tmp_path, [bare_rollouts(tmp_path)], TINY_GEMMA, adapter, max_cache_mib=0, max_tokens_per_batch=256,
            max_memory=str(streams))
    assert "inside a decoder layer that streams from its files" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_modules_to_save_replacing_a_table_read_row_by_row_is_refused_in_one_line(tmp_path, monkeypatch):
    # The tiny Gemma 4's head is untied: streamed, its input embeddings are read from the file row by row, and the
    # adapter's replacement would be read by nothing. (Its head, read by blocks too, applies an adapter's replacement
    # where it is active: test_adapters_over_a_streamed_base_give_the_in_memory_run's sft-reference case.)
    adapter = save_adapter(TINY_GEMMA, tmp_path / "adapter", rank=2, targets=ATTENTION,
                           modules_to_save=["embed_tokens"])
    streams = streaming_budget(monkeypatch, [adapter])
    with pytest.raises(ModelError) as caught:
        run(tmp_path, [bare_rollouts(tmp_path)], TINY_GEMMA, adapter, max_cache_mib=0, max_tokens_per_batch=256,
            max_memory=str(streams))
    said = str(caught.value)
    assert "replaces model.embed_tokens.weight, read from its file by rows as each forward needs them" in said
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_only_a_dora_norm_reads_a_streamed_base_layer_at_load(tmp_path, dora):
    # A plain update needs nothing of the base weight (its device is where the layers load to); DoRA's per-row norm
    # needs each adapted Linear's weight once. The streamed layers are read for that alone.
    from klpipe.model import ModelSpec, lora, streamed_load

    adapter = save_adapter(TINY_GEMMA, tmp_path / "adapter", rank=2, targets=["q_proj"], dora=dora)
    model, device, _, streamer, _ = streamed_load.load(ModelSpec(str(TINY_GEMMA), dtype="float32", device="cpu"))
    store, asked = streamer.store, []

    def weight_of(module_path, module):
        asked.append(store.layer_of(module_path))
        streamer.ensure(asked[-1])
        return module.weight

    config = json.loads((adapter / "adapter_config.json").read_text())
    attached = lora.attach(model, (("policy", str(adapter), config),), None, weight_of, device)
    streamer.release_all()
    layers = list(range(len(store.layers)))
    assert asked == (layers if dora else [])
    assert streamer.layer_reads == (len(layers) if dora else 0)
    update = attached.adapters["policy"].updates[f"{store.layers_path}.0.self_attn.q_proj"]
    assert update.down.device == torch.device("cpu") and (update.dora is not None) == dora


def test_a_dora_norm_waits_for_its_layer_half_read_in_the_background(tmp_path, monkeypatch):
    # While attach computes each layer's DoRA norm, the next layer is read in the background. A layer half read, its
    # first tensors in and the adapted Linear's still on meta, looks loaded to a check of its first tensor: the norm
    # must wait for the read, not take the meta weight. The reader is held half way through each layer's first read,
    # and attach goes on only once it is there, so the half-read layer is met every time.
    import re
    import threading
    import time

    from transformers import core_model_loading

    from klpipe.model import ModelSpec, ReferenceModel
    from klpipe.model.layer_major import LayerMajor

    adapter = save_adapter(TINY_GEMMA, tmp_path / "dora", rank=2, targets=["down_proj"], dora=True)
    real_load, real_ensure = core_model_loading.convert_and_load_state_dict_in_model, LayerMajor.ensure
    half: dict[int, threading.Event] = {}

    def event(k: int) -> threading.Event:
        return half.setdefault(k, threading.Event())

    def load_in_halves(model, tensors, *args, **kwargs):
        if not threading.current_thread().name.startswith("klpipe-layer-read"):
            return real_load(model, tensors, *args, **kwargs)
        real_load(model, {k: v for k, v in tensors.items() if "down_proj" not in k}, *args, **kwargs)
        event(int(re.search(r"layers\.(\d+)\.", next(iter(tensors))).group(1))).set()
        time.sleep(0.3)  # the adapted Linear's weight still on meta meanwhile
        return real_load(model, {k: v for k, v in tensors.items() if "down_proj" in k}, *args, **kwargs)

    def ensure(self, k: int) -> None:
        real_ensure(self, k)
        if k + 1 < len(self.store.layers) and not event(k + 1).is_set():  # its first read: wait till half way
            assert event(k + 1).wait(10)

    monkeypatch.setattr(core_model_loading, "convert_and_load_state_dict_in_model", load_in_halves)
    monkeypatch.setattr(LayerMajor, "ensure", ensure)
    config = json.loads((adapter / "adapter_config.json").read_text())
    model = ReferenceModel.load(ModelSpec(str(TINY_GEMMA), dtype="float32", device="cpu"),
                                adapters=(("policy", str(adapter), config),), streamed=True)
    layers = len(model.streamer.store.layers)
    assert layers > 2 and sorted(half) == list(range(1, layers))  # every layer but the first was met half read
    assert model.adapters.adapters["policy"].updates  # attached, and held to the model's own forward at load
