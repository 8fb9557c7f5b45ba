"""PEFT adapter folders as `--policy` or `--model`: told apart from models, read and checked before any weight loads.

TRL (`GRPOTrainer(peft_config=...)`), Unsloth, verl (`lora_rank`) and OpenRLHF (`--lora_rank`) save a LoRA run's
checkpoints as PEFT folders: `adapter_config.json` and `adapter_model.safetensors`, over a base model the config
records (`base_model_name_or_path`). This module reads the config (json: no torch, no PEFT) and refuses, in one
line, what klpipe does not apply exactly; model/lora.py applies the weights over the base's own. PEFT itself is
never imported: its import alone costs ~110 MiB of RSS (benchmarks/bench_lora.py), about what a rank-16 adapter
saves a 300 MB base over a merged copy; it is the tests' oracle (its merge_and_unload), not a dependency.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypeGuard

from klpipe.errors import ModelError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"  # as model/lora.py reads it (which imports nothing of precompute/)
PICKLED_WEIGHTS = "adapter_model.bin"

# What klpipe applies (model/lora.py), with PEFT's meaning.
APPLIED = {"peft_type", "r", "lora_alpha", "use_rslora", "use_dora", "rank_pattern", "alpha_pattern",
           "modules_to_save", "base_model_name_or_path", "revision", "task_type"}
# What decides how an adapter was made or trained, not what it computes once saved: the saved tensors say it all.
INERT = {"target_modules", "exclude_modules", "layers_to_transform", "layers_pattern", "init_lora_weights",
         "lora_dropout", "inference_mode", "auto_mapping", "peft_version", "loftq_config", "eva_config",
         "corda_config", "lora_ga_config", "megatron_core", "qalora_group_size", "bias", "fan_in_fan_out",
         "lora_bias", "ensure_weight_tying"}
# Fields that must hold these values (PEFT's defaults), or the adapter computes something klpipe does not. Not `bias`:
# its trained biases are tensors in the file, refused there (model/lora.py); a base without biases saves none.
REQUIRED = {"fan_in_fan_out": False, "lora_bias": False, "ensure_weight_tying": False}
MODEL_CONFIG = "config.json"  # what every model folder holds
CAUSAL_TASKS = (None, "CAUSAL_LM")


def is_adapter(name: str | None) -> TypeGuard[str]:
    """Whether `name` is a local PEFT adapter folder (hub adapters: download the folder first)."""
    return name is not None and (Path(name).expanduser() / CONFIG_FILE).is_file()


def refuse_bare_weights(option: str, name: str | None) -> None:
    """Refuse a folder holding an adapter's weights without its config (copied apart, say): no model folder either."""
    root = Path(name).expanduser() if name is not None else None
    if root is not None and (root / WEIGHTS_FILE).is_file() and not any(
            (root / file).is_file() for file in (CONFIG_FILE, MODEL_CONFIG)):
        raise ModelError(f"{option} {name}: holds an adapter's weights ({WEIGHTS_FILE}) without its {CONFIG_FILE}, "
                         "which says its base, rank and scaling; copy it in from where PEFT saved the two together")


def read_config(path: str) -> dict:
    """The adapter's config, checked: a LoRA for a causal LM whose every setting klpipe applies exactly."""
    root = Path(path).expanduser()
    try:
        config = json.loads((root / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path}: cannot read {CONFIG_FILE} ({exc})") from None
    if not isinstance(config, dict):
        raise ModelError(f"{path}: {CONFIG_FILE} holds no adapter config")
    kind = config.get("peft_type")
    if kind != "LORA":
        raise ModelError(f"{path}: a {kind} adapter; klpipe applies LoRA adapters (and DoRA) only")
    if config.get("task_type") not in CAUSAL_TASKS:
        raise ModelError(f"{path}: an adapter for {config['task_type']}, not a causal LM")
    for name, value in REQUIRED.items():
        if config.get(name, value) != value:
            raise ModelError(f"{path}: {name}={config[name]!r}; klpipe applies LoRA adapters with {name}={value!r} "
                             f"only (merge it into the base with PEFT's merge_and_unload and pass the merged model)")
    unknown = sorted(name for name, value in config.items() if name not in APPLIED | INERT and value)
    if unknown:  # aLoRA's invocation tokens, Arrow routing, layer replication, trainable tokens, ...
        raise ModelError(f"{path}: sets {', '.join(unknown)}, which klpipe does not apply (merge it into the base "
                         "with PEFT's merge_and_unload and pass the merged model)")
    if not (root / WEIGHTS_FILE).is_file():
        pickled = (root / PICKLED_WEIGHTS).is_file()
        raise ModelError(f"{path}: no {WEIGHTS_FILE}" + (f" ({PICKLED_WEIGHTS} is pickled: klpipe never unpickles "
                                                          "weights; save the adapter with safe_serialization)"
                                                          if pickled else ""))
    return config


def recorded_base(path: str) -> str | None:
    """The base model the adapter was trained on, as its config records it (None when it records none): a relative
    path (TRL and PEFT record the path as the trainer was given it) found from here, else from the adapter's folder."""
    recorded = read_config(path).get("base_model_name_or_path") or None
    if recorded is None or Path(recorded).expanduser().is_absolute() or Path(recorded).is_dir():
        return recorded
    beside = Path(path).expanduser() / recorded
    return str(beside.resolve()) if beside.is_dir() else recorded


def base_to_load(option: str, path: str) -> str:
    """The base model to load under the adapter at `path` (`option`): its recorded base, which a relative path must
    lead to from here or from the adapter's folder (a hub id is looked up on the hub)."""
    from klpipe.model.loading import is_local  # torch lives behind this import: the base loads next

    base = recorded_base(path)
    if base is None:
        raise ModelError(f"{option} {path}: an adapter that records no base model (base_model_name_or_path in its "
                         f"{CONFIG_FILE})")
    found = Path(base).expanduser()
    if is_local(base) and not found.is_absolute() and not found.is_dir():
        remedy = ("pass the base as --model" if option == "--policy" else
                  f"set base_model_name_or_path in its {CONFIG_FILE} to the base's path")
        raise ModelError(f"{option} {path}: records its base model as {base}, a relative path found neither from "
                         f"here nor from the adapter's folder; {remedy}")
    return base


def check_base(option: str, path: str, base: str, base_fingerprint: str | None, fingerprint_of) -> None:
    """Refuse an adapter recorded as trained on another base than `base` (the reference's weights).

    The recorded base is what the trainer loaded: a local folder (compared by its weights' fingerprint, where it is
    on this machine), or a hub id (compared with a hub `base`, or with a local `base`'s folder name, as a copy of
    `Qwen/Qwen3-4B` is named `Qwen3-4B`). The shapes are checked again against the loaded model (model/lora.py)."""
    recorded = recorded_base(path)
    if recorded is None or recorded == base:
        return
    recorded_path, base_path = Path(recorded).expanduser(), Path(base).expanduser()
    if recorded_path.is_dir() and base_path.is_dir():
        if recorded_path.resolve() == base_path.resolve() or fingerprint_of(str(recorded_path)) == base_fingerprint:
            return
    elif ((not recorded_path.is_absolute() and not base_path.is_dir() and recorded.lower() == base.lower())
          or (base_path.is_dir() and recorded.rstrip("/").split("/")[-1].lower() == base_path.resolve().name.lower())):
        return
    raise ModelError(f"{option} {path}: an adapter trained on {recorded} (its {CONFIG_FILE}), not on {base}; pass "
                     f"its base as --model, or set base_model_name_or_path to {base} if that is a copy of it")
