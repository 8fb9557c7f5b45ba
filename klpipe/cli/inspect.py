"""`klpipe inspect`: options in, InspectConfig out, one call to klpipe.inspect.inspect, one line on stderr."""

from __future__ import annotations

from klpipe.cli.app import app, handle_errors
from klpipe.cli.fields import build, options
from klpipe.inspect.config import InspectConfig


@app.command("inspect")
@handle_errors
@options(InspectConfig, env_prefix="KLPIPE_INSPECT_")  # as score's options come from KLPIPE_SCORE_<OPTION>
def inspect_command(given: dict) -> None:
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

    config = build(InspectConfig, given)
    result = inspect(config)
    print(f"Wrote {result.output} ({result.bytes / 1024:,.0f} KiB: {result.rows} of {result.total_rows:,} rows)",
          file=sys.stderr)
