"""What `klpipe score` writes: the columns it adds, the scored file's schema and settings, and the two writers (parquet
row groups, or the Atropos groups the rows came from) over one scoring loop."""

from __future__ import annotations

import json
from collections.abc import Callable, Generator
from contextlib import closing
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeAlias

import pyarrow as pa

from klpipe import __version__
from klpipe.atropos.writer import GroupWriter
from klpipe.cache import SCORED_METADATA_KEY
from klpipe.columns import ColumnMap
from klpipe.rows import RowLocator
from klpipe.score import sampler as sampler_section
from klpipe.score.config import ScoreConfig
from klpipe.score.input import read_batches
from klpipe.storage.parquet import RowGroups, parquet_writer
from klpipe.storage.store import Location
from klpipe.threads import in_background, prefetch

# Columns score adds to every row.
KL = "kl"
KL_COEFF = "kl_coeff"
KL_PENALTY = "kl_penalty"
ADJUSTED_REWARD = "adjusted_reward"
KL_PER_TOKEN = "kl_per_token"  # only with per_token
SCORED_COLUMNS = (KL, KL_COEFF, KL_PENALTY, ADJUSTED_REWARD, KL_PER_TOKEN)

# Output schema-metadata key with the settings a scored file was made with.
SCORE_METADATA_KEY = SCORED_METADATA_KEY


def output_schema(schema: pa.Schema, config: ScoreConfig, replaced: list[str], has_sampler: bool = False) -> pa.Schema:
    kept = [f for f in schema if f.name not in replaced]
    added = [pa.field(name, pa.float64()) for name in (KL, KL_COEFF, KL_PENALTY, ADJUSTED_REWARD)]
    if config.per_token:
        added.append(pa.field(KL_PER_TOKEN, pa.list_(pa.float64())))
    if has_sampler:
        added += sampler_section.output_fields(config.per_token)
    metadata = dict(schema.metadata or {})
    metadata[SCORE_METADATA_KEY] = json.dumps(settings(config), sort_keys=True).encode()
    return pa.schema(kept + added, metadata=metadata)


def settings(config: ScoreConfig) -> dict[str, Any]:
    return {
        "klpipe_version": __version__,
        "estimator": config.estimator,
        "aggregate": config.aggregate,
        "clamp": config.clamp,
        "per_token": config.per_token,
        "controller": asdict(config.controller),
        "columns": dict(config.columns),
    }


# One record batch (and where its rows come from) to its output columns.
ScoreBatch: TypeAlias = Callable[[pa.RecordBatch, RowLocator], list[pa.Array]]


def scored(files: list[Location], config: ScoreConfig, score_batch: ScoreBatch, names: ColumnMap,
            out_schema: pa.Schema) -> Generator[pa.RecordBatch, None, None]:
    """The one loop both writers share: read a record batch (a thread decodes the next meanwhile), score it."""
    with closing(prefetch(read_batches(files, config.batch_tokens, config.batch_bytes, names))) as stream:
        for batch, rows in stream:
            yield pa.RecordBatch.from_arrays(score_batch(batch, rows), schema=out_schema)


def write_parquet(tmp: Path, files: list[Location], config: ScoreConfig, score_batch: ScoreBatch, names: ColumnMap,
                   out_schema: pa.Schema) -> None:
    # Three stages overlap: a thread decodes the next record batch, this thread scores, and
    # another thread encodes the previous row group (parquet and numpy release the GIL).
    with parquet_writer(tmp, out_schema) as writer, in_background(writer.write_table, depth=1) as write, \
            closing(scored(files, config, score_batch, names, out_schema)) as batches:
        row_groups = RowGroups(write, config.row_group_bytes)
        for batch in batches:
            row_groups.add(batch)
        row_groups.flush()


def write_groups(tmp: Path, files: list[Location], config: ScoreConfig, score_batch: ScoreBatch, names: ColumnMap,
                  out_schema: pa.Schema) -> None:
    """The scored rows as the Atropos groups they came from (klpipe/atropos/writer.py), one JSON line each."""
    with open(tmp, "w", encoding="utf-8") as out, \
            closing(scored(files, config, score_batch, names, out_schema)) as batches:
        writer = GroupWriter(out, names, scored=True)
        for batch in batches:
            writer.add(batch)
        writer.close()
