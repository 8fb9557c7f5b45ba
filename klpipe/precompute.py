"""Stage 1: stream rollouts through the reference model into a per-token logprob cache.

Data flow: rollouts.iter_chunks -> ChunkTokenizer (in a reader thread) -> logprobs.chunk_logprobs
(shared prompts run once, other rows batched per row) -> one checkpoint file per chunk -> merged
cache, renamed into place.

Resume: finished chunks live in `<output>.partial/` with a `run.json` describing the run. A rerun
of the same command skips them; the chunk plan is deterministic, so the merged output is
identical to an uninterrupted run. The work directory is removed once the output is in place.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from klpipe import __version__, cache
from klpipe.errors import InputError, ModelError, OutputError, ProvenanceError
from klpipe.files import atomic_output, fingerprint, write_json_atomic
from klpipe.logprobs import SHARING_MODES, ForwardStats, chunk_logprobs
from klpipe.progress import Progress, peak_memory
from klpipe.rollouts import ChunkTokenizer, Rollouts, TokenizedChunk, chunk_sizes, iter_chunks, open_rollouts
from klpipe.sharding import Shard
from klpipe.signals import StopOnSignal
from klpipe.threads import prefetch

CHUNK_PATTERN = "chunk-{:08d}.parquet"


@dataclass
class PrecomputeConfig:
    inputs: list[Path]  # parquet / JSON Lines files, save_to_disk dirs, or directories of files
    output: Path
    model: str  # hub id or local directory
    revision: str | None = None
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"
    temperature: float = 1.0  # the rollout sampling temperature: logits / T before the softmax
    max_tokens_per_batch: int | None = None  # padded tokens per forward pass; None: by device
    chunk_rows: int = 2048  # rows per checkpoint, also the window rows are length-sorted in
    prefix_sharing: str = "auto"  # auto: run a prompt once for the rows of a chunk that repeat it | on | off
    trust_remote_code: bool = False
    overwrite: bool = False  # replace an existing output made by a different run
    progress: str = "auto"  # auto (bar on a terminal, log lines otherwise) | bar | log | none
    log_interval: float = 30.0  # seconds between progress log lines
    shard: Shard | None = None  # set: `output` is a directory and this run writes one part of it


@dataclass
class PrecomputeSummary:
    output: Path
    rows: int = 0
    tokens: int = 0  # response tokens scored in this run
    forward: ForwardStats = field(default_factory=ForwardStats)  # what the model was fed
    prefix_sharing: str = "off"  # the mode in force after the load-time probe
    seconds: float = 0.0  # scoring time, model loading excluded
    load_seconds: float = 0.0
    resumed_chunks: int = 0
    skipped: bool = False  # output already complete: nothing to do
    peak_memory: dict = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def padding_efficiency(self) -> float:
        return self.forward.padding_efficiency


def default_max_tokens(device: str) -> int:
    # CPU: measured fastest on 2 cores (make bench): larger batches spill activations out of cache.
    return 65536 if device.startswith("cuda") else 2048


def precompute(config: PrecomputeConfig, log=print) -> PrecomputeSummary:
    from klpipe import reference  # torch lives behind this import

    if config.temperature <= 0:
        raise InputError("--temperature must be positive")
    if config.chunk_rows < 1:
        raise InputError("--chunk-rows must be at least 1")
    if config.max_tokens_per_batch is not None and config.max_tokens_per_batch < 1:
        raise InputError("--max-tokens-per-batch must be at least 1")
    if config.prefix_sharing not in SHARING_MODES:
        raise InputError(f"--prefix-sharing must be auto, on or off, not {config.prefix_sharing!r}")
    started = time.perf_counter()
    rollouts = open_rollouts(config.inputs)  # schema and mode checks before anything heavy
    shard = config.shard
    rows = shard.rows(rollouts.num_rows, config.chunk_rows) if shard else (0, rollouts.num_rows)
    output = shard.part_path(config.output) if shard else config.output
    marker = shard.marker_path(config.output) if shard else None
    if shard and config.output.is_file():
        raise OutputError(f"{config.output} is a file; a sharded run writes its part into an output directory")
    spec = reference.ModelSpec(
        name=config.model, revision=config.revision, dtype=config.dtype,
        device=config.device, trust_remote_code=config.trust_remote_code,
    )
    model_config = reference.load_config(spec)
    tokenizer = reference.load_tokenizer(spec)
    device, _ = reference.resolve_device(spec.device)
    dtype = reference.resolve_dtype(spec.dtype, device)
    provenance = cache.Provenance(
        model=config.model,
        revision=reference.weights_fingerprint(spec, model_config),
        tokenizer=reference.tokenizer_fingerprint(tokenizer),
        dtype=str(dtype).removeprefix("torch."),
        temperature=float(config.temperature),
        klpipe_version=__version__,
        inputs=[fingerprint(f.path) for f in rollouts.files],
        shard={"index": shard.index, "count": shard.count, "rows": list(rows)} if shard else None,
    )
    summary = PrecomputeSummary(output=output)
    what = f"shard {shard.index} of {shard.count} ({output})" if shard else str(output)

    if output.exists() and (marker is None or marker.exists()):
        existing = cache.read_provenance(output) if output.is_file() else None
        if existing is not None and _same_run(existing, provenance):
            log(f"{what} is already complete for these inputs and this model; nothing to do")
            summary.skipped = True
            # A kill between the final rename and the cleanup leaves the finished work directory.
            WorkDir(output, config.chunk_rows, provenance, rollouts, rows).remove_if_finished()
            return summary
        if not config.overwrite:
            raise OutputError(f"{output} exists and was made by a different run; pass --overwrite to replace it")
    if marker is not None:
        marker.unlink(missing_ok=True)  # a part is complete only once its marker is rewritten

    vocab_size, max_positions = reference.vocab_and_context(model_config)
    tokenize = ChunkTokenizer(rollouts, tokenizer, vocab_size, max_positions)
    work = WorkDir(output, config.chunk_rows, provenance, rollouts, rows, overwrite=config.overwrite)
    with work.locked(), StopOnSignal(log) as stop:
        done = work.finished_chunks()
        sizes = chunk_sizes(rows, config.chunk_rows)
        if len(done) < len(sizes):
            # Validate every row before loading gigabytes of weights: a bad row at the end of the
            # input should fail in seconds, not after hours of compute.
            for chunk in iter_chunks(rollouts, config.chunk_rows, skip=done, rows=rows):
                tokenize(chunk)
                stop.check()
            load_started = time.perf_counter()
            model = reference.ReferenceModel.load(spec)
            summary.load_seconds = time.perf_counter() - load_started
            max_tokens = config.max_tokens_per_batch or default_max_tokens(model.device)
            summary.prefix_sharing = _sharing_mode(model, config.prefix_sharing, log)
            summary.resumed_chunks = len(done)
            if done:
                log(f"resuming: {len(done)} of {len(sizes)} chunks already done in {work.path}")
            progress = Progress(config.progress, total_rows=rows[1] - rows[0],
                                initial_rows=sum(sizes[i] for i in done), log=log, interval=config.log_interval)
            compute_started = time.perf_counter()
            try:
                chunks = iter_chunks(rollouts, config.chunk_rows, skip=done, rows=rows)
                # Reading and tokenizing the next chunks overlaps with the model's work on this one.
                for tokenized in prefetch(map(tokenize, chunks)):
                    logprobs = chunk_logprobs(model, tokenized, max_tokens, config.temperature,
                                              summary.prefix_sharing, summary.forward, stop.check)
                    work.write_chunk(tokenized, logprobs)
                    response_tokens = int(tokenized.response_lengths().sum())
                    summary.rows += tokenized.num_rows
                    summary.tokens += response_tokens
                    progress.update(tokenized.num_rows, response_tokens)
                    stop.check()
            finally:
                progress.close()
                summary.seconds = time.perf_counter() - compute_started
        work.merge_into(output)
        summary.peak_memory = peak_memory()
        if marker is not None:
            # Its temporary file goes in the work dir, which the next line removes even after a kill.
            write_json_atomic(marker, {"rows": rows[1] - rows[0], "provenance": json.loads(provenance.to_json())},
                              tmp_dir=work.path)
        work.remove()
    if not summary.seconds:
        summary.seconds = time.perf_counter() - started
    return summary


def _sharing_mode(model, asked: str, log) -> str:
    """The prefix-sharing mode to run with: `asked`, unless the model cannot continue a KV cache exactly."""
    if asked == "off":
        return "off"
    problem = model.check_prefix_sharing()
    if problem is None:
        return asked
    if asked == "on":
        raise ModelError(f"--prefix-sharing on: {type(model.model).__name__} cannot share prompts exactly ({problem})")
    log(f"prefix sharing off: {type(model.model).__name__} cannot share prompts exactly ({problem})")
    return "off"


def _same_run(a: cache.Provenance, b: cache.Provenance) -> bool:
    return a.identity() == b.identity() and a.inputs == b.inputs


class WorkDir:
    """`<output>.partial/`: the run description, a lock, and one parquet file per finished chunk."""

    def __init__(self, output: Path, chunk_rows: int, provenance: cache.Provenance, rollouts: Rollouts,
                 rows: tuple[int, int], overwrite: bool = False):
        self.output = output
        self.overwrite = overwrite  # discard another run's work directory instead of refusing
        self.path = output.with_name(output.name + ".partial")
        self.provenance = provenance
        self.run = {
            "chunk_rows": chunk_rows,
            "provenance": json.loads(provenance.to_json()),
            "rows": list(rows),
            "mode": rollouts.mode,
        }
        self.output_schema = self._output_schema(rollouts)
        self._lock_file = None

    def _output_schema(self, rollouts: Rollouts) -> pa.Schema:
        schema = rollouts.schema
        if rollouts.mode == "text":
            from klpipe.rollouts import TOKEN_ID_TYPE

            for name in (cache.PROMPT_IDS, cache.RESPONSE_IDS):
                if name in schema.names:
                    schema = schema.set(schema.get_field_index(name), pa.field(name, TOKEN_ID_TYPE))
                else:
                    schema = schema.append(pa.field(name, TOKEN_ID_TYPE))
        if cache.REF_LOGPROBS in schema.names:
            raise InputError(f"{rollouts.files[0].path}: already has a {cache.REF_LOGPROBS} column; "
                             "is this a cache? precompute reads rollouts")
        schema = schema.append(pa.field(cache.REF_LOGPROBS, cache.REF_LOGPROBS_TYPE))
        return cache.schema_with_provenance(schema, self.provenance)

    def locked(self):
        return _Locked(self)

    def _acquire(self) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock_file = open(self.path / "lock", "w")
        except OSError as exc:
            raise OutputError(f"{self.path}: cannot create the work directory ({exc.strerror or exc})") from None
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            self._lock_file = None
            raise OutputError(f"another klpipe run is writing {self.output} (lock held on {self.path / 'lock'})") from None
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
        if self._lock_file is not None:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None

    def finished_chunks(self) -> set[int]:
        return {int(p.stem.split("-")[1]) for p in self.path.glob("chunk-*.parquet")}

    def write_chunk(self, tokenized: TokenizedChunk, logprobs: list[np.ndarray]) -> None:
        lengths = np.fromiter((len(x) for x in logprobs), dtype=np.int64, count=len(logprobs))
        offsets = np.zeros(len(logprobs) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        values = np.concatenate(logprobs).astype(np.float32, copy=False) if len(logprobs) else np.zeros(0, np.float32)
        column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, pa.float32()))
        table = tokenized.table.append_column(cache.REF_LOGPROBS, column)
        table = table.cast(self.output_schema)
        path = self.path / CHUNK_PATTERN.format(tokenized.chunk.index)
        with atomic_output(path) as tmp:
            pq.write_table(table, tmp)

    def merge_into(self, output: Path) -> None:
        chunks = sorted(self.path.glob("chunk-*.parquet"))
        expected = self.run["rows"][1] - self.run["rows"][0]
        with atomic_output(output, tmp_dir=self.path) as tmp:
            rows = 0
            with pq.ParquetWriter(tmp, self.output_schema) as writer:
                for path in chunks:
                    table = pq.read_table(path).cast(self.output_schema)
                    rows += table.num_rows
                    writer.write_table(table)
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
    if not isinstance(previous, dict):
        return "unreadable run.json"
    for key in ("chunk_rows", "rows", "mode"):
        if previous.get(key) != current.get(key):
            return f"{key} {previous.get(key)!r} vs {current.get(key)!r}"
    before, now = previous.get("provenance", {}), current["provenance"]
    for key in ("model", "revision", "tokenizer", "dtype", "temperature", "inputs", "klpipe_version"):
        if before.get(key) != now.get(key):
            return f"{'input files changed' if key == 'inputs' else key + ' differs'}"
    return "settings differ"
