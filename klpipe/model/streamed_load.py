"""A streamed reference built and sized: its model on the meta device, its decoder layers left in their files
(weight_store.py) and run layer-major (layer_major.py), and what it holds, for the budget (precompute/budget.py).

Nothing here reads a weight before it is asked for: `measure` builds the model from its config alone, so the
budget is decided before anything loads; `reference` loads it streamed and checks it as one in memory is checked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from klpipe.contract import LoadOptions, Streaming
from klpipe.errors import ModelError
from klpipe.model import architecture
from klpipe.model.layer_major import LayerMajor
from klpipe.model.weight_store import WeightStore


def _build(spec):
    """(meta-built model, the text-only plan or None, input device, dtype) of `spec`, as loading.load_model would
    load it, from its config alone (no weight read or fetched)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from klpipe.model import loading
    from klpipe.model.weight_store import meta_model

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    device, device_map = loading.resolve_device(spec.device)
    dtype = loading.resolve_dtype(spec.dtype, device)
    config = loading.load_config(spec)
    plan = architecture.text_only(config)
    causal_class = plan.causal_class if plan is not None else AutoModelForCausalLM._model_mapping[type(config)]
    model = meta_model(causal_class, plan.text_config if plan is not None else config, dtype)
    return model, plan, device if device_map is None else "several devices", dtype


def load(spec, share: Streaming | None = None):
    """(model, input device, dtype, LayerMajor, text-only plan or None): `spec`'s causal LM with its decoder layers
    streamed from its files, the streamer keeping to `share` of the budget (None: no budget). What loading.load_model
    does for the model in memory, checked the same way; refuses what does not stream yet."""
    refused = "--trust-remote-code" if spec.trust_remote_code else None
    if refused is None:
        try:
            model, plan, device, dtype = _build(spec)
        except (OSError, ValueError, KeyError) as exc:
            raise ModelError(f"{spec.name}: cannot build the model to stream ({exc})") from None
        refused = ("several devices" if device == "several devices" else "--dtype float64" if dtype == torch.float64
                   else "a quantized checkpoint" if quantized(model.config) else None)
    if refused is not None:
        raise ModelError(f"{spec.name}: the weights do not fit the memory budget, and streaming them does not run "
                         f"with {refused} yet")
    store = WeightStore(model, weights_directory(spec), dtype, plan.key_mapping if plan is not None else None,
                        frozenset(plan.skipped) if plan is not None else frozenset(), device)
    return model, device, dtype, LayerMajor(store, share), plan


# The LM head's fp32 blocks on CPU (head.py: 1,024 x 4,096 fp32), its running sums and a gathered copy of the hidden
# states, and what torch's allocator keeps around: a fixed allowance per run.
FIXED_ACTIVATIONS = 64 << 20


# What each pass of a group holds beyond its activations while it waits: its greenlet's saved stack (layer_major.py),
# allowed what a pass in a thread of its own holds, on the safe side (its stack, OpenMP team and BLAS packing buffers:
# 11 to 14 MiB measured on 2 CPU cores, hidden 256, MLP 8,192, 512 tokens).
PASS_OVERHEAD = 16 << 20


def activation_bytes(hidden: int, intermediate: int, per_layer_input: int, tokens: int, element: int) -> int:
    """An estimate, on the safe side, of what one pass of `tokens` tokens holds at its widest: the residual stream
    and a layer's output, queries, keys, values and attention output (8 x hidden), the MLP's gate, up and
    activation (3 x intermediate), Gemma's per-layer inputs for every layer, plus the head's fixed blocks."""
    return tokens * element * (8 * hidden + 3 * intermediate + per_layer_input) + FIXED_ACTIVATIONS


def widest_mlp(config, layers: torch.nn.ModuleList) -> int:
    """The widest MLP a decoder layer runs, for activation_bytes: the config's `intermediate_size` (Gemma 3n's is one
    per layer: the largest), or wider where a layer's own Linears are (Gemma 4's double-wide MLPs in its KV-shared
    layers); 4 x hidden where the config names none. Routed experts (3-D parameters) count by the config's."""
    sizes = getattr(config, "intermediate_size", None)
    if isinstance(sizes, (list, tuple)):
        sizes = max(sizes, default=None)
    linears = [max(m.in_features, m.out_features) for m in layers.modules() if isinstance(m, torch.nn.Linear)]
    return max([int(sizes or 4 * int(config.hidden_size))] + linears)


def quantized(config) -> bool:
    """A checkpoint whose tensors need a quantizer to mean anything (fp8 with scales, bitsandbytes, GPTQ): the
    store's plain loader would read them as numbers, wrong ones."""

    return any(getattr(c, "quantization_config", None) for c in (config, architecture.text_config(config)))


@dataclass
class Measure:
    """What the budget compares (precompute/budget.py), in bytes at the run's dtype, read off the meta-built model."""

    weights: int
    resident: int  # outside the decoder layers, but for the tables and the head left in their files
    largest_layer: int
    activations: int  # one pass of `tokens` tokens, at its widest (activation_bytes)
    kept_per_token: int  # what a pass waiting between layers holds per token: the residual stream and its kin


def measure(spec, tokens: int) -> Measure | None:
    """`spec`'s sizes for the budget, without reading a weight (the model is built on the meta device from its
    config); None for a model that cannot be built so (its own code, --trust-remote-code): it loads in memory."""
    from klpipe.model import streamed_head
    from klpipe.model.table_rows import streamable, ties
    from klpipe.model.weight_store import decoder_layers

    if spec.trust_remote_code:
        return None
    try:
        model, _, _, dtype = _build(spec)
        _, layers = decoder_layers(architecture.decoder_body(model))
    except (KeyError, ModelError):  # a class AutoModelForCausalLM does not map, a body without a list of layers
        return None
    if quantized(model.config):  # its sizes are the quantizer's: it loads in memory
        return None
    in_layers = {id(t) for t in [*layers.parameters(), *layers.buffers()]}
    tables = [module.weight for module in streamable(model, layers).values()]  # left in their files, rows read
    head = streamed_head.streamable(model, layers)  # left in its file, read a block at a time as it is applied
    if head is not None and not streamed_head.stored_as_is(head, checkpoint_keys(spec)):
        head = None  # resident, as the store will keep it (or, where the files are not here yet, on the safe side)
    in_files = in_layers | {id(t) for t in tables} | ({id(model.get_submodule(head).weight)} if head else set())
    # A tied head is the input embeddings' weight once loaded; built on meta it is a tensor of its own: not counted.
    tied = ties(model)
    replaced = {id(t) for name, t in model.named_parameters(remove_duplicate=False) if name in tied}
    unique = {id(t): t for t in [*model.parameters(), *model.buffers()] if id(t) not in replaced}
    weights = sum(t.numel() * t.element_size() for t in unique.values())
    resident = sum(t.numel() * t.element_size() for key, t in unique.items() if key not in in_files)
    largest = max((sum(t.numel() * t.element_size() for t in [*layer.parameters(), *layer.buffers()])
                   for layer in layers), default=0)
    config = architecture.text_config(model.config)
    hidden = int(config.hidden_size)
    per_layer = int(getattr(config, "hidden_size_per_layer_input", 0) or 0) * int(config.num_hidden_layers)
    element = torch.empty((), dtype=dtype).element_size()
    intermediate = widest_mlp(config, layers)
    # A table's rows a pass reads stand in for it during its forward: one row a token at most, at the run's dtype.
    rows = tokens * sum(t.shape[1] * t.element_size() for t in tables)
    if head is not None:  # a block as read and as cast, each at most BLOCK_BYTES (streamed_head.py), or the whole head
        rows += 2 * min(streamed_head.BLOCK_BYTES, model.get_submodule(head).weight.numel() * 4)
    return Measure(weights, resident, largest,
                   activation_bytes(hidden, intermediate, per_layer, tokens, element) + rows,
                   element * (4 * hidden + per_layer))


def checkpoint_keys(spec) -> set[str]:
    """The tensor names of a checkpoint's safetensors files, from their headers alone: a local path's, or a hub name's
    where the local Hugging Face cache holds its files (nothing fetched: otherwise none)."""
    from pathlib import Path

    from klpipe.model import loading
    from klpipe.model.tensor_files import TensorFiles
    from klpipe.model.weight_store import weight_files

    if loading.is_local(spec.name):
        directory = Path(spec.name).expanduser()
    else:
        from huggingface_hub import snapshot_download

        try:  # the cache alone: no request, whatever HF_HUB_OFFLINE says
            directory = Path(snapshot_download(spec.name, revision=spec.revision, local_files_only=True,
                                               allow_patterns=["*.json", "model*.safetensors"]))
        except Exception:  # noqa: BLE001 - not cached (or not whole): counted resident, on the safe side
            return set()
    try:
        files = TensorFiles(weight_files(directory))
    except (ModelError, OSError):
        return set()
    try:
        return set(files.entries)
    finally:
        files.close()


def weights_directory(spec):
    """The local directory of `spec`'s safetensors files: its own path, or the hub's snapshot of it."""
    from pathlib import Path

    from klpipe.model import loading

    if loading.is_local(spec.name):
        return Path(spec.name).expanduser()
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(spec.name, revision=spec.revision,
                                      allow_patterns=["*.json", "model*.safetensors"]))
    except Exception as exc:  # noqa: BLE001 - the hub's errors: one line
        raise ModelError(f"{spec.name}: cannot fetch its weights to stream ({exc})") from None


def reference(cls, spec, options: LoadOptions):
    """ReferenceModel.load (`cls`) for a model whose decoder layers stream, its streamer sized by `options.streaming`,
    checked as one in memory is (the oracle, the chunked head, packing, each adapter's side: model/checks.py), before
    any row, or its remembered verdict confirmed (`options.remembered`, as for ReferenceModel.load).

    LoRA adapters hook the layers' Linears as in memory (lora.py): their tensors stay resident (the budget counts
    them: adapter_bytes), the base weights stream under them, and the hooks run as each layer computes. A plain
    update reads nothing of the base at load; a DoRA layer's norm needs its base weight once: each layer is loaded
    for it in turn, then freed."""
    from klpipe.model import lora

    if options.compile == "on":
        raise ModelError(f"{spec.name}: the weights do not fit the memory budget, and streaming them does not run "
                         "with --compile on yet")
    model, device, dtype, streamer, text_only = load(spec, options.streaming)  # its share, before the checks' forwards
    model_ = cls(model, device, dtype, options=options)
    model_.streamer = streamer
    model_.head.streamed = streamer.store.head  # the chunked head reads the head's blocks, where they stream
    if options.adapters:
        store = streamer.store
        ensured = [None]  # the layer ensure() last made whole

        def weight_of(module_path: str, module):
            k = store.layer_of(module_path)
            # Not store.loaded(k): the layer read ahead in the background may be half loaded, its first tensor in and
            # this module's still on meta. ensure() waits for that read first.
            if k is not None and ensured[0] != k:
                streamer.ensure(k)  # this layer loaded, every other freed
                ensured[0] = k
            return module.weight

        try:
            model_.adapters = lora.attach(model, options.adapters, options.default, weight_of, device, text_only)
        finally:
            streamer.release_all()
    model_.run_checks("off", options.remembered)  # --compile on was refused above; auto compiles nothing streamed
    return model_


def adapter_bytes(adapters: tuple) -> int:
    """What LoRA adapters ((name, folder, config)) hold resident beside a streamed base, read off their files'
    headers: every tensor at 4 bytes an element (the updates are kept in fp32, lora.py), nothing read but that."""
    from pathlib import Path

    from klpipe.model.lora import WEIGHTS_FILE
    from klpipe.model.tensor_files import TensorFiles

    total = 0
    for _, path, _ in adapters:
        files = TensorFiles([Path(path).expanduser() / WEIGHTS_FILE])
        try:
            total += sum(4 * max(entry.nbytes // entry.dtype.itemsize, 1) for entry in files.entries.values())
        finally:
            files.close()
    return total
