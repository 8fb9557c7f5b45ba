"""`klpipe inspect`: a scored file (or a cache with policy logprobs) in, one self-contained HTML page out.

Two passes over the file: every row's figures and the curves (select.py), then the picked rows' tokens
(gather.py), decoded (decode.py) into the page (page.py). Everything is checked before the page is
written, and the page appears whole or not at all.
"""

from __future__ import annotations

from dataclasses import dataclass

from klpipe.errors import InputError
from klpipe.inspect import page as page_module
from klpipe.inspect.config import InspectConfig
from klpipe.inspect.decode import load_decoder, require_tokenizers
from klpipe.inspect.gather import check_token_columns, gather
from klpipe.inspect.select import curves, open_source, read_figures, select_rows
from klpipe.storage.atomic import atomic_output
from klpipe.storage.discover import PARQUET_SUFFIXES, output_beside, refuse_overwriting_inputs
from klpipe.storage.store import Location, check_output

OUTPUT_SUFFIX = ".kl.html"


@dataclass
class InspectResult:
    output: Location
    rows: int  # rows embedded
    total_rows: int  # rows in the file
    bytes: int  # the page's size


def default_output(path: Location) -> Location:
    """<stem>.kl.html beside the input: scored.parquet → scored.kl.html."""
    return output_beside(path, OUTPUT_SUFFIX, PARQUET_SUFFIXES)


def inspect(config: InspectConfig) -> InspectResult:
    """Write the page `config` asks for."""
    require_tokenizers()  # the light install has none: say so before reading anything
    output = config.output if config.output is not None else default_output(config.input)
    refuse_overwriting_inputs({"--output": output}, [config.input])
    check_output(output)
    source = open_source(config.input)
    check_token_columns(source)
    tokenizer, revision = config.tokenizer, None
    if tokenizer is None:
        if source.provenance is None:
            raise InputError(f"{config.input}: no klpipe provenance to find the tokenizer in; pass --tokenizer DIR|ID")
        tokenizer = source.provenance.model
        revision = None if str(source.provenance.revision).startswith("local:") else source.provenance.revision
    decoder = load_decoder(tokenizer, revision)  # before the passes: a wrong name costs nothing
    figures = read_figures(source, config.batch_tokens)
    selection = select_rows(figures, config.input, sort=config.sort, top=config.top, rows=config.rows,
                            steps=config.steps, extreme_nats=config.extreme_nats)
    picked = gather(source, selection.indices, config.batch_tokens)
    html = page_module.render(page_module.PageInput(
        source=source, figures=figures, curves=curves(figures), selection=selection, rows=picked, decoder=decoder,
        extreme_nats=config.extreme_nats,
    ))
    data = html.encode("utf-8")
    with atomic_output(output) as tmp:
        tmp.write_bytes(data)
    return InspectResult(output=output, rows=len(selection.indices), total_rows=len(figures), bytes=len(data))
