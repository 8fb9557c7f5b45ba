"""`klpipe inspect`: options in, InspectConfig out, one call to klpipe.inspect.inspect, one line on stderr."""

from __future__ import annotations

from typing import Annotated

import typer

from klpipe.cli.app import app, defaults, handle_errors
from klpipe.inspect.config import InspectConfig, SortKey

# Every option can come from KLPIPE_INSPECT_<OPTION>, as score's come from KLPIPE_SCORE_<OPTION>.
ENV_PREFIX = "KLPIPE_INSPECT_"

ROWS_PANEL = "Which rows"

INSPECT = defaults(InspectConfig)


def _env(option: str) -> str:
    return ENV_PREFIX + option.upper().replace("-", "_")


@app.command("inspect")
@handle_errors
def inspect_command(
    scored: Annotated[str, typer.Argument(
        help="A scored parquet file (klpipe score's output), or a cache with policy_logprobs and ref_logprobs.",
        envvar=_env("scored"))],
    output: Annotated[str | None, typer.Option(
        "--output", "-o", help="The HTML page. Default: <input's stem>.kl.html beside it.", metavar="PATH",
        envvar=_env("output"))] = INSPECT["output"],
    top: Annotated[int, typer.Option(
        help="Embed this many rows, the largest by --sort (rows with a token above 20 nats first).",
        envvar=_env("top"), rich_help_panel=ROWS_PANEL)] = INSPECT["top"],
    sort: Annotated[SortKey, typer.Option(
        help="kl: per-row KL; max-token: the largest |policy − ref| of one token; penalty: kl_penalty.",
        envvar=_env("sort"), rich_help_panel=ROWS_PANEL)] = INSPECT["sort"],
    row: Annotated[list[str] | None, typer.Option(
        "--row", metavar="ID", help="Embed the row with this id (instead of the top rows); repeatable.",
        envvar=_env("row"), rich_help_panel=ROWS_PANEL, show_default=False)] = None,
    step: Annotated[list[str] | None, typer.Option(
        "--step", metavar="S", help="Only rows of step S; repeatable.", envvar=_env("step"),
        rich_help_panel=ROWS_PANEL, show_default=False)] = None,
    tokenizer: Annotated[str | None, typer.Option(
        metavar="DIR|ID", help="Decode with this tokenizer (a directory, a tokenizer.json or a hub id). Default: "
        "the reference model the cache records.", envvar=_env("tokenizer"))] = INSPECT["tokenizer"],
) -> None:
    """Show where KL comes from, token by token, in one self-contained HTML page.

    The page has the run's provenance and summary, the curves per step, a sortable table of the
    embedded rows, and each row's response decoded token by token, coloured by policy − ref. It
    opens from a file: URL and fetches nothing. Decoding needs `pip install 'klpipe[inspect]'`
    (the tokenizers library; no torch). Every option can also be set with
    `KLPIPE_INSPECT_<OPTION>`, e.g. `KLPIPE_INSPECT_TOP=20`.

    Examples:

        klpipe inspect scored.parquet -o kl.html

        klpipe inspect scored.parquet --sort max-token --step 312 -o step312.html

        klpipe inspect cached.parquet --row r17 --row r42 --tokenizer path/to/model
    """
    import sys

    from klpipe.inspect import inspect

    config = InspectConfig(input=scored, output=output, top=top, sort=sort, rows=list(row or []),
                           steps=list(step or []), tokenizer=tokenizer)
    result = inspect(config)
    print(f"Wrote {result.output} ({result.bytes / 1024:,.0f} KiB: {result.rows} of {result.total_rows:,} rows)",
          file=sys.stderr)
