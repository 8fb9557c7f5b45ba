"""LoRA adapters over the model's own weights, switched per side: one copy of the base weights for both.

TRL computes the reference's logprobs by turning the policy's adapter off on the same model (`disable_adapter()`);
klpipe does the same, with the side as the switch. Each adapted `nn.Linear` keeps its module and weight and gets a
forward hook that, while its adapter is the active one, adds PEFT's update to the base output:

    LoRA   y = W x + b + s · B (A x)                                  s = alpha / r (alpha / √r with use_rslora)
    DoRA   y = W x + b + (f − 1) · W x + f · s · B (A x)              f = m / ‖W + s·B A‖ per output row

which is PEFT's `lora.Linear.forward` in eval (no dropout), the update in the adapter's fp32 as PEFT's
`autocast_adapter_dtype` keeps it (fp64 in an fp64 model: wide.py's fp64 all the way through), and f computed once
(the base weights are frozen). `modules_to_save` (a trained copy of a module, the LM head most often) is the
adapter's tensors swapped in as the module's parameters while its side is active: parameter objects exchanged, no
arithmetic, so switching back gives the base exactly.

An adapter saved over a multimodal checkpoint (PEFT over the hub's Gemma4ForConditionalGeneration) names the full
model's modules: its keys are renamed to the text model's as the checkpoint's are (architecture.TextOnly), and what
it holds for the vision and audio towers, which text rows never run, is left out, noted.

The hooks fire wherever the module runs: rows run whole, packed, the prefix tree's passes. The tree's caches live
for one `run_plan` (model/attention/tree.py), run under one side, so no side ever reads the other's keys and values.
"""

from __future__ import annotations

import math
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from klpipe.errors import ModelError
from klpipe.model.table_rows import Resting

if TYPE_CHECKING:
    from transformers import PreTrainedModel

WEIGHTS_FILE = "adapter_model.safetensors"  # PEFT's, in the folder: never its pickled adapter_model.bin
PREFIX = "base_model.model."  # PEFT's key prefix: the PeftModel's own path to the base model
LORA_KEYS = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A\.weight|lora_B\.weight|lora_magnitude_vector(\.weight)?)$")


@dataclass
class LoraUpdate:
    """One adapter's update of one Linear."""

    down: torch.Tensor  # A: (r, in), fp32 (fp64 in an fp64 model)
    up: torch.Tensor  # B: (out, r), as A
    scaling: float
    dora: torch.Tensor | None = None  # f = m / ‖W + s·B A‖ per output row: (out,), as A; None for LoRA


@dataclass
class Adapter:
    """One adapter, as its tensors: updates per Linear, and modules_to_save's replacements."""

    name: str
    path: str
    updates: dict[str, LoraUpdate] = field(default_factory=dict)  # module path -> update
    saved: dict[str, dict[str, torch.nn.Parameter]] = field(default_factory=dict)  # module path -> name -> tensor
    towers: set[str] = field(default_factory=set)  # the multimodal checkpoint's tower modules it adapts or saves


class Adapters:
    """The adapters over one model, and which is active (None: the base alone, as `disable_adapter()`)."""

    def __init__(self, model: PreTrainedModel, default: str | None = None):
        self.model = model
        self.adapters: dict[str, Adapter] = {}
        self.active: str | None = None
        self.default = default  # the side forwards run under outside `use` (the reference's)
        self._base: dict[str, dict[str, torch.nn.Parameter]] = {}  # modules_to_save: the base's own parameters
        self._hooked: dict[str, torch.utils.hooks.RemovableHandle] = {}
        self.notes: list[str] = []  # one log line for each adapter whose towers' modules were left out

    @property
    def module_paths(self) -> set[str]:
        """Every module an adapter changes (compiled.py leaves them eager: a hook or a swap per side)."""
        return {path for adapter in self.adapters.values() for path in (*adapter.updates, *adapter.saved)}

    def add(self, name: str, path: str, config: dict, weight_of=None, device=None, text_only=None) -> None:
        """Read the adapter at `path` (its config already checked: precompute/adapters.py) and hook it in, inactive
        until `activate` (or `use`) names it.

        A streamed model's Linears hold meta weights between forwards (streamed_load.py): `device` is where they
        compute, and `weight_of(module_path, module)` gives an adapted Linear's base weight loaded, which only a DoRA
        layer's norm reads (streamed_load.py loads its layer). By default, each Linear's own weight and its device.
        `text_only`: the plan the model was loaded by from a multimodal checkpoint (architecture.TextOnly), or None."""
        adapter = read(name, path, config, self.model, weight_of, device, text_only)
        self.adapters[name] = adapter
        if adapter.towers:
            self.notes.append(f"{path}: {len(adapter.towers)} of its modules lie in the multimodal checkpoint's "
                              f"towers and projectors ({', '.join(sorted(text_only.towers))}), which text rows never "
                              "run: left out")
        modules = dict(self.model.named_modules())
        for module_path in adapter.updates:
            if module_path not in self._hooked:
                self._hooked[module_path] = modules[module_path].register_forward_hook(self._hook(module_path))
        for module_path, tensors in adapter.saved.items():
            base = self._base.setdefault(module_path, {})
            for key in tensors:
                base.setdefault(key, getattr(modules[module_path], key))

    def _hook(self, module_path: str):
        def hook(module, args, output):  # output: (..., out)
            adapter = self.adapters.get(self.active) if self.active is not None else None
            update = adapter.updates.get(module_path) if adapter is not None else None
            if update is None:
                return output
            x = args[0].to(update.down.dtype)  # (..., in)
            delta = (x @ update.down.T) @ update.up.T  # (..., out), in the adapter's fp32
            delta.mul_(update.scaling)  # in place, as the adds below: the update's temporaries are the policy's peak
            if update.dora is not None:  # f·s·B A x + (f − 1)·W x, W x the output less its bias
                base = output.to(delta.dtype) if module.bias is None else output.to(delta.dtype) - module.bias
                delta = update.dora * delta + (update.dora - 1) * base
            if output.dtype == delta.dtype:
                return output.add_(delta)  # a fresh tensor of the Linear's, read by nothing else yet
            return delta.add_(output).to(output.dtype)  # rounded once, as PEFT's (output + update).to(dtype)
        return hook

    def activate(self, name: str | None) -> None:
        """Make `name` the active adapter (None: none), modules_to_save's tensors swapped in or back."""
        if name is not None and name not in self.adapters:
            raise KeyError(name)
        modules = dict(self.model.named_modules())
        saved = self.adapters[name].saved if name is not None else {}
        for module_path, base in self._base.items():
            own = saved.get(module_path, {})
            for key, parameter in base.items():
                # Into the parameters' dict: a streamed head's own weight is a Resting stand-in, not a Parameter.
                modules[module_path]._parameters[key] = own.get(key, parameter)
        self.active = name

    @contextmanager
    def use(self, name: str | None):
        """Forwards within run with adapter `name` active; the default side again after."""
        self.activate(name)
        try:
            yield
        finally:
            self.activate(self.default)


def attach(model: PreTrainedModel, adapters: tuple, default: str | None, weight_of=None, device=None,
           text_only=None) -> Adapters:
    """`adapters` ((name, folder, checked config)) hooked into `model`, `default` active; LoRA on the LM head refused
    (the chunked head reads the head's weight, not its forward: the update would be lost). `weight_of`, `device`,
    `text_only`: as Adapters.add's."""
    attached = Adapters(model, default)
    for name, path, config in adapters:
        attached.add(name, path, config, weight_of, device, text_only)
    attached.activate(default)
    head = model.get_output_embeddings()
    adapted_head = [a.path for a in attached.adapters.values()
                    if any(model.get_submodule(p) is head for p in a.updates)]
    if adapted_head:
        raise ModelError(f"{adapted_head[0]}: LoRA on the LM head, which klpipe does not apply (merge it with PEFT's "
                         "merge_and_unload, or train the head as modules_to_save)")
    return attached


def read(name: str, path: str, config: dict, model: PreTrainedModel, weight_of=None, device=None,
         text_only=None) -> Adapter:
    """The adapter's tensors, checked against the model: every key a Linear's update or a module's replacement of
    the shape the model's module has; anything else refused (an adapter on the embeddings, a layer the model lacks).
    Keys in a multimodal checkpoint's names are the text model's by `text_only`'s renaming, its towers' left out.
    `weight_of`, `device`, `text_only`: as Adapters.add's."""
    from safetensors import safe_open

    adapter = Adapter(name, path)
    modules = dict(model.named_modules())
    dtype = next(model.parameters()).dtype
    update_dtype = torch.promote_types(dtype, torch.float32)  # fp32 as PEFT keeps updates, fp64 in an fp64 model
    parts: dict[str, dict[str, torch.Tensor]] = {}
    to_save = tuple(config.get("modules_to_save") or ())
    file = Path(path).expanduser() / WEIGHTS_FILE
    try:
        with safe_open(str(file), framework="pt") as weights:
            tensors = {key: weights.get_tensor(key) for key in weights.keys()}  # noqa: SIM118 - safe_open has no __iter__
    except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError: not readable as weights
        raise ModelError(f"{file}: cannot read the adapter's weights ({exc})") from None
    for key, tensor in tensors.items():
        local = key.removeprefix(PREFIX)
        if text_only is not None and text_only.outside(local):  # a tower's, or its projector's
            match = LORA_KEYS.match(local)
            adapter.towers.add(match["module"] if match is not None else local.rpartition(".")[0])
            continue
        local = text_only.text_key(local) if text_only is not None else local
        match = LORA_KEYS.match(local)
        if match is not None:
            parts.setdefault(match["module"], {})[match["part"].split(".")[0]] = tensor
            continue
        module_path, _, attribute = local.rpartition(".")
        if any(module_path == m or module_path.endswith("." + m) for m in to_save) and module_path in modules:
            current = getattr(modules[module_path], attribute, None)
            # A streamed layer's (meta) or a table read row by row (Resting): the store swaps it, not the adapter. A
            # head read by blocks (streamed_head.py) applies whichever weight is in place: the adapter's, where active.
            head = modules[module_path] is model.get_output_embeddings()
            if isinstance(current, torch.Tensor) and (current.is_meta or (isinstance(current, Resting) and not head)):
                where = ("read from its file by rows as each forward needs them" if isinstance(current, Resting)
                         else "inside a decoder layer that streams from its files")
                raise ModelError(f"{path}: modules_to_save replaces {module_path}.{attribute}, {where}, which klpipe "
                                 "does not run yet (merge the adapter with PEFT's merge_and_unload and pass the "
                                 "merged model)")
            if not isinstance(current, torch.nn.Parameter | Resting) or current.shape != tensor.shape:
                raise ModelError(f"{path}: {key} is {tuple(tensor.shape)}, and the base's {module_path}.{attribute} "
                                 f"{_shape(current)}: an adapter for another base model")
            replacement = torch.nn.Parameter(tensor.to(dtype=dtype, device=current.device), requires_grad=False)
            adapter.saved.setdefault(module_path, {})[attribute] = replacement
            continue
        what = f"a trained bias (bias={config.get('bias')!r}), which" if attribute == "bias" else "which"
        raise ModelError(f"{path}: holds {key}, {what} klpipe does not apply (LoRA on Linear layers and "
                         "modules_to_save only; merge it with PEFT's merge_and_unload and pass the merged model)")
    for module_path, found in sorted(parts.items()):
        adapter.updates[module_path] = _update(path, module_path, found, config, modules.get(module_path),
                                               weight_of or (lambda _, module: module.weight), device,
                                               update_dtype)
    if not adapter.updates and not adapter.saved:
        towers = " but its multimodal checkpoint's towers' and projectors', which text rows never run"
        raise ModelError(f"{path}: holds no LoRA weights" + (towers if adapter.towers else ""))
    return adapter


def _update(path: str, module_path: str, found: dict, config: dict, module, weight_of, device,
            dtype: torch.dtype) -> LoraUpdate:
    if not isinstance(module, torch.nn.Linear):
        what = "no such module" if module is None else type(module).__name__
        raise ModelError(f"{path}: adapts {module_path}, which in the base model is {what}: an adapter for another "
                         "base model (klpipe applies LoRA to Linear layers)")
    if "lora_A" not in found or "lora_B" not in found:
        raise ModelError(f"{path}: {module_path} has {' and '.join(sorted(found))} only; an update needs lora_A and "
                         "lora_B")
    down, up = found["lora_A"].to(dtype), found["lora_B"].to(dtype)  # (r, in), (out, r)
    rank = down.shape[0]
    if down.ndim != 2 or up.ndim != 2 or down.shape[1] != module.in_features or up.shape != (module.out_features, rank):
        raise ModelError(f"{path}: {module_path}'s lora_A is {tuple(down.shape)} and lora_B {tuple(up.shape)}, for a "
                         f"base layer of {module.in_features} in and {module.out_features} out: an adapter for "
                         "another base model")
    alpha = _pattern(config.get("alpha_pattern") or {}, module_path, config.get("lora_alpha", 8))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    # Where the hook's inputs come: the Linear's own weight's device, or, while a streamed layer's is on meta, the
    # device its layers load to (a plain update needs nothing else of the base: no layer is read for it).
    device = module.weight.device if not module.weight.is_meta else torch.device(device)
    down, up = down.to(device), up.to(device)
    dora = None
    if config.get("use_dora"):
        magnitude = found.get("lora_magnitude_vector")
        if magnitude is None or magnitude.shape != (module.out_features,):
            raise ModelError(f"{path}: {module_path} is a DoRA layer without its magnitude vector of "
                             f"{module.out_features}")
        weight = weight_of(module_path, module)  # loaded
        with torch.no_grad():  # ‖W + s·B A‖ per output row, once: (out,)
            norm = torch.linalg.vector_norm(weight.to(dtype) + scaling * (up @ down), dim=1)
        dora = magnitude.to(dtype=dtype, device=device) / norm
    elif "lora_magnitude_vector" in found:
        raise ModelError(f"{path}: {module_path} holds a DoRA magnitude vector and its config says use_dora false")
    return LoraUpdate(down, up, float(scaling), dora)


def _pattern(patterns: dict, module_path: str, default):
    """PEFT's rank/alpha pattern lookup (peft.utils.other.get_pattern_key): the first key the path ends with."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module_path):
            return value
    return default


def _shape(parameter) -> str:
    return "is missing" if parameter is None else f"is {tuple(parameter.shape)}"
