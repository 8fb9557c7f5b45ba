"""Host syncs per batch: what would stop the host until the GPU catches up, counted during one batch's forward and
head on CPU (the goal is at most one: the head's logprobs coming back).

On CUDA these wait for the device: `.item()` and anything that reads a tensor's value on the host
(`aten._local_scalar_dense`: `bool(t)`, `int(t)`, `float(t)`), ops whose output shape depends on values
(`nonzero`, `masked_select`, `unique`), and copying a tensor the device computed to the host (`.cpu()`,
`.numpy()`, `.tolist()`). On CPU nothing waits, so the counter tracks which tensors the ops computed (they would
live on the device) and counts reads of those on the host; tensors made on the host (torch.from_numpy) are not.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from klpipe.model import ModelSpec, ReferenceModel
from klpipe.model.attention import packing
from klpipe.precompute.logprobs import plan_chunk, run_plan
from tests.helpers import TINY_GEMMA, TINY_LLAMA, agent_rows

VALUE_READS = {"_local_scalar_dense", "nonzero", "masked_select", "unique_dim", "_unique2", "_unique", "equal",
               "is_nonzero"}

HOST_MADE = {"lift_fresh", "lift_fresh_copy", "lift"}  # torch.tensor / torch.from_numpy under a mode: the host's


def _by_transformers() -> str:
    """" (transformers)" where transformers' own code asked for the value, else "".

    The innermost frame in either package decides, by the packages' own folders: a checkout's path may hold
    either name (a clone in a folder named after klpipe puts it in every frame's path, torch's included).
    """
    import traceback

    import transformers

    import klpipe

    ours, theirs = Path(klpipe.__file__).parent, Path(transformers.__file__).parent
    for frame in reversed(traceback.extract_stack()[:-3]):
        path = Path(frame.filename)
        if path.is_relative_to(theirs):
            return " (transformers)"
        if path.is_relative_to(ours):
            return ""
    return ""


class SyncCounter(TorchDispatchMode):
    """Counts the ops and host reads that would sync on CUDA, by name (see the module's docstring)."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []
        self.computed: dict[int, weakref.ref] = {}  # tensors an op made (on CUDA, the device's), by id
        self._patched = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if name in VALUE_READS:
            self.found.append(name + _by_transformers())
        out = func(*args, **(kwargs or {}))
        if name in HOST_MADE:
            return out
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.computed[id(tensor)] = weakref.ref(tensor)
        return out

    def made(self, tensor) -> bool:
        ref = self.computed.get(id(tensor))
        return ref is not None and ref() is tensor

    def _counted(self, name):
        original = getattr(torch.Tensor, name)
        counter = self

        def read(tensor, *args, **kwargs):
            if counter.made(tensor) or (tensor._base is not None and counter.made(tensor._base)):
                counter.found.append(name + _by_transformers())
            return original(tensor, *args, **kwargs)

        return original, read

    def __enter__(self):
        for name in ("tolist", "numpy", "cpu"):
            self._patched[name], patched = self._counted(name)
            setattr(torch.Tensor, name, patched)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._patched.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)


def test_the_counter_sees_each_kind_of_sync():
    with SyncCounter() as counter:
        x = torch.arange(6.0) * 2  # computed: a device tensor on CUDA
        x.sum().item()
        x.tolist()
        x.numpy()
        torch.nonzero(x)
        torch.from_numpy(np.arange(3)).tolist()  # made on the host: no sync
    assert counter.found == ["_local_scalar_dense", "tolist", "numpy", "nonzero"]


def _one_batch(path, rows):
    reference = ReferenceModel.load(ModelSpec(str(path), dtype="float32", device="cpu"))
    rows = rows(reference.vocab_size)
    reference.score_batch(rows)  # transformers' first call builds what it caches
    with SyncCounter() as counter:
        reference.score_batch(rows)
    return counter.found


# transformers' mask code would ask, without an attention mask, whether the rows are packed
# (`find_packed_sequence_indices`: `(mask[:, -1] == 0).all()` read on the host), once per kind of mask the model
# builds: Llama one, Gemma 4 two (full and sliding). While klpipe packs the rows it answers that itself
# (packing._packed_sequences), so the one sync left is klpipe's: the head's logprobs coming back.


def test_rows_run_whole_sync_once_per_batch_llama():
    found = _one_batch(TINY_LLAMA, lambda vocab: agent_rows(vocab)[:6])
    assert found == ["numpy"], found


def test_rows_run_whole_sync_once_per_batch_gemma4():
    found = _one_batch(TINY_GEMMA, lambda vocab: agent_rows(vocab, seed=3)[:6])
    assert found == ["numpy"], found


def test_transformers_still_finds_packed_rows_outside_klpipes_batches():
    from transformers.masking_utils import find_packed_sequence_indices

    positions = torch.tensor([[0, 1, 2, 0, 1]])
    assert find_packed_sequence_indices(positions).tolist() == [[0, 0, 0, 1, 1]]
    assert find_packed_sequence_indices(torch.arange(4)[None]) is None
    # Inside klpipe's packed batch, only a model whose masks are klpipe's (none) goes without the answer: Falcon
    # runs sdpa under any name, on transformers' packed-sequence mask, which needs it.
    with packing.packed(packing.Rows([3, 2])):
        assert find_packed_sequence_indices(positions).tolist() == [[0, 0, 0, 1, 1]]
    with packing.packed(packing.Rows([3, 2]), maskless=True):
        assert find_packed_sequence_indices(positions) is None


@pytest.mark.parametrize("path", [TINY_LLAMA, TINY_GEMMA], ids=["llama", "gemma4"])
def test_each_pass_of_the_tree_syncs_once(path):
    """A tree pass is a batch: its forward and head sync once (the logprobs back), whatever its nodes and context."""
    reference = ReferenceModel.load(ModelSpec(str(path), dtype="float32", device="cpu"))
    rows = agent_rows(reference.vocab_size)
    reference.use_cascade()
    plan = plan_chunk(reference, rows, 48, "on", max_cache_tokens=10**9)
    assert len(plan.passes) > 3 and any(int(plan.tree.start[step.nodes].max()) > 0 for step in plan.passes)
    run_plan(reference, plan, rows, 1.0)  # transformers' first calls build what they cache
    with SyncCounter() as counter:
        run_plan(reference, plan, rows, 1.0)
    assert counter.found == ["numpy"] * len(plan.passes), counter.found
