"""torch.compile of the decoder layers' norms and MLPs: fewer passes over activations.

Per decoder layer, what holds no control flow of klpipe's and no host-side ints is compiled (its norms, its dense
MLP, and the body's final norm), each class once (`dynamic=True`), with inductor emulating eager's casts; the
attention, mixture-of-experts blocks, the embeddings and the head stay eager, and the RoPE module is not touched.
The compiled modules are held to the model's own forward at load (`check`): a module that disagrees or fails to
compile, at load or later, runs eager with one log line, never a wrong logprob. The model's own forward, which the
probes compare with, always runs eager (`Compiled.eager`). docs/precompute.md, "Compiled norms and MLPs", says why
each part is compiled or left eager.
"""

from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager
from typing import Any

import torch

from klpipe.errors import first_line

# One compiled graph per class serves every instance, but dynamo keeps one entry per variant of it (a length of 1,
# a norm without a weight, another rank): the default 8 is spent on a model with several kinds of norm.
RECOMPILE_LIMIT = 64
NORM_SUFFIXES = ("RMSNorm", "LayerNorm", "Norm")


def wanted(mode: str, device: str) -> bool:
    """Whether `--compile mode` compiles on `device`: auto on CUDA only (on CPU the compile costs more than it wins)."""
    return mode == "on" or (mode == "auto" and str(device).startswith("cuda"))


def is_norm(module: torch.nn.Module) -> bool:
    return isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm)) or type(module).__name__.endswith(NORM_SUFFIXES)


def is_mlp(module: torch.nn.Module) -> bool:
    """A dense MLP: its class says MLP and it holds no experts (a router's top-k is data-dependent)."""
    return type(module).__name__.endswith("MLP") and not any("expert" in name.lower() or "router" in name.lower()
                                                           for name, _ in module.named_modules())


def decoder_layers(body) -> torch.nn.ModuleList | None:
    """The body's list of decoder layers: its longest ModuleList child."""
    lists = [child for _, child in body.named_children() if isinstance(child, torch.nn.ModuleList)]
    return max(lists, key=len) if lists else None


def targets(body) -> list[tuple[str, torch.nn.Module]]:
    """(dotted name under the body, module) for what `Compiled` compiles: each decoder layer's own norms and MLP, and
    the body's own norms (the final one)."""
    found = []
    layers = decoder_layers(body)
    for index, layer in enumerate(layers if layers is not None else ()):
        for name, child in layer.named_children():
            if is_norm(child) or is_mlp(child):
                found.append((f"{index}.{name}", child))
    for name, child in body.named_children():
        if is_norm(child):
            found.append((name, child))
    return found


class Compiled:
    """The compiled modules of one model: each runs its compiled forward until told to run eager, for good (`drop`)
    or within `eager()`."""

    def __init__(self, modules: list[tuple[str, torch.nn.Module]], compiler=None):
        """`compiler(function) -> function`: torch.compile with klpipe's options unless given (a test's)."""
        self.active = True
        self.failures: list[str] = []  # one line per class that fell back to eager, not yet logged
        self.dropped: set[str] = set()  # classes running eager for good
        self.modules = modules
        self._installed: list[tuple[torch.nn.Module, Any]] = []  # (module, its forward before: a method or a hook's)
        quiet()
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        compiler = compiler or _compile
        compiled_by_class: dict[type, object] = {}
        for _, module in modules:
            cls = type(module)
            if cls not in compiled_by_class:
                # One compiled function per class: dynamo caches by code object, so every instance shares its graphs.
                compiled_by_class[cls] = compiler(cls.forward)
            self._install(module, compiled_by_class[cls])

    def _install(self, module: torch.nn.Module, compiled) -> None:
        eager = module.forward  # the bound method (or whatever a hook put there)
        name = type(module).__name__

        def forward(*args, **kwargs):
            if not self.active or name in self.dropped:
                return eager(*args, **kwargs)
            try:
                return compiled(module, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - inductor's failures have no common class; eager is exact
                self.drop(name, f"{type(exc).__name__}: {first_line(exc)}")
                return eager(*args, **kwargs)

        module.forward = forward
        self._installed.append((module, eager))

    def drop(self, name: str, why: str) -> None:
        """Run class `name` eager from now on, noted."""
        if name not in self.dropped:
            self.dropped.add(name)
            self.failures.append(f"{name} runs eager: torch.compile failed on it ({why})")

    def remove(self) -> None:
        """Give every module back its own forward."""
        for module, eager in self._installed:
            if getattr(eager, "__func__", None) is type(module).forward and eager.__self__ is module:
                del module.forward  # the class's own again
            else:
                module.forward = eager  # what was there before (a hook's)
        self._installed = []
        self.active = False

    @contextmanager
    def eager(self):
        """Every module eager within: the model's own forward, as transformers loaded it (the oracle's path)."""
        saved, self.active = self.active, False
        try:
            yield
        finally:
            self.active = saved

    def take_failures(self) -> list[str]:
        lines, self.failures = self.failures, []
        return lines

    @property
    def classes(self) -> list[str]:
        return sorted({type(m).__name__ for _, m in self.modules} - self.dropped)


def _compile(function):
    # dynamic: a batch of another length reuses the graph. emulate_precision_casts: a bf16 intermediate is rounded
    # where eager rounds it, not kept in fp32 across the fused kernel.
    return torch.compile(function, dynamic=True, options={"emulate_precision_casts": True})


def quiet() -> None:
    """Keep torch's compile chatter (recompile notices, inductor's hints) out of klpipe's log: a failure is klpipe's
    one line, and a fall back to eager is exact."""
    for name in ("torch._dynamo", "torch._inductor", "torch.fx.experimental.symbolic_shapes"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for module in (r"torch\._dynamo.*", r"torch\._inductor.*", r"torch\.fx.*"):
        warnings.filterwarnings("ignore", module=module)


def graphs_compiled() -> int:
    """The graphs dynamo has compiled in this process (recompiles included): a run's count beside its load's."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
