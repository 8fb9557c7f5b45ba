"""What precompute/ may read of a loaded model, and what it hands the loader: the contract between the stage and the
reference model (model/reference.py's ReferenceModel satisfies it).

    ScoringModel  the model's members precompute/ reads, read-only: its plan's properties, how it runs rows, the
                  load-time checks' findings, and the model's own methods for what a run decides (the tree's probe:
                  use_cascade, settle_tree; a fallback: drop_cascade, drop_packing)
    Streamer      what precompute/ asks of a streamed model's layer-major runner (model/layer_major.py)
    Streaming     how a streamed model's layer-major groups share the memory budget (precompute/budget.py decides)
    LoadOptions   everything the loader takes besides the weights: --compile, the adapters, streaming, the budget's
                  cap on the tree's cache and the remembered verdict, decided before the model loads

No torch: the model's torch objects are opaque here (`Any`), and importing this module pulls in neither torch nor
klpipe.model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from klpipe.model.verdict import Verdict

Row = tuple[np.ndarray, np.ndarray]  # (prompt ids, response ids)


class Streamer(Protocol):
    """A streamed model's layer-major runner, as precompute/ drives it."""

    def run(self, calls: list[Callable[..., Any]], between: Callable[[], None] = ..., tokens: int = ...) -> list[Any]:
        """Each of `calls` layer-major, their results in order (model/layer_major.py)."""
        ...

    def uncounted(self) -> AbstractContextManager[Any]:
        """Within: what runs is left out of the run's figures."""
        ...

    def reset_statistics(self) -> None: ...


class CompiledModules(Protocol):
    """--compile's modules (model/compiled.py), as precompute/ hears of their failures."""

    def take_failures(self) -> list[str]: ...


class ScoringModel(Protocol):
    """What precompute/ reads of a loaded model (the reference, or a policy with weights of its own). Every member is
    read-only here: only klpipe/model/ changes a model, through its own methods."""

    # The transformers model itself (torch): opaque here, read for its class's name and config.
    @property
    def model(self) -> Any: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def result_dtype(self) -> type[np.floating[Any]]: ...
    @property
    def probe_tolerance(self) -> float: ...

    # What a chunk's plan depends on (logprobs.plan_key) and what planning asks of the tree.
    @property
    def prefill_skips_layers(self) -> bool: ...
    @property
    def rope_length_limit(self) -> int | None: ...
    @property
    def attention_cost(self) -> float: ...
    @property
    def keeps_state(self) -> bool: ...
    @property
    def state_tokens_per_node(self) -> int: ...
    @property
    def kv_bytes_per_token(self) -> int: ...
    @property
    def layer_kinds(self) -> Sequence[Any]: ...

    # How rows run: the load-time checks' findings, as installed.
    @property
    def own_forward(self) -> str | None: ...
    @property
    def packed(self) -> bool: ...
    @property
    def cascade(self) -> bool: ...
    @property
    def compiled(self) -> CompiledModules | None: ...

    # A streamed model's runner and its share of the budget (LoadOptions), None where it runs in memory.
    @property
    def streamer(self) -> Streamer | None: ...
    @property
    def stream_tokens(self) -> int | None: ...
    @property
    def stream_cache_mib(self) -> int | None: ...

    # The load: its log lines, its checks' time, and the verdict they reached or reused.
    @property
    def notes(self) -> Sequence[str]: ...
    @property
    def compile_note(self) -> str | None: ...
    @property
    def kernel_note(self) -> str | None: ...
    @property
    def check_seconds(self) -> float: ...
    @property
    def verdict(self) -> Verdict: ...
    @property
    def verdict_reused(self) -> bool: ...
    @property
    def recheck_why(self) -> str | None: ...

    def score_batch(self, rows: list[Row], temperature: float = ...,
                    needed: list[np.ndarray] | None = ...) -> list[np.ndarray]: ...

    def own_logprobs(self, rows: list[Row]) -> list[np.ndarray]: ...

    def side(self, name: str | None) -> AbstractContextManager[Any]: ...

    def use_cascade(self) -> str | None: ...

    def settle_tree(self, probe: Callable[[], str | None]) -> str | None: ...

    def drop_cascade(self) -> None: ...

    def drop_packing(self, why: str) -> None: ...


@dataclass(frozen=True)
class Streaming:
    """How a streamed model's layer-major groups share what the memory budget leaves (precompute/budget.py's
    decision, model/layer_major.py's to keep to)."""

    tokens: int | None = None  # fed tokens a layer-major group of passes may hold (None: a chunk)
    # The own resident memory above which the streamer hands freed memory back to the kernel (model/allocator.py);
    # None: always.
    trim_above: int | None = None
    # What the groups' fed tokens may hold, at `per_token` bytes each; what a group leaves of it keeps layers loaded
    # from group to group. 0: none kept, and groups sized by `tokens`.
    spare: int = 0
    per_token: int = 0


@dataclass(frozen=True)
class LoadOptions:
    """Everything the loader (ReferenceModel.load) takes besides the weights' spec, decided before anything loads."""

    compile: str = "off"  # --compile: auto | on | off (model/compiled.py)
    # LoRA adapters over the weights: (name, folder, checked config) each (model/lora.py).
    adapters: tuple[tuple[str, str, dict[str, Any]], ...] = ()
    default: str | None = None  # the adapter active outside `side` (the reference's), None: the weights alone
    streamed: bool = False  # the decoder layers' weights stay in their files (model/layer_major.py)
    streaming: Streaming = field(default_factory=Streaming)  # a streamed model's share of the budget
    cache_mib: int | None = None  # the prefix tree's cache the budget leaves; None: --max-cache-mib as recorded
    # An earlier run's verdict for the model as loaded (storage/verdicts.py), or None: the checks run.
    remembered: Callable[[Any], Verdict | None] | None = None
