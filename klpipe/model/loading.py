"""Loading the reference model safely: the device and dtype, the config, tokenizer and weights, their fingerprints.

Safetensors only, no `trust_remote_code` unless asked, a local path never sent to the hub, and a
checkpoint whose weights do not fit its class refused rather than filled with random values.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from klpipe.errors import InputError, ModelError, first_line
from klpipe.model import architecture
from klpipe.storage.fingerprint import file_digest

# float64: fp64 all the way through (wide.py), for holding a path to an fp64 forward; CPU speed, no fast kernels.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}

# The transformers versions klpipe's KV-cache continuation and Gemma 4 handling are tested with:
# 5.24 renamed `past_key_values` to `cache` and is the first with Gemma 4's KV-shared layer skipping
# and the cache's mask-size API as klpipe calls them. pyproject.toml's `precompute` extra says the same
# (tests/test_install.py holds the two together).
TRANSFORMERS_SUPPORTED = (">=5.24", "<6")


@dataclass
class ModelSpec:
    name: str  # hub id or local directory
    revision: str | None = None
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    trust_remote_code: bool = False


def is_local(name: str) -> bool:
    """A name that can only be a filesystem path: never sent to the hub."""
    return (
        os.path.exists(name)
        or name.startswith((".", "/", "~"))
        or os.sep in name.strip("/").replace("/", "", 1)  # hub ids have exactly one slash
        or "\\" in name
    )


def resolve_device(device: str) -> tuple[str, str | dict | None]:
    """(device for inputs, device_map for from_pretrained)."""
    device = local_device(device)
    if device == "auto":
        if not torch.cuda.is_available():
            return "cpu", None
        if torch.cuda.device_count() > 1:
            # Several GPUs and one process: spread the model (for models larger than one GPU).
            if importlib.util.find_spec("accelerate") is None:
                raise ModelError("--device auto over several GPUs needs the accelerate package "
                                 "(pip install accelerate)")
            return "cuda:0", "auto"
        return "cuda:0", None
    if device == "cpu":
        return "cpu", None
    if device == "cuda" or device.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ModelError(f"--device {device} asked for, but torch sees no CUDA device")
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise ModelError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) visible")
        return f"cuda:{index}", None
    raise ModelError(f"--device must be auto, cpu, cuda or cuda:N, not {device!r}")


def local_device(device: str, env: Mapping[str, str] | None = None) -> str:
    """Under torchrun each rank takes its own GPU: `auto` becomes cuda:LOCAL_RANK."""
    env = os.environ if env is None else env
    if device == "auto" and "LOCAL_RANK" in env and torch.cuda.is_available():
        raw = env["LOCAL_RANK"]
        try:
            return f"cuda:{int(raw)}"
        except ValueError:
            raise InputError(f"environment variable LOCAL_RANK={raw!r} is not an integer") from None
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        if device.startswith("cuda") and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if dtype not in DTYPES:
        raise ModelError(f"--dtype must be auto, float32, bfloat16, float16 or float64, not {dtype!r}")
    if dtype == "float16" and device == "cpu":
        # CPU float16 matmuls fall back to scalar code: orders of magnitude slower than bfloat16.
        raise ModelError("--dtype float16 on CPU is extremely slow; use bfloat16 or float32")
    return DTYPES[dtype]


def load_tokenizer(spec: ModelSpec):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(spec.name, **_source_kwargs(spec))
    except (OSError, ValueError) as exc:
        raise _load_error(spec, "the tokenizer", exc) from None


def stop_token_ids(spec: ModelSpec) -> list[int]:
    """The ids the model's generation_config.eos_token_id lists (none without a generation_config): a trainer's
    generate stops a turn on any of them, as on the tokenizer's EOS."""
    from transformers import GenerationConfig

    try:
        ids = GenerationConfig.from_pretrained(spec.name, **_source_kwargs(spec)).eos_token_id
    except OSError:  # no generation_config.json
        return []
    except ValueError as exc:
        raise _load_error(spec, "the generation config", exc) from None
    return [] if ids is None else [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]


def check_transformers_version(version: str | None = None) -> None:
    """Refuse a transformers outside TRANSFORMERS_SUPPORTED: its cache internals may differ silently."""
    from packaging.specifiers import SpecifierSet

    if version is None:
        import transformers

        version = transformers.__version__
    wanted = ",".join(TRANSFORMERS_SUPPORTED)
    if version not in SpecifierSet(wanted, prereleases=True):
        raise ModelError(f"klpipe precompute is tested with transformers {wanted} and found {version}; "
                         f"pip install 'transformers{wanted}'")


def load_config(spec: ModelSpec):
    """The model config alone: cheap, so inputs are validated before gigabytes of weights load."""
    from transformers import AutoConfig

    check_transformers_version()
    _check_exists(spec)
    try:
        config = AutoConfig.from_pretrained(spec.name, **_source_kwargs(spec))
    except (OSError, ValueError) as exc:
        raise _load_error(spec, "the model config", exc) from None
    _check_weights_readable(spec)
    return config


def _check_weights_readable(spec: ModelSpec) -> None:
    """A local checkpoint's safetensors headers, read now (bytes, not tensors): a truncated or corrupt file, or an
    unknown dtype, is one line naming the file before any row is read, not a crash after the rows are checked."""
    if not is_local(spec.name):
        return
    from safetensors import safe_open

    for path in sorted(Path(spec.name).expanduser().glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="numpy") as weights:
                weights.keys()
        except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError: the file cannot be read as weights
            raise ModelError(f"{path}: cannot read the weights ({first_line(exc)})") from None


def vocab_and_context(config) -> tuple[int, int | None]:
    text = architecture.text_config(config)
    return int(text.vocab_size), getattr(text, "max_position_embeddings", None)


def tokenizer_fingerprint(tokenizer, chat_template: bool = False, chat_options: dict | None = None) -> str:
    """sha256 over everything that decides token ids: vocabulary, merges, normalisation, special tokens,
    and, with `chat_template` (conversational rollouts, which it renders), the chat template and
    `chat_options` (the tools given to every row, the template's keyword arguments)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        payload = backend.to_str()
    else:
        payload = json.dumps(sorted(tokenizer.get_vocab().items()))
    payload += json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str)
    if chat_template:
        payload += json.dumps(getattr(tokenizer, "chat_template", None), sort_keys=True)
        if chat_options and any(chat_options.values()):  # none given: the fingerprint of a cache made without them
            payload += json.dumps(chat_options, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


# The files of a local checkpoint that decide its numbers: config, weights, and model code (which
# runs only with --trust-remote-code). Tokenizer files have their own fingerprint.
WEIGHT_FILES = ("*.json", "*.safetensors", "*.py")


def weights_fingerprint(spec: ModelSpec, config) -> str | None:
    """The commit hash for hub models; for a local directory, `local:` and a hash of every byte of its
    config, weight and code files (storage/fingerprint.py remembers each file's digest on this machine)."""
    commit = getattr(config, "_commit_hash", None)
    if not is_local(spec.name):
        return commit or spec.revision
    root = Path(spec.name).expanduser()
    digest = hashlib.sha256()
    for path in sorted({p for pattern in WEIGHT_FILES for p in root.glob(pattern) if p.is_file()}):
        digest.update(f"{path.name}:{file_digest(path)}\n".encode())
    return "local:" + digest.hexdigest()[:16]


def load_model(spec: ModelSpec):
    """(model, input device, dtype, text-only plan or None): the causal LM of `spec` in eval mode, gradients off, on
    its device.

    A multimodal checkpoint (the hub's Gemma 4: `...ForConditionalGeneration` with a `text_config`)
    loads as its text decoder and head alone (see `text_only`, the plan returned: an adapter saved over
    the full model is renamed by it too, lora.py): the vision and audio towers are never read, and the
    text model's own forward (Gemma 4's skips its KV-shared layers for positions nobody needs) is the
    one that runs.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    # Our own progress and summary lines are the log; transformers' bars would garble cron logs,
    # and its load report would repeat, in twenty lines, the one-line error we raise below.
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()

    device, device_map = resolve_device(spec.device)
    dtype = resolve_dtype(spec.dtype, device)
    _check_exists(spec)
    common = dict(dtype=dtype, device_map=device_map, output_loading_info=True,
                  use_safetensors=True,  # never unpickle .bin weights
                  **_source_kwargs(spec))
    try:
        config = AutoConfig.from_pretrained(spec.name, **_source_kwargs(spec))
        plan = architecture.text_only(config)
        if plan is None:
            # output_loading_info=True: (model, info), where the stub says the model alone.
            model, info = AutoModelForCausalLM.from_pretrained(spec.name, config=config, **common)  # type: ignore[misc]
        else:
            causal_class: Any = plan.causal_class  # a transformers model class (architecture.text_only)
            model, info = causal_class.from_pretrained(spec.name, config=plan.text_config,
                                                       key_mapping=plan.key_mapping, **common)
            # The towers' weights match no parameter of the text model: left unread on purpose.
            info["unexpected_keys"] = set(info.get("unexpected_keys") or ()) - plan.skipped
    except (OSError, ValueError, KeyError) as exc:
        raise _load_error(spec, "the model", exc) from None
    _check_loading_info(spec.name, type(model).__name__, info)
    if device_map is None:
        model.to(device)
    if dtype == torch.float64:
        model.to(torch.float64)  # the parameters and buffers a model keeps in fp32 too: fp64 all the way (wide.py)
        if model._can_set_experts_implementation():
            model.set_experts_implementation("eager")  # the grouped-matmul expert kernels take no fp64
    model.eval()
    model.requires_grad_(False)
    read_in(model)
    return model, device, dtype, plan


@torch.no_grad()
def read_in(model) -> None:
    """Every weight a forward reads whole in the process's memory now. On CPU, from_pretrained maps the safetensors
    files and a tensor's pages are read in when first touched: by the first forward (the load-time checks'), which
    would then take the load's time. One element a page touched is a page read in, and nothing computed. Embedding
    tables a forward only gathers rows of (Gemma's per-layer table, 2.7 GB of E2B's 6 GB in fp32) are left as they
    are, unless the head reads them whole."""
    head = model.get_output_embeddings()
    gathered = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    gathered.discard(id(head.weight) if head is not None else None)
    for tensor in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values():
        if (tensor.device.type == "cpu" and tensor.numel() and tensor.is_contiguous()
                and id(tensor) not in gathered):
            tensor.view(-1)[:: max(1, 4096 // tensor.element_size())].sum()


# transformers' own words when a hybrid layer's kernel package is missing (integrations/hub_kernels.py).
_FALLBACK = re.compile(r"falling back to its reference PyTorch implementation because `([^`]+)` is not installed")


@contextmanager
def kernel_fallbacks():
    """Within the block, the packages transformers says it runs its slow reference code without
    (flash-linear-attention, causal-conv1d, mamba-ssm), collected in order from its own warnings,
    which load_model otherwise keeps out of the log. transformers says so once per process, at a
    layer's first forward."""
    found: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            match = _FALLBACK.search(record.getMessage())
            if match and match.group(1) not in found:
                found.append(match.group(1))

    logger = logging.getLogger("transformers")
    saved = logger.level, [(handler, handler.level) for handler in logger.handlers]
    for handler, level in saved[1]:  # what reached the log before still does; nothing more
        handler.setLevel(max(level, logger.getEffectiveLevel()))
    collect = Collect(logging.WARNING)
    logger.addHandler(collect)
    logger.setLevel(min(logger.getEffectiveLevel(), logging.WARNING))
    try:
        yield found
    finally:
        logger.removeHandler(collect)
        logger.setLevel(saved[0])
        for handler, level in saved[1]:
            handler.setLevel(level)


def _check_exists(spec: ModelSpec) -> None:
    if is_local(spec.name) and not Path(spec.name).expanduser().is_dir():
        raise ModelError(f"{spec.name}: model directory does not exist")


def _source_kwargs(spec: ModelSpec) -> dict:
    kwargs: dict[str, bool | str] = {"trust_remote_code": spec.trust_remote_code}
    if is_local(spec.name):
        kwargs["local_files_only"] = True  # a local path never touches the network
    elif spec.revision:
        kwargs["revision"] = spec.revision
    return kwargs


def _check_loading_info(name: str, cls: str, info: dict) -> None:
    """Refuse weights that do not fit the class: transformers would fill the gaps with random values."""
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        keys = sorted(str(k) for k in info.get(kind) or [])
        if keys:
            shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
            label = kind.replace("_", " ")
            raise ModelError(
                f"{name}: {len(keys)} {label} loading it as {cls} ({shown}); "
                "the checkpoint does not match the model class, refusing to run with random weights"
            )


def _load_error(spec: ModelSpec, what: str, exc: BaseException) -> ModelError:
    text = str(exc)
    if "trust_remote_code" in text or "custom code" in text:
        return ModelError(f"{spec.name}: the checkpoint ships its own model code; "
                          "klpipe runs it only with --trust-remote-code")
    return ModelError(f"{spec.name}: cannot load {what} ({first_line(exc)})")
