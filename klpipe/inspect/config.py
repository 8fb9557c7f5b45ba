"""What one `klpipe inspect` run is asked to do: each field an option, written once (klpipe/options.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from klpipe.errors import InputError
from klpipe.options import option

if TYPE_CHECKING:
    from klpipe.storage.store import Location

SortKey = Literal["kl", "max-token", "penalty", "log-ppl-diff"]
SORT_KEYS: tuple[str, ...] = ("kl", "max-token", "penalty", "log-ppl-diff")

ROWS_PANEL = "Which rows"


@dataclass
class InspectConfig:
    """One page: which file, which rows, which tokenizer."""

    input: Location = option(argument=True, name="scored", help="A scored parquet file (klpipe score's output), "
                             "or a cache with policy_logprobs and ref_logprobs.")
    output: Location | None = option(None, flags=("--output", "-o"), metavar="PATH",
                                     help="The HTML page. Default: <input's stem>.kl.html beside it.")
    top: int = option(50, panel=ROWS_PANEL, help="Embed this many rows, the largest by --sort (rows with a token "
                      "above 20 nats first).")  # when no --row names them
    # log-ppl-diff: the row's |log_ppl_diff| between trainer and sampler (a file with sampler_logprobs)
    sort: SortKey = option("kl", panel=ROWS_PANEL, help="kl: per-row KL; max-token: the largest |policy − ref| of "
                           "one token; penalty: kl_penalty; log-ppl-diff: |log_ppl_diff| between trainer and sampler.")
    rows: list[str] = option(default_factory=list, flags=("--row",), metavar="ID", panel=ROWS_PANEL,
                             show_default=False, parse=list, cli_type=list[str] | None,
                             help="Embed the row with this id (instead of the top rows); repeatable.")
    steps: list[str] = option(default_factory=list, flags=("--step",), metavar="S", panel=ROWS_PANEL,
                              show_default=False, parse=list, cli_type=list[str] | None,
                              help="Only rows of step S; repeatable.")
    tokenizer: str | None = option(
        None, metavar="DIR|ID", help="Decode with this tokenizer (a directory, a tokenizer.json or a hub id). "
        "Default: the reference model the cache records.")
    extreme_nats: float = 20.0  # rows with a token whose |policy − ref| exceeds this come first, as score warns
    batch_tokens: int = 1 << 21  # tokens per record batch read

    def __post_init__(self) -> None:
        if self.sort not in SORT_KEYS:
            raise InputError(f"unknown sort {self.sort!r}; choose one of {', '.join(SORT_KEYS)}")
        if self.top < 1:
            raise InputError(f"--top must be at least 1, got {self.top}")
        from klpipe.storage.store import location

        self.input = location(self.input)
        if self.output is not None:
            self.output = location(self.output)
