"""`<output>.partial/`: a precompute run's work directory, the one place its resume state lives.

It holds `run.json` (what the run is: rows, chunk size, mode, provenance), a lock file that keeps
a second run off the same output, and one parquet file per finished chunk. Chunk files appear
atomically, so a kill at any point leaves only whole chunks; a rerun with the same `run.json`
skips them, and the merge turns them into the output.

It is always on local disk: beside a local output by default, as `<output>.partial/`; under
`--work-dir` when given; and for an output on a store (s3://...) under KLPIPE_CACHE_DIR/work,
where the merged cache is also written before it is uploaded. Away from its output, its name
carries a hash of the output's full path or URI, so outputs of one name never share one.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa

from klpipe import cache
from klpipe.arrow import list_array, offsets_from_lengths
from klpipe.errors import InputError, OutputError, ProvenanceError, first_line
from klpipe.mask import MASK_TYPE
from klpipe.precompute import trainer_batches
from klpipe.precompute.rollouts import BATCH, CHAT, TEXT, TOKEN_ID_TYPE, Rollouts
from klpipe.precompute.tokenize import TokenizedChunk
from klpipe.storage.atomic import atomic_output
from klpipe.storage.fingerprint import cache_dir
from klpipe.storage.lock import RunLock
from klpipe.storage.parquet import open_parquet, parquet_writer, write_batch_rows, write_table
from klpipe.storage.store import Location, identity, is_remote

CHUNK_PATTERN = "chunk-{:08d}.parquet"


def default_work_root() -> Path:
    """Where the work directories of outputs on a store go when --work-dir is not given."""
    return cache_dir() / "work"


def work_path(output: Location, work_root: Path | None = None) -> Path:
    """The work directory of `output`: `<output>.partial/` beside a local output unless `work_root` is given;
    else `<work_root or KLPIPE_CACHE_DIR/work>/<output name>.<hash of its full path or URI>.partial/`."""
    if work_root is None and not is_remote(output):
        return output.with_name(output.name + ".partial")
    root = work_root if work_root is not None else default_work_root()
    digest = hashlib.sha256(identity(output).encode()).hexdigest()[:12]
    return Path(root) / f"{output.name}.{digest}.partial"


class WorkDir:
    """`<output>.partial/`: the run description, a lock, and one parquet file per finished chunk."""

    def __init__(self, output: Location, provenance: cache.Provenance, rollouts: Rollouts, rows: tuple[int, int],
                 overwrite: bool = False, work_root: Path | None = None, overwrite_policy: bool = False):
        self.output = output
        self.overwrite = overwrite  # discard another run's work directory instead of refusing
        self.path = work_path(output, work_root)
        # Temporary files of the outputs (the merged cache, a shard's marker): in the work directory, so
        # a kill leaves none beside the outputs, where it can be renamed into place (beside a local
        # output) or is staged for the upload (an output on a store); beside a local output whose work
        # directory --work-dir moved, perhaps to another filesystem.
        self.output_tmp_dir = self.path if is_remote(output) or work_root is None else None
        self.provenance = provenance
        self.run = {  # run.json: a rerun resumes these chunks only if every field is the same
            "provenance": json.loads(provenance.to_json()),
            "rows": list(rows),
            "mode": rollouts.mode,
        }
        self.ref_logprobs = rollouts.columns.name(cache.REF_LOGPROBS)  # the column written
        self.mask_column = rollouts.columns.name(cache.MASK)  # written for conversational rows that have none
        self.policy_logprobs = rollouts.columns.name(cache.POLICY_LOGPROBS)  # written with --policy
        # --policy on rollouts whose policy_logprobs are the sampler's: the cache keeps them under this name.
        self.sampler_rename = None
        if provenance.sampler_source is not None and provenance.sampler_source == self.policy_logprobs:
            self.sampler_rename = rollouts.columns.name(cache.SAMPLER_LOGPROBS)
        self.output_schema = self._output_schema(rollouts, overwrite_policy)
        self._lock: RunLock | None = None

    def _output_schema(self, rollouts: Rollouts, overwrite_policy: bool) -> pa.Schema:
        schema = rollouts.schema
        if rollouts.mode in (TEXT, CHAT):  # the ids they tokenized are written
            for name in (rollouts.columns.name(cache.PROMPT_IDS), rollouts.columns.name(cache.RESPONSE_IDS)):
                if name in schema.names:
                    schema = schema.set(schema.get_field_index(name), pa.field(name, TOKEN_ID_TYPE))
                else:
                    schema = schema.append(pa.field(name, TOKEN_ID_TYPE))
        if rollouts.mode == BATCH:  # the batch's attended tokens, mask, logprobs and reward (trainer_batches.py)
            assert rollouts.batch is not None  # open_rollouts names the batch's kind with mode BATCH
            derived = trainer_batches.derived_fields(rollouts.batch, schema)
            if self.provenance.policy_model is not None and cache.POLICY_LOGPROBS in [f.name for f in derived]:
                raise InputError(f"{rollouts.files[0].path}: the batch carries the policy's logprobs; --policy "
                                 "computes them for rows that have none")
            for derived_field in derived:
                schema = schema.append(derived_field)
        mask = rollouts.columns.name(cache.MASK)
        if rollouts.mode == CHAT and mask not in schema.names:  # the mask the conversation's roles give
            schema = schema.append(pa.field(mask, MASK_TYPE))
        if self.ref_logprobs in schema.names:
            raise InputError(f"{rollouts.files[0].path}: already has a {self.ref_logprobs} column; "
                             "is this a cache? precompute reads rollouts")
        schema = schema.append(pa.field(self.ref_logprobs, cache.REF_LOGPROBS_TYPE))
        if self.provenance.policy_model is not None:  # --policy: its logprobs, as the reference's
            policy = rollouts.columns.name(cache.POLICY_LOGPROBS)
            if self.sampler_rename is not None:  # the rollouts' policy_logprobs are the sampler's: kept, renamed
                if self.sampler_rename in schema.names:
                    raise InputError(f"{rollouts.files[0].path}: has both {policy} (the sampler's logprobs, which the "
                                     f"cache keeps as {self.sampler_rename}) and a {self.sampler_rename} column; map "
                                     f"the sampler's with --column {cache.SAMPLER_LOGPROBS}=NAME, or pass "
                                     "--overwrite-policy-logprobs to drop them")
                index = schema.get_field_index(policy)
                schema = schema.set(index, schema.field(index).with_name(self.sampler_rename))
            elif policy in rollouts.schema.names and not overwrite_policy:
                raise InputError(f"{rollouts.files[0].path}: already has a {policy} column; pass "
                                 f"--overwrite-policy-logprobs to replace it with {self.provenance.policy_model}'s, "
                                 f"or write them under another name with --column {cache.POLICY_LOGPROBS}=NAME")
            if policy in schema.names:
                schema = schema.remove(schema.get_field_index(policy))
            schema = schema.append(pa.field(policy, cache.REF_LOGPROBS_TYPE))
        added = [(name, cache.REF_LOGPROBS_TYPE) for name in self.extra_columns if name in cache.FULL_KL_COLUMNS]
        if self.provenance.ref_topk:
            added += [(cache.REF_TOPK_IDS, cache.REF_TOPK_IDS_TYPE),
                      (cache.REF_TOPK_LOGPROBS, cache.REF_TOPK_LOGPROBS_TYPE)]
        for name, kind in added:
            if name in schema.names:
                raise InputError(f"{rollouts.files[0].path}: already has a {name} column, which this run writes")
            schema = schema.append(pa.field(name, kind))
        return cache.schema_with_provenance(schema, self.provenance)

    @property
    def extra_columns(self) -> tuple[str, ...]:
        """The joint head's columns this run writes (precompute/scorer.py), in the cache's order."""
        return (cache.FULL_KL_COLUMNS if self.provenance.full_kl else ()) + (
            (cache.REF_TOPK_IDS, cache.REF_TOPK_LOGPROBS) if self.provenance.ref_topk else ())

    def locked(self):
        return _Locked(self)

    def _acquire(self) -> None:
        lock = RunLock(self.path / "lock")
        try:
            taken = lock.acquire()  # at once or not at all: the other run may take hours
        except OSError as exc:
            raise OutputError(f"{self.path}: cannot create the work directory ({exc.strerror or exc})") from None
        if not taken:
            holder = lock.holder()
            raise OutputError(f"another klpipe run is writing {self.output} (lock held on {lock.path}"
                              + (f" by {holder})" if holder else ")"))
        self._lock = lock
        try:
            self._check_run_file()
        except BaseException:
            self._release()  # __exit__ will not run when __enter__ fails
            raise

    def _check_run_file(self) -> None:
        run_file = self.path / "run.json"
        if run_file.exists():
            try:
                previous = json.loads(run_file.read_text())
            except ValueError:
                previous = None
            if previous != self.run and not self.overwrite:
                raise ProvenanceError(
                    f"{self.path} holds work from a different run ({_run_difference(previous, self.run)}); "
                    "rerun the original command, or pass --overwrite to start over"
                )
            if previous != self.run:  # --overwrite: that run's chunks are of no use to this one
                for stale in self.path.glob("chunk-*.parquet"):
                    stale.unlink()
                run_file.unlink()
        if not run_file.exists():
            with atomic_output(run_file) as tmp:
                tmp.write_text(json.dumps(self.run, indent=2, sort_keys=True))

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()  # the file goes with the work directory
            self._lock = None

    def finished_chunks(self) -> set[int]:
        return {int(p.stem.split("-")[1]) for p in self.path.glob("chunk-*.parquet")}

    def write_chunk(self, tokenized: TokenizedChunk, logprobs: list[np.ndarray],
                    policy_logprobs: list[np.ndarray] | None = None,
                    extra: dict[str, list[np.ndarray]] | None = None) -> None:
        """Checkpoint a chunk: its rows, the reference's logprobs and, with --policy, the policy's; `extra`: the joint
        head's columns by name (a value per token, or K of them for the top-k's)."""
        column = _logprobs_column(logprobs, tokenized.mask)  # cache.REF_LOGPROBS_TYPE
        table = tokenized.table
        if policy_logprobs is not None:
            if self.sampler_rename is not None:  # the sampler's, kept beside the policy's computed ones
                table = table.rename_columns([self.sampler_rename if name == self.policy_logprobs else name
                                              for name in table.column_names])
            elif self.policy_logprobs in table.column_names:  # --overwrite-policy-logprobs
                table = table.drop_columns([self.policy_logprobs])
        if tokenized.derived_mask:
            assert tokenized.mask is not None  # a derived mask is a mask
            table = table.append_column(self.mask_column,
                                        list_array(tokenized.response_offsets, tokenized.mask.astype(np.int8)))
        table = table.append_column(self.ref_logprobs, column)
        if policy_logprobs is not None:
            table = table.append_column(self.policy_logprobs, _logprobs_column(policy_logprobs, tokenized.mask))
        for name in self.extra_columns:
            values = (extra or {})[name]  # a missing column is a klpipe bug: never a chunk without it
            if name in _TOPK:
                assert self.provenance.ref_topk is not None  # the top-k's columns are extra only with --ref-topk
                column = _topk_column(values, tokenized.mask, self.provenance.ref_topk)
            else:
                column = _logprobs_column(values, tokenized.mask)
            table = table.append_column(name, column)
        table = table.cast(self.output_schema)
        path = self.path / CHUNK_PATTERN.format(tokenized.chunk.index)
        with atomic_output(path) as tmp:
            write_table(table, tmp)

    def merge_into(self, output: Location) -> None:
        chunks = sorted(self.path.glob("chunk-*.parquet"))
        expected = self.run["rows"][1] - self.run["rows"][0]
        with atomic_output(output, tmp_dir=self.output_tmp_dir) as tmp:
            rows = 0
            writer = None  # opened at the first chunk, whose rows' width sets the pages' write batch
            try:
                for path in chunks:
                    # One chunk in memory at a time, and each chunk stays one row group of the cache.
                    for table in _row_groups(path):
                        table = table.cast(self.output_schema)
                        rows += table.num_rows
                        if writer is None:
                            writer = parquet_writer(tmp, self.output_schema, write_batch_rows(table))
                        writer.write_table(table)
                        del table  # this chunk is written: the next one is read beside none
                if writer is None:  # no chunks: an empty cache
                    writer = parquet_writer(tmp, self.output_schema)
            finally:
                if writer is not None:
                    writer.close()
            if rows != expected:  # a guard against a lost or duplicated chunk, never expected to fire
                raise OutputError(f"{self.path}: chunks hold {rows} rows, expected {expected}; delete it and rerun")

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def remove_if_finished(self) -> None:
        """Remove a work directory left behind by a run whose output is in place, under its lock."""
        if not self.path.is_dir():
            return
        try:
            with self.locked():  # refuses if another run holds it, and checks run.json matches
                self.remove()
        except (OutputError, ProvenanceError):
            pass  # another run's, or another command's: not ours to delete


def _logprobs_column(logprobs: list[np.ndarray], mask: np.ndarray | None) -> pa.Array:
    """A list<float32> column of per-row logprobs, null where the mask is 0 (nothing was computed there)."""
    offsets = offsets_from_lengths([len(x) for x in logprobs])
    values = np.concatenate(logprobs).astype(np.float32, copy=False) if logprobs else np.zeros(0, np.float32)
    return list_array(offsets, values, valid=mask)


_TOPK = (cache.REF_TOPK_IDS, cache.REF_TOPK_LOGPROBS)


def _topk_column(values: list[np.ndarray], mask: np.ndarray | None, k: int) -> pa.Array:
    """A list<list<...>> column of per-row (tokens, k) arrays: per token its k values, null where the mask is 0."""
    offsets = offsets_from_lengths([len(x) for x in values])
    flat = np.concatenate(values) if values else np.zeros((0, k))  # (tokens, k)
    kind = np.int32 if flat.dtype.kind == "i" else np.float32
    inner = pa.ListArray.from_arrays(pa.array(np.arange(0, flat.size + 1, k, dtype=np.int32)),
                                     pa.array(flat.astype(kind, copy=False).reshape(-1)),
                                     mask=None if mask is None else pa.array(~mask.astype(bool)))
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32, copy=False)), inner)


def _row_groups(path: Path):
    """A checkpoint's row groups, each verified against its page checksums on the way."""
    try:
        with open_parquet(path) as chunk:
            for group in range(chunk.num_row_groups):
                yield chunk.read_row_group(group)
    except (OSError, pa.ArrowException) as exc:
        # A checkpoint damaged on disk since it was written: never merged, recomputed once removed.
        raise OutputError(f"{path}: a damaged checkpoint ({first_line(exc)}); delete this file and rerun "
                          "to compute its chunk again") from None


class _Locked:
    def __init__(self, work: WorkDir):
        self.work = work

    def __enter__(self):
        self.work._acquire()
        return self.work

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None and not self.work.finished_chunks():
            # Nothing worth resuming: leave no trace of a run that failed before its first chunk.
            # Removed while still locked, so no other run can start in between.
            self.work.remove()
        self.work._release()


def _run_difference(previous: dict | None, current: dict) -> str:
    """Every way `previous` (a run.json) differs from this run's, said for a person."""
    if not isinstance(previous, dict):
        return "unreadable run.json"
    found = [f"{key} {previous.get(key)!r} → {current.get(key)!r}" for key in ("rows", "mode")
             if previous.get(key) != current.get(key)]
    try:
        before = cache.Provenance(**previous.get("provenance", {}))
    except TypeError:
        return "; ".join(found + ["a run.json from another klpipe version"])
    found += before.differences(cache.Provenance(**current["provenance"]))
    return "; ".join(found) or "settings differ"
