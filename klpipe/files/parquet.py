"""Parquet readers and writers whose memory does not grow with the file."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

# pyarrow's reader defaults hold far more than the batch they hand out: `pre_buffer=True` caches
# the column chunks of every row group it is asked for and keeps them as the batches go by (reading
# a whole file that way held memory in proportion to the file), and `buffer_size=0` reads each
# column chunk whole (a row group of wide rows can be gigabytes). Off, and buffered reads of 1 MiB:
# a reader holds about a page per column plus the batch it hands out, whatever the file's size.
PARQUET_READ_BUFFER = 1 << 20


def open_parquet(path: str | Path) -> pq.ParquetFile:
    """A parquet reader whose memory does not grow with the file: every klpipe reader opens files this way."""
    return pq.ParquetFile(path, pre_buffer=False, buffer_size=PARQUET_READ_BUFFER)



class RowGroups:
    """Gathers record batches into row groups of about `target_bytes` and hands each to `write`.

    pyarrow makes every write call its own row group, and small row groups cost writing time
    (each column chunk starts a fresh dictionary) and reading time. Whole row groups also let a
    writer thread encode one while the caller fills the next.
    """

    def __init__(self, write, target_bytes: int):
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
