"""Reading rollout rows: parquet streamed with pyarrow, JSON Lines and `save_to_disk` dirs via `datasets`.

The reader hands out fixed-size chunks of consecutive rows, the unit of checkpointing, with
bounded memory; tokenize.py turns each into flat token-id arrays. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import gzip
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from klpipe import cache
from klpipe.arrow import is_list_type
from klpipe.atropos import reader as atropos
from klpipe.cache import written_by_klpipe
from klpipe.columns import ColumnMap
from klpipe.errors import InputError, first_line
from klpipe.mask import check_mask_type, mask_by_name
from klpipe.precompute import trainer_batches
from klpipe.precompute.chat import is_messages_type
from klpipe.storage.discover import (
    JSONL_SUFFIXES,
    PARQUET_SUFFIXES,
    expand_inputs,
    is_datasets_dir,
    schema_difference,
)
from klpipe.storage.download import local_copy
from klpipe.storage.parquet import open_parquet
from klpipe.storage.store import Location, is_remote, store_failure

INPUT_SUFFIXES = PARQUET_SUFFIXES + JSONL_SUFFIXES
TOKEN_IDS = "ids"  # token-id mode: prompt_ids / response_ids used as they are
TEXT = "text"  # text mode: prompt / response tokenized with the reference tokenizer
CHAT = "chat"  # TRL conversational: prompt / completion messages rendered with the chat template
BATCH = "batch"  # a trainer's padded batch (verl's keys, OpenRLHF's experience): unpadded by trainer_batches.py
TOKEN_ID_TYPE = pa.list_(pa.int32())  # what text mode writes
DATAPROTO = "dataproto"  # a file's kind: verl's DataProto.save_to_disk pickle
PICKLE_MAGIC = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")  # pickle protocols 2 to 5


@dataclass
class RolloutFile:
    path: Location  # a local path, or a file on a store
    kind: str  # "parquet" | "jsonl" | "datasets" | "atropos" (JSON Lines of Atropos groups: atropos/reader.py)
    num_rows: int
    schema: pa.Schema


@dataclass
class Rollouts:
    """The input as one logical table: files in order, one schema, one mode."""

    files: list[RolloutFile]
    schema: pa.Schema  # without metadata
    mode: str  # TOKEN_IDS, TEXT, CHAT or BATCH
    columns: ColumnMap  # role -> the user's column name
    skipped: list[Location] = field(default_factory=list)  # klpipe's own outputs found in input directories
    batch: str | None = None  # BATCH mode: whose batch (trainer_batches.VERL or trainer_batches.OPENRLHF)

    @property
    def num_rows(self) -> int:
        return sum(f.num_rows for f in self.files)

    @property
    def atropos(self) -> bool:
        """Whether the rows are the completions of Atropos groups, which score can write back as groups."""
        return self.files[0].kind == atropos.ATROPOS


@dataclass
class Chunk:
    """Consecutive input rows: chunk `index` of the run's row range (rollouts.iter_chunks)."""

    index: int
    table: pa.Table
    file_index: np.ndarray  # (rows,) which input file each row came from
    file_row: np.ndarray  # (rows,) the row's index inside that file


def open_rollouts(paths: Sequence[str | Location], columns: ColumnMap | None = None,
                  writes: tuple[str, ...] = (cache.REF_LOGPROBS,), rollout_format: str | None = None) -> Rollouts:
    """Find the input files, check that they agree on a schema, and pick the mode from its columns.

    `writes`: the roles this run writes, whose mapped columns need not exist yet. JSON Lines of Atropos groups
    are found by their columns, or insisted on with `rollout_format="atropos"`."""
    # A cache (or scored file) written into an input directory by an earlier run is not a rollout.
    def ours(path: Location) -> bool:
        return path.name.endswith(PARQUET_SUFFIXES) and written_by_klpipe(path) is not None

    found, skipped = expand_inputs(paths, INPUT_SUFFIXES, skip=ours)
    files = [_open_file(p, rollout_format == atropos.ATROPOS) for p in found]
    first = files[0]
    for other in files[1:]:
        if not other.schema.equals(first.schema):
            raise InputError(
                f"{other.path}: columns differ from {first.path} "
                f"({schema_difference(first.schema, other.schema)}); inputs of one run must share a schema"
            )
    trainer_batches.refuse_rollout_dump(first.path, first.schema)
    columns = (columns or ColumnMap()).resolve(first.schema, first.path)
    columns.check_present(first.path, first.schema, outputs=writes)
    batch = trainer_batches.detect(first.schema) if first.kind != atropos.ATROPOS else None
    if batch is not None:
        trainer_batches.check_schema(first.path, batch, first.schema, columns.given)
        return Rollouts(files=files, schema=first.schema, mode=BATCH, columns=columns, skipped=skipped, batch=batch)
    by_name = mask_by_name(first.path, first.schema, columns.name(cache.MASK), cache.MASK in columns.given)
    if by_name is not None:  # recorded as if mapped, so that score reads the same column
        columns = ColumnMap({**columns.given, cache.MASK: by_name}).resolve(first.schema, first.path)
    mode = _detect_mode(first.path, first.schema, columns)
    if columns.name(cache.MASK) in first.schema.names:
        check_mask_type(first.path, first.schema, columns.name(cache.MASK))
    return Rollouts(files=files, schema=first.schema, mode=mode, columns=columns, skipped=skipped)


def _open_file(path: Location, groups: bool = False) -> RolloutFile:
    if path.name.endswith(JSONL_SUFFIXES) and (groups or atropos.looks_like_groups(path)):
        num_rows, schema = atropos.scan(path)  # every group checked, one line at a time
        return RolloutFile(path=path, kind=atropos.ATROPOS, num_rows=num_rows, schema=schema)
    if groups:
        raise InputError(f"{path}: --rollout-format atropos reads JSON Lines of Atropos groups (tokens, masks, "
                         "scores), which this is not")
    if is_datasets_dir(path) or path.name.endswith(JSONL_SUFFIXES):
        table = _datasets_table(path)
        kind = "datasets" if path.is_dir() else "jsonl"
        num_rows, schema = table.num_rows, table.schema
    elif not path.is_dir() and _is_pickle(path):  # verl's DataProto.save_to_disk
        table = _dataproto_table(path)
        kind, num_rows, schema = DATAPROTO, table.num_rows, table.schema
    else:
        kind = "parquet"
        try:
            with open_parquet(path) as meta:
                num_rows, schema = meta.metadata.num_rows, meta.schema_arrow
        except (OSError, pa.ArrowException) as exc:
            failure = store_failure(path, exc)
            if failure is not None:
                raise failure from None
            if path.stat().st_size == 0:
                raise InputError(f"{path}: file is empty (0 bytes)") from None
            raise InputError(f"{path}: not a readable parquet file ({first_line(exc)})") from None
    if num_rows == 0:
        raise InputError(f"{path}: file has no rows")
    return RolloutFile(path=path, kind=kind, num_rows=num_rows, schema=schema.remove_metadata())


def _is_pickle(path: Location) -> bool:
    try:
        with (path.open_input_file() if is_remote(path) else open(path, "rb")) as file:
            return file.read(2) in PICKLE_MAGIC
    except (OSError, pa.ArrowException):
        return False  # the parquet reader says why


def _dataproto_table(path: Location) -> pa.Table:
    """A DataProto.save_to_disk file as a table, read by a restricted unpickler (model/dataproto.py: torch)."""
    try:
        from klpipe.model.dataproto import read_dataproto
    except ImportError:
        raise InputError(f"{path}: reading a DataProto pickle needs torch: pip install 'klpipe[precompute]'") from None
    return read_dataproto(path, local_copy(path))


def _datasets_table(path: Location) -> pa.Table:
    """A memory-mapped Arrow table for JSON Lines or `save_to_disk` input, through `datasets`.

    `datasets` reads local files: one on a store is downloaded once into KLPIPE_CACHE_DIR
    (download.local_copy), and every message still names its URI.
    """
    try:
        import datasets  # heavy; only JSON Lines and save_to_disk inputs need it
    except ImportError:
        raise InputError(f"{path}: reading JSON Lines and save_to_disk inputs needs the datasets package: "
                         "pip install 'klpipe[precompute]'") from None

    datasets.disable_progress_bars()
    # Its parse errors are logged as well as raised; klpipe reports each failure in one line of its own.
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    local = local_copy(path)
    try:
        if local.is_dir():
            ds = datasets.load_from_disk(str(local))
            if isinstance(ds, datasets.DatasetDict):
                raise InputError(f"{path}: holds several splits ({', '.join(ds)}); pass one split's directory")
        else:
            if local.stat().st_size == 0:
                raise InputError(f"{path}: file is empty (0 bytes)")
            ds = datasets.Dataset.from_json(str(local), keep_in_memory=False)
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - datasets wraps parse errors in several exception types
        bad_line = None if local.is_dir() else _first_bad_line(local)
        if bad_line is not None:
            raise InputError(f"{path}: {bad_line}") from None
        raise InputError(f"{path}: not readable as {'a datasets directory' if local.is_dir() else 'JSON Lines'} "
                         f"({first_line(exc)})") from None
    return ds.data.table


def _first_bad_line(path: Path) -> str | None:
    """Which line of a JSON Lines file is not a JSON object, for the message; None when every line is one.

    Read only after `datasets` has failed: its message ("An error occurred while generating the
    dataset") names neither the line nor the problem.
    """
    opener = gzip.open if path.name.endswith(".gz") else open
    number = 0
    try:
        with opener(path, "rt", encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    return f"line {number} is not valid JSON ({exc.msg} at column {exc.colno})"
                if not isinstance(row, dict):
                    return f"line {number} is not a JSON object (one row per line)"
    except UnicodeDecodeError:
        return f"line {number + 1} is not UTF-8 text"
    except (OSError, EOFError):
        return None  # unreadable or a broken gzip stream: the caller's message says what datasets saw
    return None


def _detect_mode(path: Location, schema: pa.Schema, columns: ColumnMap) -> str:
    names = set(schema.names)
    prompt_ids, response_ids = columns.name(cache.PROMPT_IDS), columns.name(cache.RESPONSE_IDS)
    prompt, response = columns.name(cache.PROMPT), columns.name(cache.RESPONSE)
    if {prompt_ids, response_ids} <= names:
        for column in (prompt_ids, response_ids):
            kind = schema.field(column).type
            if not (is_list_type(kind) and pa.types.is_integer(kind.value_type)):
                raise InputError(f"{path}: column {column} must be a list of integer token ids, found {kind}")
        return TOKEN_IDS
    if {prompt, response} <= names:
        kinds = [schema.field(column).type for column in (prompt, response)]
        if any(is_messages_type(kind) for kind in kinds):
            for column, kind in zip((prompt, response), kinds, strict=True):
                if not is_messages_type(kind):
                    raise InputError(f"{path}: column {column} must be a list of chat messages like the other, "
                                     f"found {kind}; TRL's conversational format has both as messages")
            return CHAT
        for column, kind in zip((prompt, response), kinds, strict=True):
            if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
                raise InputError(f"{path}: column {column} must be a string or a list of chat messages, found {kind}")
        return TEXT
    response_names = response if cache.RESPONSE in columns.given else f"{response} or {cache.COMPLETION}"
    raise InputError(
        f"{path}: missing columns: needs {prompt_ids} and {response_ids} (token ids), "
        f"or {prompt} and {response_names} (text, or TRL conversational messages); "
        f"found {', '.join(schema.names) or 'none'}"
    )


def iter_chunks(rollouts: Rollouts, chunk_rows: int, skip: set[int] | frozenset = frozenset(),
                rows: tuple[int, int] | None = None) -> Iterator[Chunk]:
    """Consecutive `chunk_rows`-row chunks of the logical table's `rows` range, with bounded memory.

    Chunk k covers rows [start + k·chunk_rows, ...) of the range, so the plan depends on the range
    alone and a rerun cuts the same chunks. Chunks in `skip` are read past but never materialised.
    Parquet is streamed one record batch at a time, and row groups outside the range are not read.
    """
    start, stop = rows or (0, rollouts.num_rows)
    pending: list[pa.RecordBatch] = []
    pending_file: list[np.ndarray] = []
    pending_row: list[np.ndarray] = []
    pending_rows = 0
    index = 0
    file_start = 0
    for file_index, info in enumerate(rollouts.files):
        file_stop = file_start + info.num_rows
        lo, hi = max(start, file_start) - file_start, min(stop, file_stop) - file_start
        file_start = file_stop
        if lo >= hi:
            continue
        for file_row, batch in _iter_file_rows(info, lo, hi, batch_rows=min(chunk_rows, 8192)):
            while batch.num_rows:
                take = min(batch.num_rows, chunk_rows - pending_rows)
                pending.append(batch.slice(0, take))
                pending_file.append(np.full(take, file_index, dtype=np.int64))
                pending_row.append(np.arange(file_row, file_row + take, dtype=np.int64))
                pending_rows += take
                file_row += take
                batch = batch.slice(take)
                if pending_rows == chunk_rows:
                    if index not in skip:
                        yield _make_chunk(index, pending, pending_file, pending_row, rollouts.schema)
                    index += 1
                    pending, pending_file, pending_row, pending_rows = [], [], [], 0
    if pending_rows and index not in skip:
        yield _make_chunk(index, pending, pending_file, pending_row, rollouts.schema)


def num_chunks(rows: tuple[int, int], chunk_rows: int) -> int:
    return -(-(rows[1] - rows[0]) // chunk_rows)


def chunk_sizes(rows: tuple[int, int], chunk_rows: int) -> list[int]:
    total = rows[1] - rows[0]
    return [min(chunk_rows, total - k * chunk_rows) for k in range(num_chunks(rows, chunk_rows))]


def _make_chunk(index, batches, files, rows, schema) -> Chunk:
    batches = [b if b.schema.equals(schema) else b.cast(schema) for b in batches]
    table = pa.Table.from_batches(batches, schema=schema)
    return Chunk(index=index, table=table, file_index=np.concatenate(files), file_row=np.concatenate(rows))


def _iter_file_rows(info: RolloutFile, lo: int, hi: int, batch_rows: int) -> Iterator[tuple[int, pa.RecordBatch]]:
    """(file row of the batch's first row, batch) covering the file's rows [lo, hi)."""
    try:
        with contextlib.ExitStack() as open_files:
            if info.kind == "parquet":
                parquet = open_files.enter_context(open_parquet(info.path))
                groups, position, first = [], 0, None
                for group in range(parquet.num_row_groups):
                    size = parquet.metadata.row_group(group).num_rows
                    if position < hi and position + size > lo:
                        groups.append(group)
                        first = position if first is None else first
                    position += size
                batches = parquet.iter_batches(batch_size=batch_rows, row_groups=groups)
            elif info.kind == atropos.ATROPOS:
                yield from atropos.iter_batches(info.path, lo, hi, batch_rows, info.schema)
                return
            else:
                first = lo
                table = _dataproto_table(info.path) if info.kind == DATAPROTO else _datasets_table(info.path)
                batches = table.slice(lo, hi - lo).to_batches(max_chunksize=batch_rows)
            position = lo if first is None else first  # None: no row group reaches [lo, hi), no batch to read
            for batch in batches:
                begin, end = max(lo - position, 0), min(hi - position, batch.num_rows)
                if end > begin:
                    yield position + begin, batch.slice(begin, end - begin).replace_schema_metadata(None)
                position += batch.num_rows
                if position >= hi:
                    break
    except (OSError, pa.ArrowException) as exc:
        raise (store_failure(info.path, exc)
               or InputError(f"{info.path}: corrupt or unreadable ({first_line(exc)})")) from None
