"""What one `klpipe inspect` run is asked to do. The command line reads its defaults and choices from here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from klpipe.errors import InputError

if TYPE_CHECKING:
    from klpipe.files.store import Location

SortKey = Literal["kl", "max-token", "penalty", "log-ppl-diff"]
SORT_KEYS: tuple[str, ...] = ("kl", "max-token", "penalty", "log-ppl-diff")


@dataclass
class InspectConfig:
    """One page: which file, which rows, which tokenizer."""

    input: Location  # a scored file, or a cache with policy_logprobs and ref_logprobs
    output: Location | None = None  # None: <input's stem>.kl.html beside the input
    top: int = 50  # rows embedded when no --row names them
    # kl: per-row KL; max-token: the largest |policy − ref| of a token; penalty: kl_penalty; log-ppl-diff: the row's
    # |log_ppl_diff| between trainer and sampler (a file with sampler_logprobs)
    sort: SortKey = "kl"
    rows: list[str] = field(default_factory=list)  # ids of the rows to embed; empty: the top rows
    steps: list[str] = field(default_factory=list)  # only rows of these steps; empty: every step
    tokenizer: str | None = None  # a directory, a tokenizer.json, or a hub id; None: the cache's reference model
    extreme_nats: float = 20.0  # rows with a token whose |policy − ref| exceeds this come first, as score warns
    batch_tokens: int = 1 << 21  # tokens per record batch read

    def __post_init__(self) -> None:
        if self.sort not in SORT_KEYS:
            raise InputError(f"unknown sort {self.sort!r}; choose one of {', '.join(SORT_KEYS)}")
        if self.top < 1:
            raise InputError(f"--top must be at least 1, got {self.top}")
        from klpipe.files.store import location

        self.input = location(self.input)
        if self.output is not None:
            self.output = location(self.output)
