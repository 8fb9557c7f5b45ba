"""Parquet readers and writers: memory that does not grow with the file, and pages that carry checksums.

Every page klpipe writes carries a CRC-32 (parquet's page checksum), and every reader verifies the
checksum of each page that has one. A flipped bit in a cache (a failing disk, a bad copy) then stops
the run with the file's name, where it would otherwise become a wrong logprob, a wrong penalty and
a wrong policy update without anything crashing.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeAlias

import pyarrow as pa
import pyarrow.parquet as pq

from klpipe.storage.store import Location, is_remote

# pyarrow's reader defaults hold far more than the batch they hand out: `pre_buffer=True` caches
# the column chunks of every row group it is asked for and keeps them as the batches go by (reading
# a whole file that way held memory in proportion to the file), and `buffer_size=0` reads each
# column chunk whole (a row group of wide rows can be gigabytes). Off, and buffered reads of 1 MiB:
# a reader holds about a page per column plus the batch it hands out, whatever the file's size.
PARQUET_READ_BUFFER = 1 << 20
# On a store every buffered read is a request (an S3 ranged GET, tens of milliseconds before the
# first byte): larger reads there, still a few MiB per column.
STORE_READ_BUFFER = 8 << 20


def open_parquet(path: str | Path | Location) -> pq.ParquetFile:
    """A parquet reader with bounded memory that verifies page checksums: every klpipe reader opens files this way.

    Pages written without a checksum (by other tools) are read as they are. A file on a store is
    read in ranges through its filesystem, never downloaded whole.
    """
    if is_remote(path):
        return pq.ParquetFile(path.fs_path, filesystem=path.filesystem, pre_buffer=False,
                              buffer_size=STORE_READ_BUFFER, page_checksum_verification=True)
    return pq.ParquetFile(path, pre_buffer=False, buffer_size=PARQUET_READ_BUFFER, page_checksum_verification=True)


def read_schema(path: str | Path | Location) -> pa.Schema:
    """A parquet file's schema, metadata included: its footer alone is read."""
    if is_remote(path):
        return pq.read_schema(path.fs_path, filesystem=path.filesystem)
    return pq.read_schema(path)


# pyarrow encodes `write_batch_size` values (1024 by default) before it checks a page's size, so 1024 rows of
# a 20 kB pass-through column make one 20 MB page, encoded, dictionary-tried and compressed in memory whole
# (a write of a 41 MB chunk would hold 62 MiB more). Batches of about half a page's bytes keep pages near pyarrow's
# 1 MiB whatever the rows' width (a write then holds a few MiB more); narrow rows keep the default.
PAGE_BYTES = 1 << 20  # pyarrow's data_page_size
Destination: TypeAlias = str | os.PathLike[str] | pa.NativeFile  # a path, or a stream (a temporary file's)
DEFAULT_WRITE_BATCH = 1024  # pyarrow's write_batch_size


def write_batch_rows(table: pa.Table | pa.RecordBatch) -> int:
    """The write batch (in values) for rows as wide as `table`'s: a list's values are never wider than its row."""
    row_bytes: int = table.nbytes // max(table.num_rows, 1)
    return max(1, min(DEFAULT_WRITE_BATCH, PAGE_BYTES // 2 // max(row_bytes, 1)))


def parquet_writer(where: Destination, schema: pa.Schema,
                   write_batch_size: int = DEFAULT_WRITE_BATCH) -> pq.ParquetWriter:
    """A parquet writer whose pages carry checksums: every klpipe writer writes this way. Wide rows: pass
    `write_batch_rows` of a table like the ones to come."""
    return pq.ParquetWriter(where, schema, write_page_checksum=True, write_batch_size=write_batch_size)


def write_table(table: pa.Table, where: Destination) -> None:
    """`pq.write_table`, with page checksums and pages of about 1 MiB however wide the rows."""
    pq.write_table(table, where, write_page_checksum=True, write_batch_size=write_batch_rows(table))


def leaf_index(schema: pa.Schema, name: str) -> int:
    """The parquet leaf column where top-level field `name` starts (a list is one leaf, a struct one per field).

    Parquet names leaves by dotted paths (`old.logprobs.list.element`), which a column name with a
    dot in it makes ambiguous; counting leaves in schema order is not.
    """
    index = 0
    for field in schema:
        if field.name == name:
            return index
        index += _leaves(field.type)
    raise KeyError(name)


def _leaves(kind: pa.DataType) -> int:
    if pa.types.is_struct(kind):
        return sum(_leaves(kind.field(i).type) for i in range(kind.num_fields))
    if pa.types.is_map(kind):
        return _leaves(kind.key_type) + _leaves(kind.item_type)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return _leaves(kind.value_type)
    return 1


class RowGroups:
    """Gathers record batches into row groups of about `target_bytes` and hands each to `write`.

    pyarrow makes every write call its own row group, and small row groups cost writing time
    (each column chunk starts a fresh dictionary) and reading time. Whole row groups also let a
    writer thread encode one while the caller fills the next.
    """

    def __init__(self, write: Callable[[pa.Table], object], target_bytes: int):
        self.write = write
        self.target_bytes = target_bytes
        self.pending: list[pa.RecordBatch] = []
        self.pending_bytes = 0

    def add(self, batch: pa.RecordBatch) -> None:
        self.pending.append(batch)
        self.pending_bytes += batch.nbytes
        if self.pending_bytes >= self.target_bytes:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.write(pa.Table.from_batches(self.pending))
        self.pending, self.pending_bytes = [], 0
