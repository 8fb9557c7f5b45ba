"""An embedding table of a streamed model left in its file: each forward reads only the rows its ids name.

Before the table's own forward, the distinct ids of its input are read (tensor_files.read_rows), cast as
transformers' loader casts the whole table, and stand in as the table, the ids renumbered into it: the module's own
forward then gives `table[ids]` bit for bit. After the forward the meta weight is put back and the rows are freed;
the input embeddings, whose device and dtype a model's code reads outside their forward, hold a `Resting` weight
instead (their shape, dtype and device, and an error for anything that would read their values).
docs/precompute.md, "How a streamed model runs" (embedding tables), says which tables qualify and why.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from klpipe.errors import ModelError

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _gathers(module: torch.nn.Module) -> bool:
    """Whether `module`'s forward is an embedding lookup of its first argument, maybe scaled (docs/precompute.md)."""
    forward = type(module).forward
    return isinstance(module, torch.nn.Embedding) and module.max_norm is None and (
        forward is torch.nn.Embedding.forward or type(module).__name__.endswith("ScaledWordEmbedding"))


def streamable(model: PreTrainedModel, layers: torch.nn.ModuleList) -> dict[str, torch.nn.Embedding]:
    """path -> module: the tables of `model` a streamed run leaves in their files (docs/precompute.md); read off the
    model as built (meta), before any weight is."""
    inside = {id(m) for m in layers.modules()}
    head = model.get_output_embeddings()
    shared = {id(head.weight)} if head is not None else set()
    counts: dict[int, int] = {}
    for _, parameter in model.named_parameters(remove_duplicate=False):
        counts[id(parameter)] = counts.get(id(parameter), 0) + 1
    # What from_pretrained will tie (the meta-built model is not tied yet): a table on either side is not its own.
    tied = tied_names(model)
    return {path: module for path, module in model.named_modules()
            if id(module) not in inside and _gathers(module) and module.weight.ndim == 2
            and id(module.weight) not in shared and counts.get(id(module.weight)) == 1
            and f"{path}.weight" not in tied}


def ties(model: torch.nn.Module) -> dict[str, str | None]:
    """What from_pretrained ties once the weights are in: each tied parameter's name -> the name of the one it becomes
    (None where the model lists its tied names alone, as older classes do). Built on meta, a model is not tied yet."""
    mapping = getattr(model, "all_tied_weights_keys", None) or {}
    return dict(mapping) if isinstance(mapping, dict) else dict.fromkeys(mapping)


def tied_names(model: torch.nn.Module) -> set[str]:
    """Every name on either side of a tie (ties): a tensor that is not the named module's alone."""
    tied = ties(model)
    return set(tied) | {source for source in tied.values() if source}


class Resting(torch.Tensor):
    """The weight of a table between forwards: its shape, dtype and device, held in one element; reading anything
    else of it (its values, a view, a copy) raises, so that no code outside the table's forward computes on it."""

    _metadata = None  # what may be read of it: filled on first use (torch's descriptors)
    path = "a table"  # the module whose weight it stands in for, as the model names it: what the refusal says

    @staticmethod
    def like(meta: torch.Tensor, dtype: torch.dtype, device, path: str) -> Resting:
        resting = torch.zeros((), dtype=dtype, device=device).expand(meta.shape).as_subclass(Resting)
        resting.path = path
        return resting

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls.metadata():
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        path = next((a.path for a in args if isinstance(a, Resting)), cls.path)
        if func is torch.Tensor.detach:  # a state_dict (transformers' loader takes the model's): another stand-in
            with torch._C.DisableTorchFunctionSubclass():
                detached = func(*args, **(kwargs or {})).as_subclass(Resting)
            detached.path = path
            return detached
        raise ModelError(f"{path}'s weight, left in its file, was read outside its forward "
                         f"({getattr(func, '__name__', func)}); streaming it does not run with this model yet")

    @classmethod
    def metadata(cls) -> set:
        if cls._metadata is None:
            t = torch.Tensor
            cls._metadata = {*(_getter(name) for name in ("device", "dtype", "shape", "ndim", "is_meta",
                                                          "requires_grad", "is_cuda")),
                             t.size, t.dim, t.numel, t.element_size, t.is_floating_point, t.__repr__}
        return cls._metadata


def _getter(name: str):
    """What torch hands __torch_function__ for reading tensor attribute `name` (its descriptor's __get__)."""
    return getattr(torch.Tensor, name).__get__


class TableRows:
    """Table `module` (at `path`) read row by row from checkpoint tensor `key` of `files`, as `dtype`: hooks that
    stand the rows a forward needs in for its weight, and put the meta weight back after; `count(nbytes)` is told
    what each forward read; `resting`: between forwards the weight is a Resting stand-in rather than the meta one, on
    `device` (the model's)."""

    def __init__(self, files, key: str, path: str, module: torch.nn.Embedding, dtype: torch.dtype, count=None,
                 resting: bool = False, device="cpu"):
        self.files, self.key, self.path, self.dtype = files, key, path, dtype
        self.meta = module.weight
        if resting:  # the input embeddings: a model's code reads their device and dtype outside a forward
            self.meta = Resting.like(module.weight, dtype, device, path)
            module._parameters["weight"] = self.meta  # type: ignore[assignment]  # a stand-in, on purpose
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
            assert found.lastgroup is not None, "every branch of the alternation is a named group"
            return dtype_plan[by_group[found.lastgroup]]
    return meta.dtype
