"""fp64 all the way through: every fp32 a model's own code (or klpipe's) asks for becomes fp64.

An fp64 model is not an fp64 computation: transformers' code widens to fp32 where it fears bf16 (the Gated
DeltaNet's delta rule, gated RMS norms, softmax(dtype=float32), RoPE's `inv_freq.float()`), and so does klpipe's
(the head's log-sum-exp, the cascade's merge). Each such cast rounds an fp64 value to fp32 again, so an fp64 run
would still carry fp32 rounding where the tree and a row run whole split the work differently, and a wrong formula
could not be told from rounding. Under `fp64()` a torch function mode turns every `torch.float32` passed to a torch
call into `torch.float64` and `.float()` into `.double()`, and factories without a dtype make fp64: every family's
forward, the tree's and the oracle's alike, computes in fp64 with no per-family code.

`--dtype float64` runs klpipe's forwards and head under it (`install`); tests hold every path to an fp64 forward of
the same weights run under it too (tests/model/test_fp64.py).
"""

from __future__ import annotations

import types
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode


class _Fp64(TorchFunctionMode):
    """float32 → float64 in every torch call's arguments; `.float()` is `.double()`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        if any(a is torch.float32 for a in args):
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        if any(v is torch.float32 for v in kwargs.values()):
            kwargs = {k: torch.float64 if v is torch.float32 else v for k, v in kwargs.items()}
        return func(*args, **kwargs)


def passes_through(code) -> bool:
    """Whether `code` is the fp64 mode's own, which every torch call inside fp64() passes through (a traceback's
    innermost frame when the call fails: failures.raised_in_klpipe looks past it)."""
    return code is _Fp64.__torch_function__.__code__


@contextmanager
def fp64():
    """Every fp32 asked for inside is fp64 (this thread; factories without a dtype make fp64 in every thread while
    inside: torch's default dtype is process-wide, so fp64 runs are one at a time)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with _Fp64():
            yield
    finally:
        torch.set_default_dtype(before)


def _fp64_call(self, *args, **kwargs):
    with fp64():
        return self._before_fp64(*args, **kwargs)


def install(target, name: str = "forward") -> None:
    """`target.name` runs under fp64() from now on: an fp64 reference model's forward, its body's and its head's
    (ReferenceModel; klpipe's attention and caches run inside the body's forward). A bound method on the instance,
    not a closure: a deep copy of the model (the tests' oracle) runs its own forward, under fp64() too."""
    if "_before_fp64" in vars(target):
        return  # the body is the model itself (a model with no decoder of its own)
    vars(target)["_before_fp64"] = getattr(target, name)
    vars(target)[name] = types.MethodType(_fp64_call, target)
