"""An untied LM head of a streamed model left in its file: read in blocks of vocabulary rows as it is applied.

A forward applies the head once, after the last layer, so no block of rows need outlive its matmul: the model's own
forward (nn.Linear's) gets the blocks' logits side by side, klpipe's chunked head (head.LMHead) reads the blocks in
vocabulary order, each in the fused head's own blocks, so both compute as the head in memory does. Between forwards
the weight is a `Resting` stand-in (table_rows.py). docs/precompute.md, "How a streamed model runs" (the untied head),
says which heads stream and what the read costs.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from klpipe.model.table_rows import Resting, tied_names

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Bytes of the head's weight read at once: a 32 MiB block is 2,048 rows of 70B's (8,192 x bf16), 8,192 of a hidden of
# 1,024 in fp32. Large enough that a read costs one positioned read of whole megabytes, small beside a layer.
BLOCK_BYTES = 32 << 20


def streamable(model: PreTrainedModel, layers: torch.nn.ModuleList) -> str | None:
    """The path of `model`'s head if a streamed run leaves it in its file (docs/precompute.md), else None; read off the
    model as built (meta), before any weight is."""
    head = model.get_output_embeddings()
    if type(head).forward is not torch.nn.Linear.forward or any(m is head for m in layers.modules()):
        return None
    if head.weight is model.get_input_embeddings().weight or head.weight.ndim != 2:
        return None
    tied = tied_names(model)
    path = next(name for name, module in model.named_modules() if module is head)
    if f"{path}.weight" in tied or sum(1 for _, p in model.named_parameters(remove_duplicate=False)
                                       if p is head.weight) != 1:
        return None
    return path


def stored_as_is(path: str, keys) -> bool:
    """Whether the checkpoint's tensor names `keys` hold the head at `path` under its own name (docs/precompute.md)."""
    return f"{path}.weight" in keys


class HeadRows:
    """Head `module` (at `path`) read in blocks of rows from checkpoint tensor `key` of `files`, as `dtype`; its
    forward replaced by one over the blocks; `count(nbytes)` told what each read; `device`: the model's."""

    def __init__(self, files, key: str, path: str, module: torch.nn.Linear, dtype: torch.dtype, count=None,
                 device="cpu"):
        entry = files.entries[key]  # its shape the model's (WeightStore checked it)
        self.files, self.key, self.path, self.dtype, self.module = files, key, path, dtype, module
        self.vocab, width = entry.shape
        self.count = count or (lambda nbytes: None)
        self.rows = max(1, BLOCK_BYTES // (width * max(entry.dtype.itemsize, dtype.itemsize)))
        self.meta = Resting.like(module.weight, dtype, device, path)
        # A stand-in where torch types a Parameter, and the module's own forward replaced: both on purpose.
        module._parameters["weight"] = self.meta  # type: ignore[assignment]
        module.forward = self.forward  # type: ignore[method-assign,assignment]  # the model's own call, in blocks

    def blocks(self, device, multiple: int = 1) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, block) of the whole weight, in order, each read now and cast as the loader casts the head:
        (rows, H) at the run's dtype; blocks a multiple of `multiple` rows (the fused head's vocabulary blocks)."""
        rows = max(multiple, self.rows // multiple * multiple)
        for low in range(0, self.vocab, rows):
            block = self.files.read_rows(self.key, list(range(low, min(low + rows, self.vocab))))
            self.count(block.numel() * block.element_size())
            yield low, block.to(self.dtype).to(device)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """nn.Linear's forward, a block of the weight at a time: (..., H) -> (..., V); an adapter's head where one
        is active (its modules_to_save, resident: lora.py)."""
        bias = self.module.bias
        if self.module.weight is not self.meta:
            return F.linear(hidden, self.module.weight, bias)
        return torch.cat([F.linear(hidden, block, None if bias is None else bias[low:low + block.shape[0]])
                          for low, block in self.blocks(hidden.device)], dim=-1)
