"""A model whose decoder layers' weights stay in their safetensors files, one layer materialised at a time.

The model is built on the meta device and loaded by transformers' own loader, as `from_pretrained` loads it (the same
key renamings, conversions and dtype plan); what differs is only which keys it is handed, and when:

    at load      every key outside the decoder layers: resident for the run
    per forward  the rows a forward needs of an embedding table it only gathers from (table_rows.py); an untied
                 head, a block of rows at a time as it is applied (streamed_head.py)
    per layer    layer k's keys, read from the files when the layer is asked for (tensor_files.py), converted into
                 the layer's parameters; `release(k)` puts the meta parameters back, so its tensors are freed

Nothing else of the model changes: its modules, its forward and its attention are transformers' own (layer_major.py
runs them). docs/precompute.md, "How a streamed model runs", says more.
"""

from __future__ import annotations

import copy
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from klpipe.errors import ModelError
from klpipe.model import streamed_head, table_rows
from klpipe.model.tensor_files import Buffers, TensorFiles


@dataclass
class Sizes:
    """What the streamed model holds, in bytes at the run's dtype (the budget's inputs: precompute/budget.py)."""

    weights: int  # every parameter
    resident: int  # those outside the decoder layers and the tables, kept for the run
    layers: list[int] = field(default_factory=list)  # each decoder layer's
    tables: int = 0  # left in their files, read by rows: embedding tables (table_rows.py), the head (streamed_head.py)

    @property
    def largest_layer(self) -> int:
        return max(self.layers, default=0)


def decoder_layers(body) -> tuple[str, torch.nn.ModuleList]:
    """(its name in the body, the ModuleList) of the body's decoder layers: the ModuleList child holding the most
    parameters (`layers` in every family klpipe runs)."""
    lists = [(name, child) for name, child in body.named_children() if isinstance(child, torch.nn.ModuleList)]
    if not lists:
        raise ModelError(f"{type(body).__name__}: no list of decoder layers to stream")
    return max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()))


def meta_model(causal_class, config, dtype: torch.dtype):
    """`causal_class` built from `config` as from_pretrained builds it (its init contexts: meta device, `dtype`),
    no weight allocated."""
    from transformers.utils.generic import ContextManagers

    config = copy.deepcopy(config)
    with ContextManagers(causal_class.get_init_context(dtype, False, False, None)):
        model = causal_class(config)
    return model


class WeightStore:
    """The checkpoint's tensors, read where they lie (tensor_files.py), loaded into a meta-built model part by part."""

    def __init__(self, model, directory: Path, dtype: torch.dtype, key_mapping: dict | None = None,
                 skipped: frozenset = frozenset(), device: str = "cpu"):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.modeling_utils import LoadStateDictConfig

        from klpipe.model.architecture import decoder_body, module_path

        self.model = model
        self.dtype = dtype
        # Where the model computes. On CPU a layer's parameters are views of the buffer it was read into; on a GPU
        # they are copies of it on the device, each made with a blocking copy (_load_planned, and the loader).
        self.device = torch.device(device)
        body = decoder_body(model)
        name, self.layers = decoder_layers(body)
        prefix = module_path(model, body)
        self.layers_path = f"{prefix}.{name}" if prefix else name
        mapping = get_model_conversion_mapping(model, key_mapping, None)
        # transformers hands its loader this very list too: its field's type names the two kinds, not their base.
        self.load_config = LoadStateDictConfig(dtype=dtype, dtype_plan=model._get_dtype_plan(dtype),
                                               weight_mapping=mapping,  # type: ignore[arg-type]
                                               device_map={"": str(self.device)})
        self._files = TensorFiles(weight_files(directory))  # read a tensor at a time; closed with the store
        # The layer that computes and the one read behind it; on a GPU, pinned: the staging its copies read from.
        self._buffers = Buffers(2, pinned=self.device.type == "cuda")
        entries = {key: entry for key, entry in self._files.entries.items() if key not in skipped}
        self._layer_key = re.compile(re.escape(self.layers_path) + r"\.(\d+)\.")
        self.parts: dict[int | None, dict] = {None: {}}  # None: resident; k: layer k's checkpoint tensors (Entry)
        self._sources: dict[str, str] = {}  # model key -> the checkpoint key it is only a renaming of
        self._plans: dict[int, list] = {}  # layer -> how its later loads go without the loader (_plan)
        self._split(entries, mapping)
        self._lock = threading.Lock()  # a layer loads in the background while another computes
        # The byte count alone: a pass's table read must not wait for the layer read the other lock is held across.
        self._counting = threading.Lock()
        self.reads = 0  # bytes read from the checkpoint since load, tables' rows included
        self.reads_total = 0  # the same, never reset nor left out (what a run read before its first row)
        self._meta: list[list] = [[] for _ in self.layers]
        tables, head = self._left_in_files(entries)
        self._load(None)
        self._finish({*tables, *([head[0]] if head is not None else [])})
        self.head: streamed_head.HeadRows | None = None
        if head is not None:
            path, source = head
            module = model.get_submodule(path)
            dtype = table_rows.dtype_of(f"{path}.weight", module.weight, self.load_config.dtype_plan)
            self.head = streamed_head.HeadRows(self._files, source, path, module, dtype, self._count, self.device)
        inputs = model.get_input_embeddings()
        self.tables = [table_rows.TableRows(self._files, source, path, module, table_rows.dtype_of(
            f"{path}.weight", module.weight, self.load_config.dtype_plan), self._count, resting=module is inputs,
            device=self.device) for path, (source, module) in tables.items()]
        self._meta = self._released()
        self.sizes = self._sizes()

    def _split(self, entries: dict, mapping: list) -> None:
        """Each checkpoint key's part (`parts`) by transformers' own renaming, in the order its loader renames them (a
        guarded renaming applies only after its guard key); the keys checked against the model's (_check_keys)."""
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

        model = self.model
        meta = model.state_dict()
        renamings = [copy.deepcopy(m) for m in mapping if isinstance(m, WeightRenaming)]
        converters = [copy.deepcopy(m) for m in mapping if isinstance(m, WeightConverter)]
        targets: set[str] = set()  # every model key some checkpoint key loads (a split's every part)
        unexpected: set[str] = set()
        by_pattern = {source: c for c in converters for source in c.source_patterns}
        for key in sorted(entries, key=dot_natural_key):
            renamed, source = rename_source_key(key, renamings, converters, model.base_model_prefix, meta)
            if renamed not in meta and key in meta:  # as the loader does: a key already the model's stays it
                renamed, source = rename_source_key(key, [], [], model.base_model_prefix, meta)
            self.parts.setdefault(self.layer_of(renamed), {})[key] = entries[key]
            if source is None:  # renamed only (no converter): the fast path may load it (_plan)
                self._sources[renamed] = key
                parts = {renamed}
            else:
                patterns = by_pattern[source].target_patterns
                parts = {renamed.replace(patterns[0], p) if p else renamed for p in patterns}
            targets |= parts & meta.keys()
            unexpected |= parts - meta.keys()
        # A tensor several names share is loaded under any one of them; a tied one (Zamba's shared block, a tied
        # head) is tied once loaded, as from_pretrained ties it.
        tensors = {key: id(t) for key, t in model.state_dict(keep_vars=True).items()}
        loaded = {tensors[key] for key in targets}
        tied = set(table_rows.ties(model))
        self._check_keys(unexpected, {k for k in meta if k.startswith(self.layers_path + ".")
                                      and tensors[k] not in loaded and k not in tied})

    def _left_in_files(self, entries: dict) -> tuple[dict[str, tuple[str, torch.nn.Embedding]], tuple[str, str] | None]:
        """What stays in the files besides the layers, taken out of the resident part: (path -> (checkpoint key,
        module) of each table a forward reads rows of, (path, checkpoint key) of the head or None)."""
        model = self.model
        # Embedding tables outside the layers that a forward only gathers rows of (Gemma's per-layer embeddings)
        # stay in their files too: each forward reads the rows it needs (table_rows.py).
        tables: dict[str, tuple[str, torch.nn.Embedding]] = {}
        head_source = None
        # So does an untied LM head, read a block of rows at a time as it is applied (streamed_head.py).
        head = streamed_head.streamable(model, self.layers)
        if head is not None and not streamed_head.stored_as_is(head, entries):
            head = None  # converted at load: resident, as the budget counted it (streamed_load.measure)
        found = table_rows.streamable(model, self.layers)
        for path, module in [*found.items(), *([(head, model.get_submodule(head))] if head else [])]:
            source = self._sources.get(f"{path}.weight")
            if source is None or source not in self.parts[None]:
                raise ModelError(f"{type(model).__name__}: {path} is converted at load, which streaming its rows "
                                 "does not run yet")
            # Read by rows, never through the loader, which would check its shape.
            shape, expected = self.parts[None][source].shape, tuple(module.weight.shape)
            if shape != expected:
                raise ModelError(f"{source} is {shape} in the checkpoint, and the model's {path} {expected}: the "
                                 "checkpoint does not match the model class")
            del self.parts[None][source]
            if path == head:
                head_source = source
            else:
                tables[path] = (source, module)
        return tables, None if head is None or head_source is None else (head, head_source)

    def _released(self) -> list[list]:
        """What each layer gets back on release, (module, name, is a buffer, meta tensor): its parameters and the
        buffers its checkpoint holds; the non-persistent ones (Falcon-H1's mup_vector) were made by _finish."""
        released = [[(module, n, n in module._buffers, t) for module in layer.modules()
                     for n, t in [*module._parameters.items(), *module._buffers.items()]
                     if t is not None and t.is_meta] for layer in self.layers]
        held = [key for meta in released for key in {id(t) for _, _, _, t in meta}]
        # A block whose weights several depths share (Zamba's) would be freed under another depth.
        if len(held) != len(set(held)):
            raise ModelError(f"{type(self.model).__name__}: decoder layers share weights, which streaming does not "
                             "run yet")
        return released

    def _check_keys(self, unexpected: set, missing: set) -> None:
        """The checkpoint's keys against the model's, before any tensor is read: what from_pretrained would refuse
        (by its own rules: legacy RoPE keys left unread), refused now rather than at a layer's first forward."""
        from types import SimpleNamespace

        info = SimpleNamespace(missing_keys=set(missing), unexpected_keys=set(unexpected))
        self.model._adjust_missing_and_unexpected_keys(info)
        for label, keys in (("missing", info.missing_keys), ("unexpected", info.unexpected_keys)):
            if keys:
                shown = ", ".join(sorted(keys)[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
                raise ModelError(f"{type(self.model).__name__}: {len(keys)} {label} keys loading it streamed "
                                 f"({shown}); the checkpoint does not match the model class, refusing to run with "
                                 "random weights")

    def _load(self, part: int | None, buffers: Buffers | None = None) -> None:
        """Part `part`'s checkpoint tensors into the model (transformers' own loader, or, for a layer loaded before,
        its plan), refusing what does not fit; a layer's read into `buffers`, by default the two kept for layers."""
        from transformers.core_model_loading import convert_and_load_state_dict_in_model

        entries = self.parts.get(part, {})
        buffers = buffers or self._buffers
        if part in self._plans:
            self._load_planned(part, entries, buffers)
            return
        # A layer's tensors go into one of the two buffers kept for layers (tensor_files.Buffers); the resident
        # part, read once, into memory of its own.
        tensors = ({key: self._files.read(key) for key in entries} if part is None
                   else self._files.read_together(entries, buffers))
        info, _ = convert_and_load_state_dict_in_model(self.model, tensors, self.load_config)
        self.model._adjust_missing_and_unexpected_keys(info)  # the keys from_pretrained knows to leave (legacy RoPE)
        wrong = sorted(info.unexpected_keys | info.mismatched_keys)
        if wrong or info.conversion_errors:
            shown = ", ".join(wrong[:3]) or next(iter(info.conversion_errors))
            raise ModelError(f"{type(self.model).__name__}: the checkpoint does not match the model class ({shown}); "
                             "refusing to run with random weights")
        if part is not None:
            missing = [f"{self.layers_path}.{part}.{n}" for module, n, _, t in self._meta[part]
                       if _current(module, n).is_meta]
            if missing:
                raise ModelError(f"{type(self.model).__name__}: {len(missing)} missing keys loading layer {part} "
                                 f"({', '.join(missing[:3])}); refusing to run with random weights")
            self.layers[part].requires_grad_(False)
            plan = self._plan(part, tensors)
            if plan is not None:
                self._plans[part] = plan
        del tensors  # the model's parameters hold what they need (the same buffer, or a converted copy)
        self._count(sum(entry.nbytes for entry in entries.values()))

    def _plan(self, part: int, tensors: dict) -> list | None:
        """How layer `part` loads again without transformers' loader, which rebuilds the whole model's key sets and a
        thread pool for every call (36 ms a layer against 9 ms for its read, measured on the 2.5 GiB Llama of
        benchmarks/bench_stream.py): each parameter's checkpoint key and dtype, where the loader only renamed it and
        maybe cast it. Held to what the loader made just now: each parameter contiguous and equal, bit for bit, to
        its checkpoint tensor cast to its dtype; a layer with anything else (fused experts, split or fused
        projections, a tensor made or reshaped) has no plan and goes through the loader every time."""
        layer = self.layers[part]
        names = {id(module): name for name, module in layer.named_modules()}
        plan = []
        for module, name, is_buffer, _ in self._meta[part]:
            now = _current(module, name)
            path = ".".join(p for p in (self.layers_path, str(part), names[id(module)], name) if p)
            read = tensors.get(self._sources.get(path))
            if (read is None or read.shape != now.shape or not now.is_contiguous()
                    or type(now) is not (torch.Tensor if is_buffer else torch.nn.Parameter)
                    or not torch.equal(read.to(now.device, now.dtype), now)):
                return None
            plan.append((module, name, is_buffer, self._sources[path], now.dtype))
        return plan

    def _load_planned(self, part: int, entries: dict, buffers: Buffers) -> None:
        """Layer `part` loaded by its plan (_plan): each tensor read, cast to its parameter's dtype where the loader
        cast it, and put in its module as the loader puts it."""
        tensors = self._files.read_together(entries, buffers)
        for module, name, is_buffer, key, dtype in self._plans[part]:
            # Blocking (non_blocking=False): the copy is over before the buffer can be read into again. On CPU at the
            # same dtype, the buffer's own view.
            value = tensors[key].to(self.device, dtype)
            if is_buffer:
                module._buffers[name] = value
            else:
                value = torch.nn.Parameter(value, requires_grad=False)
                # As transformers' loader marks what it loaded: an attribute of its own, which torch does not declare.
                value._is_hf_initialized = True  # type: ignore[attr-defined]
                module._parameters[name] = value
        self._count(sum(entry.nbytes for entry in entries.values()))

    def _finish(self, tables: set[str]) -> None:
        """What from_pretrained does once the weights are in: the non-persistent buffers made and initialised (RoPE's
        frequencies, computed from the config), the tied weights tied. The layers' parameters and the `tables` (their
        paths; the head's too) left in their files stay on meta, where initialising them costs nothing."""
        model = self.model
        model._move_missing_keys_from_meta_to_device(set(), {"": str(self.device)}, None, None)
        model._initialize_missing_keys(False)
        model.tie_weights(recompute_mapping=False)
        model.eval()
        model.requires_grad_(False)
        resident = [n for n, t in [*model.named_parameters(), *model.named_buffers()]
                    if t.is_meta and not n.startswith(self.layers_path + ".")
                    and n.removesuffix(".weight") not in tables]
        if resident:
            raise ModelError(f"{type(model).__name__}: {len(resident)} missing keys loading it streamed "
                             f"({', '.join(resident[:3])}); refusing to run with random weights")

    def _sizes(self) -> Sizes:
        layers = [sum(t.numel() * t.element_size() for _, _, _, t in meta) for meta in self._meta]  # meta: as loaded
        resident = sum(t.numel() * t.element_size() for t in {id(t): t for t in
                                                             [*self.model.parameters(), *self.model.buffers()]
                                                             if not t.is_meta
                                                             and not isinstance(t, table_rows.Resting)}.values())
        left: list[table_rows.TableRows | streamed_head.HeadRows] = [*self.tables, *([self.head] if self.head else [])]
        tables = sum(t.meta.numel() * t.dtype.itemsize for t in left)
        return Sizes(weights=resident + sum(layers) + tables, resident=resident, layers=layers, tables=tables)

    def _count(self, nbytes: int) -> None:
        """`nbytes` more read (a table's rows, in a pass's thread while a layer may load in the background)."""
        with self._counting:
            self.reads += nbytes
            self.reads_total += nbytes

    def load(self, k: int, own: bool = False) -> None:
        """Layer k's tensors into the model, read from the files now; `own`: into memory of its own, not one of the
        two buffers kept for layers (a layer kept loaded from group to group: layer_major.py)."""
        with self._lock:  # on a GPU a layer is a copy on the device whatever it was read into: the kept buffers do
            self._load(k, Buffers(0) if own and self.device.type == "cpu" else None)

    def layer_of(self, path: str) -> int | None:
        """The decoder layer that `path` (a module's or a tensor's, as the model names them) lies in; None: outside
        the layers, resident."""
        found = self._layer_key.match(path + ".")
        return int(found.group(1)) if found is not None else None

    def loaded(self, k: int) -> bool:
        return bool(self._meta[k]) and not _current(self._meta[k][0][0], self._meta[k][0][1]).is_meta

    def release(self, k: int) -> None:
        """Layer k's meta tensors back: its loaded ones are freed once no pass holds them."""
        with self._lock:
            for module, name, is_buffer, tensor in self._meta[k]:
                (module._buffers if is_buffer else module._parameters)[name] = tensor

    def close(self) -> None:
        self._files.close()


def weight_files(directory: Path) -> list[Path]:
    """The checkpoint's safetensors files as from_pretrained picks them: the index's shards, else model.safetensors;
    never a repository's other copies (Mistral's consolidated.safetensors holds the same weights under other names)."""
    import json

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return [directory / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if (directory / "model.safetensors").is_file():
        return [directory / "model.safetensors"]
    raise ModelError(f"{directory}: no model.safetensors (or its index) to stream")


def _current(module, name: str):
    return module._buffers[name] if name in module._buffers else module._parameters[name]
