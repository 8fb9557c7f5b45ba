"""`klpipe score`'s input: opening caches, reading them in record batches, and checking every row.

Everything a cache can get wrong is caught here, before any of its rows is scored or written:
missing or mistyped columns, caches that do not belong together, nulls, rows whose policy and
reference logprobs cover different tokens, and values that are not finite. Each message names the
file and row (rows.py), and each column by the name the user's file gives it (`--column`, columns.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from klpipe.arrow import (
    first_null,
    first_null_in_lists,
    is_list_type,
    list_values,
    numpy_valid,
    numpy_view,
)
from klpipe.cache import (
    ID,
    MASK,
    POLICY_LOGPROBS,
    REF_LOGPROBS,
    REWARD,
    SAMPLER_LOGPROBS,
    STEP,
    check_compatible,
    read_provenance,
    written_by_klpipe,
)
from klpipe.columns import ColumnMap
from klpipe.errors import InputError, first_line
from klpipe.mask import check_mask_type, kept_offsets, read_mask
from klpipe.rows import RowLocator
from klpipe.score.kl import RowKL
from klpipe.sharding import is_shard_directory, shard_parts
from klpipe.storage.discover import PARQUET_SUFFIXES, expand_inputs, schema_difference
from klpipe.storage.parquet import leaf_index, open_parquet
from klpipe.storage.store import Location, expand, store_failure


@dataclass
class Logprobs:
    """One record batch's checked values, flat: what the KL math reads.

    With a mask, `policy`, `ref` and `offsets` hold the tokens the policy sampled (mask 1) alone, and
    `keep` says which of the response's tokens they are.
    """

    policy: np.ndarray  # (tokens,) policy logprob of each scored response token
    ref: np.ndarray  # (tokens,) reference logprob of the same token
    offsets: np.ndarray  # (rows + 1,) zero-based row offsets, shared by both
    reward: np.ndarray  # (rows,) float64
    keep: np.ndarray | None = None  # (response tokens,) bool: the mask, when the cache has one
    response_offsets: np.ndarray | None = None  # (rows + 1,) row offsets into `keep`
    # With a sampler_logprobs column: the trainer's (policy_logprobs) and the sampler's values of the same
    # scored tokens. The sampler's are NaN where null or in a row whose list has another length (`sampler_rows_ok`).
    trainer: np.ndarray | None = None  # (tokens,)
    sampler: np.ndarray | None = None  # (tokens,) as stored
    sampler_rows_ok: np.ndarray | None = None  # (rows,) bool
    policy_name: str | None = None  # the column `policy` was read from, when not the policy_logprobs role's

    @property
    def masked_tokens(self) -> int:
        """Response tokens not scored: those the policy did not sample."""
        return 0 if self.keep is None else int(len(self.keep) - np.count_nonzero(self.keep))


def expand_cache_inputs(paths: Sequence[str | Path | Location]) -> tuple[list[Location], list[Location]]:
    """(caches, skipped) in scoring order: files as given, directories' files sorted by name, and a
    sharded run's output directory in shard order once sharding.py has found it complete. A scored
    file that an earlier run wrote into an input directory is skipped, never scored again. Any of
    them may be on a store; a URI pattern names its matches, in sorted order."""
    found: list[Location] = []
    skipped: list[Location] = []
    for path in (path for raw in paths for path in expand(raw)):
        if is_shard_directory(path):
            found.extend(shard_parts(path))
        else:
            files, ours = expand_inputs([path], PARQUET_SUFFIXES, skip=lambda p: written_by_klpipe(p) == "scored")
            found.extend(files)
            skipped.extend(ours)
    return found, skipped


def open_caches(files: list[Location], columns: ColumnMap) -> tuple[pa.Schema, ColumnMap, int]:
    """Check that every input is a cache score can read and that they belong together; their schema,
    `columns` with the roles found under other names (the mask's TRL names) resolved, and their rows in all.

    `columns` names each role's column (columns.for_caches).
    """
    provenances = []
    first_schema: pa.Schema | None = None
    resolved = columns
    rows = 0
    for path in files:
        provenance = read_provenance(path)  # also rejects files that are not parquet
        provenances.append((str(path), provenance))
        with open_parquet(path) as reader:
            schema = reader.schema_arrow
            rows += reader.metadata.num_rows
        columns.check_present(path, schema)
        resolved = columns.resolve(schema, path)
        _check_columns(path, schema, resolved)
        if first_schema is None:
            first_schema = schema
        elif not schema.remove_metadata().equals(first_schema.remove_metadata()):
            raise InputError(
                f"{path}: columns differ from {files[0]} ({schema_difference(first_schema, schema)}); "
                "score caches with the same columns together"
            )
    check_compatible(provenances)
    return first_schema, resolved, rows


def policy_source(files: list[Location]) -> dict[str, Any]:
    """Where the caches' policy logprobs come from: the rollouts (a sampler), or a model that `klpipe precompute
    --policy` ran (open_caches has checked that every cache agrees)."""
    provenance = read_provenance(files[0]) if files else None
    if provenance is None or provenance.policy_model is None:
        return {"computed": False}
    return {"computed": True, "model": provenance.policy_model, "revision": provenance.policy_revision,
            "dtype": provenance.policy_dtype}


def read_batches(files: list[Location], batch_tokens: int, batch_bytes: int, columns: ColumnMap,
                 only: list[str] | None = None) -> Iterator[tuple[pa.RecordBatch, RowLocator]]:
    """(record batch, where its rows come from), across all inputs in order; with `only`, those columns alone.

    A page that fails its checksum, or a file that cannot be decoded, stops the run naming the file:
    nothing computed from it is ever written.
    """
    policy, id_column = columns.name(POLICY_LOGPROBS), columns.name(ID)
    for path in files:
        try:
            with open_parquet(path) as reader:
                first_index = 0
                size = rows_per_batch(reader, batch_tokens, batch_bytes, policy)
                for batch in reader.iter_batches(batch_size=size, columns=only):
                    ids = batch.column(id_column) if id_column in batch.schema.names else None
                    yield batch, RowLocator(path, first_index, ids)
                    first_index += batch.num_rows
        except (OSError, pa.ArrowException) as exc:
            raise store_failure(path, exc) or InputError(
                f"{path}: corrupt or unreadable ({first_line(exc)}); nothing was written from it") from None


def rows_per_batch(reader: pq.ParquetFile, batch_tokens: int, batch_bytes: int,
                   policy_column: str = POLICY_LOGPROBS) -> int:
    """Rows that hold about `batch_tokens` tokens and at most `batch_bytes` bytes, from the file's means.

    The token budget alone would let a pass-through column of wide rows (documents, images) make
    one record batch of gigabytes.
    """
    metadata = reader.metadata
    groups = [metadata.row_group(g) for g in range(metadata.num_row_groups)]
    column = leaf_index(reader.schema_arrow, policy_column)
    rows = max(1, metadata.num_rows)
    mean_tokens = max(1.0, sum(g.column(column).num_values for g in groups) / rows)
    mean_bytes = max(1.0, sum(g.total_byte_size for g in groups) / rows)  # uncompressed, every column
    return max(1, int(min(batch_tokens / mean_tokens, batch_bytes / mean_bytes)))


def check_batch(batch: pa.RecordBatch, rows: RowLocator, has_steps: bool, columns: ColumnMap,
                kl_from_sampler: bool = False) -> Logprobs:
    """Refuse a batch with a null, a row whose two logprob lists differ in length, or a non-finite reward.

    With a sampler_logprobs column its values come along (read_sampler); with `kl_from_sampler` the KL reads
    them, and a null, a length that differs or a non-finite value there is refused like the policy's.
    """
    policy_name, ref_name, reward_name, step_name = (
        columns.name(role) for role in (POLICY_LOGPROBS, REF_LOGPROBS, REWARD, STEP)
    )
    policy = batch.column(policy_name)
    ref = batch.column(ref_name)
    for name in (reward_name, policy_name, ref_name) + ((step_name,) if has_steps else ()):
        i = first_null(batch.column(name))
        if i is not None:
            raise InputError(f"{rows.name(i)}: {name} is null")
    policy_values, offsets = list_values(policy)
    ref_values, ref_offsets = list_values(ref)
    if not np.array_equal(offsets, ref_offsets):
        i = int(np.flatnonzero(np.diff(offsets) != np.diff(ref_offsets))[0])
        raise InputError(
            f"{rows.name(i)}: {policy_name} has {offsets[i + 1] - offsets[i]} tokens but {ref_name} has "
            f"{ref_offsets[i + 1] - ref_offsets[i]}; both must cover the same response tokens "
            "(rerun `klpipe precompute` with the policy's tokenization)"
        )
    mask_name = columns.name(MASK)
    keep = None
    if mask_name in batch.schema.names:
        # The values at a 0 are never read: TRL writes 0.0 there, others NaN, precompute a null.
        keep = read_mask(batch.column(mask_name), np.diff(offsets), mask_name, policy_name, rows.name)
    for name, array in ((policy_name, policy), (ref_name, ref)):
        i = _first_null_kept(array, keep, offsets)
        if i is not None:
            where = " where the mask is 1" if keep is not None else ""
            raise InputError(f"{rows.name(i)}: {name} holds a null{where}")
    reward = numpy_view(batch.column(reward_name)).astype(np.float64, copy=False)
    bad_reward = ~np.isfinite(reward)
    if bad_reward.any():
        i = int(np.flatnonzero(bad_reward)[0])
        raise InputError(f"{rows.name(i)}: {reward_name} is {_describe(reward[i])}")
    sampler_name = columns.name(SAMPLER_LOGPROBS)
    sampler = sampler_ok = None
    if sampler_name in batch.schema.names:
        sampler, sampler_ok = read_sampler(batch.column(sampler_name), offsets)
        if kl_from_sampler:
            _refuse_unusable_sampler(sampler, sampler_ok, keep, offsets, rows, sampler_name, policy_name)
    if keep is None:
        found = Logprobs(policy_values, ref_values, offsets, reward)
    else:
        found = Logprobs(policy_values[keep], ref_values[keep], kept_offsets(keep, offsets), reward, keep, offsets)
    if sampler is not None:
        found.trainer = found.policy
        found.sampler = sampler if keep is None else sampler[keep]
        found.sampler_rows_ok = sampler_ok
        if kl_from_sampler:
            found.policy, found.policy_name = found.sampler, sampler_name
    return found


def read_sampler(array: pa.Array | pa.ChunkedArray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sampler's logprobs aligned with the response tokens of `offsets` (response tokens,) as stored, NaN where
    null or in a row whose list (or null list) has another length; and (rows,) bool, True where the row's does not."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    lengths = np.diff(offsets)
    list_valid = numpy_valid(array) if array.null_count else np.ones(len(array), bool)
    sampler_offsets = numpy_view(array.offsets).astype(np.int64)
    start, end = int(sampler_offsets[0]), int(sampler_offsets[-1])
    flat = array.values.slice(start, end - start)
    values = numpy_view(flat)  # as stored; a float64 copy only where nulls must become NaN
    if flat.null_count:
        values = values.astype(np.float64)
        values[~numpy_valid(flat)] = np.nan
    ok = list_valid & (np.diff(sampler_offsets) == lengths)
    if ok.all():
        return values, ok
    aligned = np.full(int(offsets[-1]), np.nan)
    aligned[np.repeat(ok, lengths)] = values[np.repeat(ok, np.diff(sampler_offsets))]
    return aligned, ok


def _refuse_unusable_sampler(sampler: np.ndarray, ok: np.ndarray, keep: np.ndarray | None, offsets: np.ndarray,
                             rows: RowLocator, name: str, policy_name: str) -> None:
    """--kl-from sampler: the KL reads the sampler's logprobs, so a gap in them is bad input, as in the policy's."""
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        raise InputError(f"{rows.name(i)}: {name} has no list of the response's {offsets[i + 1] - offsets[i]} tokens "
                         f"(as {policy_name} has); --kl-from sampler needs one")
    bad = np.isnan(sampler) if keep is None else np.isnan(sampler) & keep
    if bad.any():
        i = int(np.searchsorted(offsets, np.flatnonzero(bad)[0], side="right") - 1)
        raise InputError(f"{rows.name(i)}: {name} holds a null" + (" where the mask is 1" if keep is not None else ""))


def _first_null_kept(array: pa.Array, keep: np.ndarray | None, offsets: np.ndarray) -> int | None:
    """The row holding the first null value of a list array, among the values `keep` marks (all without it)."""
    if keep is None:
        return first_null_in_lists(array)
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    values = array.flatten()  # honours slicing
    if not values.null_count:
        return None
    nulls = np.flatnonzero(~numpy_valid(values) & keep)
    return None if not len(nulls) else int(np.searchsorted(offsets, nulls[0], side="right") - 1)


def check_finite(estimate: RowKL, logprobs: Logprobs, rows: RowLocator, estimator: str, columns: ColumnMap) -> None:
    """Refuse a non-finite logprob, or a KL that overflows, naming the first such row."""
    # A non-finite logprob makes its row's max |policy − ref| non-finite, so the per-row values
    # (not the tokens) are scanned; the tokens are looked at only to name the culprit.
    bad_rows = ~np.isfinite(estimate.max_abs_diff)
    if bad_rows.any():
        i = int(np.flatnonzero(bad_rows)[0])
        start, stop = logprobs.offsets[i], logprobs.offsets[i + 1]
        named = ((logprobs.policy_name or columns.name(POLICY_LOGPROBS), logprobs.policy),
                 (columns.name(REF_LOGPROBS), logprobs.ref))
        for name, values in named:
            bad = values[start:stop][~np.isfinite(values[start:stop])]
            if bad.size:
                raise InputError(f"{rows.name(i)}: {name} holds {_describe(bad[0])}")
    overflow = ~np.isfinite(estimate.kl)
    if overflow.any():
        i = int(np.flatnonzero(overflow)[0])
        raise InputError(
            f"{rows.name(i)}: the {estimator} KL overflows (|policy − ref| up to {estimate.max_abs_diff[i]:.0f} "
            "nats); the policy and reference almost certainly tokenized differently"
        )


def _check_columns(path: Location, schema: pa.Schema, columns: ColumnMap) -> None:
    policy, ref, reward, step = (columns.name(role) for role in (POLICY_LOGPROBS, REF_LOGPROBS, REWARD, STEP))
    missing = [name for name in (policy, ref, reward) if name not in schema.names]
    if missing:
        if ref in missing:
            hint = "run `klpipe precompute` on it first to add the reference logprobs"
        elif policy in missing:
            hint = ("the rollouts must carry the sampling policy's per-token logprobs, or `klpipe precompute --policy "
                    "MODEL` computes them")
        else:
            hint = "add each rollout's reward before scoring"
        raise InputError(f"{path}: no {' or '.join(missing)} column; {hint}")
    for name in (policy, ref):
        kind = schema.field(name).type
        if not (is_list_type(kind) and pa.types.is_floating(kind.value_type)):
            raise InputError(f"{path}: {name} must be a list of floats, got {kind}")
    reward_type = schema.field(reward).type
    if not (pa.types.is_floating(reward_type) or pa.types.is_integer(reward_type)):
        raise InputError(f"{path}: {reward} must be numeric, got {reward_type}")
    sampler = columns.name(SAMPLER_LOGPROBS)
    if sampler in schema.names:
        kind = schema.field(sampler).type
        if not (is_list_type(kind) and pa.types.is_floating(kind.value_type)):
            raise InputError(f"{path}: {sampler} must be a list of floats, got {kind}")
    if columns.name(MASK) in schema.names:
        check_mask_type(path, schema, columns.name(MASK))
    if step in schema.names:
        step_type = schema.field(step).type
        if not (pa.types.is_integer(step_type) or pa.types.is_string(step_type) or pa.types.is_large_string(step_type)):
            raise InputError(f"{path}: {step} must be an integer or a string, got {step_type}")


def _describe(value: float) -> str:
    return "NaN" if math.isnan(value) else ("+inf" if value > 0 else "-inf")
