"""An embedding table of a streamed model left in its file: each forward reads only the rows its ids name.

Gemma 4 E2B looks up, besides its token embeddings, a per-layer embedding for every token (`embed_tokens_per_layer`,
262,144 x 35 x 256): 2.3B of its 5.0B parameters, 4.7 GB in bf16, of which a pass of 4,096 tokens reads at most 4,096
rows (73 MB). A streamed model (streaming.py) keeps such a table in its safetensors file: before the table's own
forward, the distinct ids of its input are read (tensor_files.read_rows: one positioned read per run of consecutive
ids), cast as transformers' loader casts the whole table, and stand in as the table; the ids are renumbered into it.
The module's own forward then runs as in memory (its scale, Gemma's `embed_scale`, included), over the rows it would
have gathered: `table[ids]` equals `rows[inverse]`, bit for bit, where `rows = table[unique(ids)]`. After the forward
the meta weight is put back, and the rows are freed.

Which tables: an `nn.Embedding` outside the decoder layers that is not the model's input embeddings (their device is
the input's: reference.py and probes.py read it) and whose weight nothing else shares (a tied head reads every row),
of a class whose forward is `nn.Embedding`'s own or Gemma's scaled one (`super().forward(ids) * scale`): a subclass
that computes its ids inside its forward (OPT's learned positions) would be handed the wrong ones. Its checkpoint
tensor must be one the loader only renames (no conversion), else the run is refused in one line.

A streamed group's passes take turns only at decoder layers (streaming.py), so a table stands in for one forward
at a time.
"""

from __future__ import annotations

import torch

from klpipe.errors import ModelError


def _gathers(module: torch.nn.Module) -> bool:
    """Whether `module`'s forward is an embedding lookup of its first argument, maybe scaled (see the docstring)."""
    forward = type(module).forward
    return isinstance(module, torch.nn.Embedding) and module.max_norm is None and (
        forward is torch.nn.Embedding.forward or type(module).__name__.endswith("ScaledWordEmbedding"))


def streamable(model: torch.nn.Module, layers: torch.nn.ModuleList) -> dict[str, torch.nn.Embedding]:
    """path -> module: the tables of `model` a streamed run leaves in their files (see the docstring); read off the
    model as built (meta), before any weight is."""
    inside = {id(m) for m in layers.modules()}
    shared = {id(model.get_input_embeddings().weight)}
    head = model.get_output_embeddings()
    if head is not None:
        shared.add(id(head.weight))
    counts: dict[int, int] = {}
    for _, parameter in model.named_parameters(remove_duplicate=False):
        counts[id(parameter)] = counts.get(id(parameter), 0) + 1
    # What from_pretrained will tie (the meta-built model is not tied yet): a table on either side is not its own.
    mapping = getattr(model, "all_tied_weights_keys", None) or {}
    tied = set(mapping) | set(mapping.values()) if isinstance(mapping, dict) else set(mapping)
    return {path: module for path, module in model.named_modules()
            if id(module) not in inside and _gathers(module) and module.weight.ndim == 2
            and id(module.weight) not in shared and counts.get(id(module.weight)) == 1
            and f"{path}.weight" not in tied}


class TableRows:
    """Table `module` (at `path`) read row by row from checkpoint tensor `key` of `files`, as `dtype`: hooks that
    stand the rows a forward needs in for its weight, and put the meta weight back after; `count(nbytes)` is told
    what each forward read."""

    def __init__(self, files, key: str, path: str, module: torch.nn.Embedding, dtype: torch.dtype, count=None):
        entry = files.entries[key]
        if entry.shape != tuple(module.weight.shape):
            raise ModelError(f"{key} is {entry.shape} in the checkpoint, and the model's {path} "
                             f"{tuple(module.weight.shape)}: the checkpoint does not match the model class")
        self.files, self.key, self.path, self.dtype = files, key, path, dtype
        self.meta = module.weight
        self.count = count or (lambda nbytes: None)  # told the bytes each forward reads
        module.register_forward_pre_hook(self._before)
        module.register_forward_hook(self._after)

    def _before(self, module, args):
        ids = args[0]
        unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)  # (n,), ids.shape
        rows = self.files.read_rows(self.key, unique.tolist())  # (n, width) in the file's dtype
        self.count(rows.numel() * rows.element_size())
        module._parameters["weight"] = rows.to(self.dtype).to(ids.device)
        return (inverse, *args[1:])

    def _after(self, module, args, output):
        module._parameters["weight"] = self.meta


def dtype_of(key: str, meta: torch.Tensor, dtype_plan: dict) -> torch.dtype:
    """The dtype transformers' loader gives model key `key` (core_model_loading: the dtype plan's pattern it matches,
    `_keep_in_fp32_modules`, else the meta parameter's)."""
    if dtype_plan:
        from transformers.core_model_loading import build_glob_alternation

        alternation, by_group, _ = build_glob_alternation(list(dtype_plan))
        found = alternation.search(key)
        if found is not None:
            return dtype_plan[by_group[found.lastgroup]]
    return meta.dtype
