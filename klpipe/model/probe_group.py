"""A streamed model's load-time checks as passes of one layer-major group (layer_major.py): each layer read once for
every probe, the model's own forwards and klpipe's rows run whole alike, rather than once per probe.

The checks compare forwards that run under different attention implementations: the model's own (the oracle's,
as transformers loaded it) and klpipe's packed rows (packing.NAME). Passes of one group take turns at every layer,
so each pass says which implementation it runs under, and it is installed whenever that pass runs: at its start,
and each time the group resumes it at a layer (the group's `on_layer`). klpipe's passes keep their body's hidden
states at the positions they score (`Hidden`), and the head is applied when a check asks for them: the head the
checks have settled on by then, whichever it is.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

import numpy as np
import torch

from klpipe.model import architecture

_IMPLEMENTATION: ContextVar[str | None] = ContextVar("klpipe_probe_implementation", default=None)


@dataclass
class Hidden:
    """klpipe's rows run whole, up to the head: the hidden states at the positions they score, (N, H), and the N
    targets, for `rows` and `needed` as score_batch took them."""

    rows: list
    needed: list | None
    selected: torch.Tensor | None = None
    targets: torch.Tensor | None = None

    def logprobs(self, reference) -> list[np.ndarray]:
        """What score_batch(rows, 1.0, needed) returns, the model's head applied now to the kept hidden states."""
        needed = self.needed if self.needed is not None else [np.ones(len(r), dtype=bool) for _, r in self.rows]
        results = [np.full(len(r), np.nan, dtype=reference.result_dtype) for _, r in self.rows]
        if self.selected is None:  # nothing was fed
            return results
        wanted = [np.flatnonzero(n) for n in needed]
        values = reference.head.logprobs(self.selected, self.targets, 1.0).numpy()
        for out, w, part in zip(results, wanted, np.split(values, np.cumsum([len(w) for w in wanted])[:-1]),
                                strict=True):
            out[w] = part
        return results


class _Keep:
    """A head that keeps what it is given (a Hidden's hidden states and targets) and computes nothing."""

    def __init__(self, kept: Hidden):
        self.kept = kept

    def logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                 rows: torch.Tensor | None = None) -> torch.Tensor:
        self.kept.selected, self.kept.targets = hidden, targets
        return torch.zeros(targets.shape[0], dtype=torch.float32)


def hidden(reference, rows: list, needed: list | None, packed: bool, implementation: str):
    """(`implementation`, a call that runs klpipe's `rows` whole, packed or padded, up to the head): its result is a
    Hidden, or the error it raised (NotPacked, a model's code that cannot take packed rows)."""

    def call():
        kept = Hidden(rows, needed)
        try:
            reference.score_batch(rows, 1.0, needed, head=_Keep(kept), packed=packed)
        except Exception as exc:  # noqa: BLE001 - the check that asks for it decides what the error means
            return exc
        return kept

    return implementation, call


def run(reference, calls: list) -> list:
    """Each (implementation, call) of `calls` a pass of one layer-major group of `reference`'s streamed layers, under
    its own implementation; their results in order. The implementation installed before is installed after."""
    model = reference.model
    before = architecture.text_config(model.config)._attn_implementation

    def under(implementation: str, call):
        def run_one():
            _IMPLEMENTATION.set(implementation)  # this pass's own context (each greenlet has a copy)
            _install(model, implementation)
            return call()
        return run_one

    def on_layer(k: int, resumed: bool) -> None:
        if resumed:
            _install(model, _IMPLEMENTATION.get())

    try:
        return reference.streamer.run([under(implementation, call) for implementation, call in calls],
                                      on_layer=on_layer)
    finally:
        _install(model, before)


def _install(model, implementation: str | None) -> None:
    if implementation is not None and architecture.text_config(model.config)._attn_implementation != implementation:
        model.set_attn_implementation(implementation)
