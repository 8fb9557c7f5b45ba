"""`klpipe score`: stream cached logprobs through the KL controller into penalised rewards.

Rows flow reader → KL math → controller → writer one record batch at a time. Memory is bounded by
a few record batches (`batch_tokens` and at most `batch_bytes` each) and three output row groups
(`row_group_bytes` each: one filling, one queued, one being written), plus 8 bytes per row of
per-row KL for the run's percentiles and histogram.

Controller batches are runs of consecutive rows with the same `step`. A step may span record
batches and input files: its rows are written as they arrive, all with the coefficient in force
when the step began, and the controller updates once the step ends. So nothing but that step's
per-row KLs is held back.
"""

from __future__ import annotations

import json
import math
import time
from contextlib import closing
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from klpipe import __version__, report
from klpipe.arrow import first_null, first_null_in_lists, from_numpy, is_list_type, list_array, list_values, numpy_view
from klpipe.cache import (
    ID,
    POLICY_LOGPROBS,
    REF_LOGPROBS,
    REWARD,
    STEP,
    check_compatible,
    expand_cache_inputs,
    read_provenance,
)
from klpipe.controller import ControllerConfig, KLController
from klpipe.errors import InputError, OutputError, StateError
from klpipe.files import atomic_output, open_parquet, schema_difference, write_json_atomic
from klpipe.kl import AGGREGATES, ESTIMATORS, Aggregate, Estimator, RowKL, row_kl
from klpipe.rows import RowLocator
from klpipe.threads import in_background, prefetch

# Columns score adds to every row.
KL = "kl"
KL_COEFF = "kl_coeff"
KL_PENALTY = "kl_penalty"
ADJUSTED_REWARD = "adjusted_reward"
KL_PER_TOKEN = "kl_per_token"  # only with per_token
SCORED_COLUMNS = (KL, KL_COEFF, KL_PENALTY, ADJUSTED_REWARD, KL_PER_TOKEN)

# Output schema-metadata key with the settings a scored file was made with.
SCORE_METADATA_KEY = b"klpipe_score"

# Default output name beside the first input: cache.parquet → cache.scored.parquet.
OUTPUT_SUFFIX = ".scored.parquet"

# Extreme-row warnings name at most this many rows; the report counts them all.
EXTREME_ROWS_NAMED = 10


@dataclass
class ScoreConfig:
    """One scoring run: inputs, outputs, the KL estimate and the controller."""

    inputs: list[Path]  # cache files or directories of them, scored in the order given
    output: Path | None = None  # None: <first input's stem>.scored.parquet beside the first input
    report: Path | None = None  # report JSON, written atomically
    state: Path | None = None  # controller state JSON: loaded when it exists, saved at the end
    plot: Path | None = None  # three-panel PNG (needs matplotlib)
    per_token: bool = False  # also write each row's per-token KL list
    reset_state: bool = False  # ignore an existing state file and start from this config
    estimator: Estimator = "k1"  # per-token estimator: k1 | abs | k2 | k3
    aggregate: Aggregate = "mean"  # per-row aggregate over response tokens: mean | sum
    clamp: bool = True  # clamp the per-row k1 at 0, as the seed does (other estimators are never negative)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    extreme_nats: float = 20.0  # warn about rows with a token whose |policy − ref| exceeds this
    batch_tokens: int = 1 << 21  # tokens per record batch read and scored; each costs ~24 bytes in flight
    batch_bytes: int = 16 << 20  # and at most this many input bytes (uncompressed) per record batch: wide columns
    row_group_bytes: int = 32 << 20  # output row groups of about this size: big ones write faster and read better

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise InputError(f"unknown estimator {self.estimator!r}; choose one of {', '.join(ESTIMATORS)}")
        if self.aggregate not in AGGREGATES:
            raise InputError(f"unknown aggregate {self.aggregate!r}; choose one of {', '.join(AGGREGATES)}")
        if self.batch_tokens < 1:
            raise InputError(f"batch_tokens must be at least 1, got {self.batch_tokens}")
        if self.batch_bytes < 1:
            raise InputError(f"batch_bytes must be at least 1, got {self.batch_bytes}")


@dataclass
class ScoreResult:
    """What a run wrote and found; `report` is also what `--report` holds."""

    output: Path
    report: dict
    warnings: list[str]


def default_output(first_input: Path) -> Path:
    """<stem>.scored.parquet beside the first input (a directory's name is its stem)."""
    first_input = Path(first_input)
    stem = first_input.name if first_input.is_dir() else first_input.name.removesuffix(".parquet")
    return first_input.parent / f"{stem}{OUTPUT_SUFFIX}"


def score(config: ScoreConfig) -> ScoreResult:
    """Score the caches in `config.inputs` and write the output, report, plot and state it asks for.

    Either everything asked for is written or, on an error, nothing is: the output, report and
    plot appear atomically, and the state file, written last, is only advanced by a run that
    finished.
    """
    started = time.perf_counter()
    if not config.inputs:
        raise InputError("no cache files given")
    files = expand_cache_inputs(config.inputs)
    output = Path(config.output) if config.output is not None else default_output(Path(config.inputs[0]))
    _refuse_overwriting_inputs(output, files)
    if config.plot is not None:
        _require_matplotlib(config.plot)
    readers, schema = _open_inputs(files)
    warnings: list[str] = []

    controller, previous_run = _load_controller(config, warnings)
    run_inputs = [{"name": path.name, "size": path.stat().st_size} for path in files]
    if previous_run and previous_run.get("inputs") == run_inputs:
        warnings.append(
            f"{config.state}: these inputs were already scored into this state file; "
            "scoring them again moves the controller twice"
        )
    replaced = [name for name in SCORED_COLUMNS if name in schema.names]
    if replaced:
        warnings.append(f"the input already has scored columns ({', '.join(replaced)}); they are replaced")
    out_schema = _output_schema(schema, config, replaced)

    batches = _ControllerBatches(
        controller,
        has_steps=STEP in schema.names,
        previous_last_step=(previous_run or {}).get("last_step"),
        warnings=warnings,
    )
    totals = _RunTotals()
    with atomic_output(output) as tmp:
        # Three stages overlap: a thread decodes the next record batch, this thread scores, and
        # another thread encodes the previous row group (parquet and numpy release the GIL).
        with pq.ParquetWriter(tmp, out_schema) as writer, in_background(writer.write_table, depth=1) as write:
            row_groups = _RowGroups(write, config.row_group_bytes)
            batches_read = _read_batches(files, readers, config.batch_tokens, config.batch_bytes)
            with closing(prefetch(batches_read)) as stream:
                for batch, rows in stream:
                    scored = _score_batch(batch, rows, config, batches, totals, replaced)
                    row_groups.add(pa.RecordBatch.from_arrays(scored, schema=out_schema))
            row_groups.flush()
        batches.finish()
        if totals.extreme_count:
            warnings.append(report.extreme_rows_warning(totals.extreme_rows, totals.extreme_count, config.extreme_nats))
        run_report = _build_report(config, files, output, batches, totals, warnings, started)
        if config.plot is not None:
            report.plot(Path(config.plot), batches.trajectory(totals), run_report)
        if config.report is not None:
            write_json_atomic(config.report, run_report)
    if config.state is not None:
        state = controller.save_state()
        state["last_run"] = {"inputs": run_inputs, "rows": totals.rows, "last_step": batches.last_label}
        write_json_atomic(config.state, state)
    return ScoreResult(output=output, report=run_report, warnings=warnings)


# -- inputs -----------------------------------------------------------------------------------------


def _read_batches(files: list[Path], readers: list[pq.ParquetFile], batch_tokens: int, batch_bytes: int):
    """(record batch, where its rows come from), across all inputs in order."""
    for path, reader in zip(files, readers, strict=True):
        with reader:
            first_index = 0
            for batch in reader.iter_batches(batch_size=_rows_per_batch(reader, batch_tokens, batch_bytes)):
                ids = batch.column(ID) if ID in batch.schema.names else None
                yield batch, RowLocator(path, first_index, ids)
                first_index += batch.num_rows


def _rows_per_batch(reader: pq.ParquetFile, batch_tokens: int, batch_bytes: int) -> int:
    """Rows that hold about `batch_tokens` tokens and at most `batch_bytes` bytes, from the file's means.

    The token budget alone would let a pass-through column of wide rows (documents, images) make
    one record batch of gigabytes.
    """
    metadata = reader.metadata
    groups = [metadata.row_group(g) for g in range(metadata.num_row_groups)]
    column = next(
        i for i in range(metadata.num_columns) if reader.schema.column(i).path.split(".")[0] == POLICY_LOGPROBS
    )
    rows = max(1, metadata.num_rows)
    mean_tokens = max(1.0, sum(g.column(column).num_values for g in groups) / rows)
    mean_bytes = max(1.0, sum(g.total_byte_size for g in groups) / rows)  # uncompressed, every column
    return max(1, int(min(batch_tokens / mean_tokens, batch_bytes / mean_bytes)))


def _refuse_overwriting_inputs(output: Path, files: list[Path]) -> None:
    resolved = output.resolve()
    for path in files:
        if path.resolve() == resolved:
            raise OutputError(f"{output}: is also an input; pass another --output")


def _require_matplotlib(plot_path: Path) -> None:
    # Checked before the run so a missing extra does not cost an hour of scoring.
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise OutputError(f"{plot_path}: --plot needs matplotlib: pip install 'klpipe[plot]'")


def _open_inputs(files: list[Path]) -> tuple[list[pq.ParquetFile], pa.Schema]:
    """Open every input, check the columns score needs and that the caches belong together."""
    readers = []
    provenances = []
    first_schema: pa.Schema | None = None
    for path in files:
        provenance = read_provenance(path)  # also rejects files that are not parquet
        provenances.append((str(path), provenance))
        reader = open_parquet(path)
        schema = reader.schema_arrow
        _check_columns(path, schema)
        if first_schema is None:
            first_schema = schema
        elif not schema.remove_metadata().equals(first_schema.remove_metadata()):
            raise InputError(
                f"{path}: columns differ from {files[0]} ({schema_difference(first_schema, schema)}); "
                "score caches with the same columns together"
            )
        readers.append(reader)
    check_compatible(provenances)
    return readers, first_schema


def _check_columns(path: Path, schema: pa.Schema) -> None:
    missing = [name for name in (POLICY_LOGPROBS, REF_LOGPROBS, REWARD) if name not in schema.names]
    if missing:
        if REF_LOGPROBS in missing:
            hint = "run `klpipe precompute` on it first to add the reference logprobs"
        elif POLICY_LOGPROBS in missing:
            hint = "the rollouts must carry the sampling policy's per-token logprobs"
        else:
            hint = "add each rollout's reward before scoring"
        raise InputError(f"{path}: no {' or '.join(missing)} column; {hint}")
    for name in (POLICY_LOGPROBS, REF_LOGPROBS):
        kind = schema.field(name).type
        if not (is_list_type(kind) and pa.types.is_floating(kind.value_type)):
            raise InputError(f"{path}: {name} must be a list of floats, got {kind}")
    reward_type = schema.field(REWARD).type
    if not (pa.types.is_floating(reward_type) or pa.types.is_integer(reward_type)):
        raise InputError(f"{path}: {REWARD} must be numeric, got {reward_type}")
    if STEP in schema.names:
        step_type = schema.field(STEP).type
        if not (pa.types.is_integer(step_type) or pa.types.is_string(step_type) or pa.types.is_large_string(step_type)):
            raise InputError(f"{path}: {STEP} must be an integer or a string, got {step_type}")


def _output_schema(schema: pa.Schema, config: ScoreConfig, replaced: list[str]) -> pa.Schema:
    kept = [f for f in schema if f.name not in replaced]
    added = [pa.field(name, pa.float64()) for name in (KL, KL_COEFF, KL_PENALTY, ADJUSTED_REWARD)]
    if config.per_token:
        added.append(pa.field(KL_PER_TOKEN, pa.list_(pa.float64())))
    metadata = dict(schema.metadata or {})
    metadata[SCORE_METADATA_KEY] = json.dumps(_settings(config), sort_keys=True).encode()
    return pa.schema(kept + added, metadata=metadata)


def _settings(config: ScoreConfig) -> dict:
    return {
        "klpipe_version": __version__,
        "estimator": config.estimator,
        "aggregate": config.aggregate,
        "clamp": config.clamp,
        "per_token": config.per_token,
        "controller": asdict(config.controller),
    }


class _RowGroups:
    """Gathers scored batches into row groups of about `target_bytes` and hands each to `write`.

    pyarrow makes every write call its own row group, and small row groups cost writing time
    (each column chunk starts a fresh dictionary) and reading time. Whole row groups also let the
    writer thread encode one while this thread fills the next.
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


# -- state ------------------------------------------------------------------------------------------


def _load_controller(config: ScoreConfig, warnings: list[str]) -> tuple[KLController, dict | None]:
    controller = KLController(config.controller)
    if config.state is None or config.reset_state or not Path(config.state).exists():
        return controller, None
    path = Path(config.state)
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise StateError(f"{path}: not a readable controller state file ({exc})") from None
    try:
        controller.load_state(state)
    except StateError as exc:
        raise StateError(f"{path}: {exc}; pass --reset-state to start a fresh controller") from None
    differences = controller.config_differences(state.get("config") or {})
    if differences:
        warnings.append(f"{path}: settings changed since the state was saved ({'; '.join(differences)})")
    last_run = state.get("last_run")
    return controller, last_run if isinstance(last_run, dict) else None


# -- the stream -------------------------------------------------------------------------------------


@dataclass
class _RunTotals:
    """Running totals over the whole run."""

    rows: int = 0
    row_kls: list[np.ndarray] = field(default_factory=list)  # (rows,) per batch: percentiles, histogram
    reward_sums: list[float] = field(default_factory=list)
    adjusted_sums: list[float] = field(default_factory=list)
    negative_k1: int = 0
    extreme_count: int = 0
    extreme_rows: list[str] = field(default_factory=list)  # the first few, named


@dataclass
class _OpenStep:
    """The controller batch being read: its rows so far, all penalised with `kl_coeff`."""

    label: object
    kl_coeff: float
    kls: list[np.ndarray] = field(default_factory=list)
    rewards: list[np.ndarray] = field(default_factory=list)
    negative_k1: int = 0


class _ControllerBatches:
    """Cuts the row stream into controller batches and hands each row its coefficient."""

    def __init__(self, controller: KLController, has_steps: bool, previous_last_step, warnings: list[str]):
        self.controller = controller
        self.has_steps = has_steps
        self.previous_last_step = previous_last_step
        self.warnings = warnings
        self.kl_coeff_before = controller.kl_coeff  # at the start of the run
        self.open: _OpenStep | None = None
        self.steps: list[dict] = []  # report entries, one per step
        self.step_kl_means: list[float] = []  # unrounded, for the plot
        self.batch_count = 0
        self.last_label = None
        self.per_row_coeffs: list[np.ndarray] = []  # without steps: the plot's coefficient trajectory

    def coefficients(
        self, steps: pa.Array | None, kl: np.ndarray, reward: np.ndarray, negative_k1: np.ndarray
    ) -> np.ndarray:
        """The coefficient for each row of a record batch, closing the steps that end in it."""
        if not self.has_steps:
            return self._per_row(kl)
        n = len(kl)
        coeffs = np.empty(n)
        if n == 0:
            return coeffs
        changes = pc.indices_nonzero(pc.not_equal(steps.slice(1), steps.slice(0, n - 1)))
        starts = np.concatenate(([0], numpy_view(changes).astype(np.int64) + 1))
        ends = np.append(starts[1:], n)
        labels = steps.take(from_numpy(starts)).to_pylist()
        for start, end, label in zip(starts.tolist(), ends.tolist(), labels, strict=True):
            if self.open is None or label != self.open.label:
                self._close()
                self._open(label)
            step = self.open
            step.kls.append(kl[start:end])
            step.rewards.append(reward[start:end])
            step.negative_k1 += int(np.count_nonzero(negative_k1[start:end]))
            coeffs[start:end] = step.kl_coeff
        return coeffs

    def _per_row(self, kl: np.ndarray) -> np.ndarray:
        # Each row is its own batch: the coefficient can change after every row, so this is a
        # loop, but one of scalar updates; the KL math stays vectorised.
        coeffs = np.empty(len(kl))
        controller = self.controller
        for i, value in enumerate(kl.tolist()):
            coeffs[i] = controller.kl_coeff
            controller.observe_batch((value,))
        self.batch_count += len(kl)
        self.per_row_coeffs.append(coeffs)
        return coeffs

    def _open(self, label) -> None:
        if not self.batch_count and self.previous_last_step is not None and label == self.previous_last_step:
            self.warnings.append(
                f"step {label!r} continues from the previous run recorded in the state file; it is scored "
                "as a new controller batch, so its coefficients differ from scoring both runs together"
            )
        self.open = _OpenStep(label=label, kl_coeff=self.controller.kl_coeff)
        self.batch_count += 1
        self.last_label = label

    def _close(self) -> None:
        step, self.open = self.open, None
        if step is None:
            return
        kls = np.concatenate(step.kls)
        rewards = np.concatenate(step.rewards)
        self.controller.observe_batch(kls.tolist())
        adjusted = rewards - step.kl_coeff * kls  # the same arithmetic as the output column
        self.step_kl_means.append(float(np.mean(kls)))
        entry = {"step": step.label, "rows": len(kls)}
        entry.update(
            report.kl_statistics(
                kls, self.controller.kl_coeff, self.controller.adaptation_count, self.controller.samples_processed
            )
        )
        entry.update(
            {
                "kl_coeff_before": step.kl_coeff,
                "kl_coeff_after": self.controller.kl_coeff,
                "negative_k1_fraction": step.negative_k1 / len(kls),
                "reward_mean_before": float(np.mean(rewards)),
                "reward_mean_after": float(np.mean(adjusted)),
            }
        )
        self.steps.append(entry)

    def finish(self) -> None:
        self._close()

    def trajectory(self, totals: _RunTotals) -> report.Trajectory:
        if self.has_steps:
            labels = [s["step"] for s in self.steps]
            numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in labels)
            return report.Trajectory(
                x=np.array(labels if numeric else range(len(labels)), dtype=np.float64),
                kl_mean=np.array(self.step_kl_means),
                kl_coeff=np.array([s["kl_coeff_before"] for s in self.steps]),
                x_label="step" if numeric else "step (in order)",
            )
        kls = np.concatenate(totals.row_kls) if totals.row_kls else np.zeros(0)
        return report.Trajectory(
            x=np.arange(len(kls), dtype=np.float64),
            kl_mean=kls,
            kl_coeff=np.concatenate(self.per_row_coeffs) if self.per_row_coeffs else np.zeros(0),
            x_label="row",
        )


def _score_batch(
    batch: pa.RecordBatch,
    rows: RowLocator,
    config: ScoreConfig,
    batches: _ControllerBatches,
    totals: _RunTotals,
    replaced: list[str],
) -> list[pa.Array]:
    """Validate one record batch and return its output columns."""
    policy = batch.column(POLICY_LOGPROBS)
    ref = batch.column(REF_LOGPROBS)
    reward_column = batch.column(REWARD)
    steps = batch.column(STEP) if batches.has_steps else None
    _check_nulls(batch, rows, (REWARD, POLICY_LOGPROBS, REF_LOGPROBS) + ((STEP,) if steps is not None else ()))
    policy_values, offsets = list_values(policy)
    ref_values, ref_offsets = list_values(ref)
    if not np.array_equal(offsets, ref_offsets):
        i = int(np.flatnonzero(np.diff(offsets) != np.diff(ref_offsets))[0])
        raise InputError(
            f"{rows.name(i)}: {POLICY_LOGPROBS} has {offsets[i + 1] - offsets[i]} "
            f"tokens but {REF_LOGPROBS} has {ref_offsets[i + 1] - ref_offsets[i]}; both must cover the same "
            "response tokens (rerun `klpipe precompute` with the policy's tokenization)"
        )
    for name, values_array in ((POLICY_LOGPROBS, policy), (REF_LOGPROBS, ref)):
        _check_value_nulls(rows, name, values_array)

    reward = numpy_view(reward_column).astype(np.float64, copy=False)
    bad_reward = ~np.isfinite(reward)
    if bad_reward.any():
        i = int(np.flatnonzero(bad_reward)[0])
        raise InputError(f"{rows.name(i)}: {REWARD} is {_describe(reward[i])}")

    estimate = row_kl(
        policy_values, ref_values, offsets, config.estimator, config.aggregate, config.clamp, config.per_token
    )
    _check_finite(estimate, rows, policy_values, ref_values, offsets, config.estimator)

    kl = estimate.kl
    coeffs = batches.coefficients(steps, kl, reward, estimate.negative_k1)
    penalty = coeffs * kl
    adjusted = reward - penalty

    totals.rows += len(kl)
    totals.row_kls.append(kl)
    totals.reward_sums.append(float(np.sum(reward)))
    totals.adjusted_sums.append(float(np.sum(adjusted)))
    totals.negative_k1 += int(np.count_nonzero(estimate.negative_k1))
    extreme = np.flatnonzero(estimate.max_abs_diff > config.extreme_nats)
    if extreme.size:
        totals.extreme_count += int(extreme.size)
        room = EXTREME_ROWS_NAMED - len(totals.extreme_rows)
        totals.extreme_rows += [rows.name(int(i)) for i in extreme[:room]]

    columns = [batch.column(i) for i, f in enumerate(batch.schema) if f.name not in replaced]
    columns += [from_numpy(kl), from_numpy(coeffs), from_numpy(penalty), from_numpy(adjusted)]
    if config.per_token:
        columns.append(list_array(estimate.offsets, estimate.token_kl))
    return columns


def _describe(value: float) -> str:
    return "NaN" if math.isnan(value) else ("+inf" if value > 0 else "-inf")


def _check_nulls(batch: pa.RecordBatch, rows: RowLocator, names: tuple[str, ...]) -> None:
    for name in names:
        i = first_null(batch.column(name))
        if i is not None:
            raise InputError(f"{rows.name(i)}: {name} is null")


def _check_value_nulls(rows: RowLocator, name: str, array: pa.Array) -> None:
    i = first_null_in_lists(array)
    if i is not None:
        raise InputError(f"{rows.name(i)}: {name} holds a null")


def _check_finite(estimate: RowKL, rows: RowLocator, policy_values, ref_values, offsets, estimator) -> None:
    # A non-finite logprob makes its row's max |policy − ref| non-finite, so the per-row values
    # (not the tokens) are scanned; the tokens are looked at only to name the culprit.
    bad_rows = ~np.isfinite(estimate.max_abs_diff)
    if bad_rows.any():
        i = int(np.flatnonzero(bad_rows)[0])
        for name, values in ((POLICY_LOGPROBS, policy_values), (REF_LOGPROBS, ref_values)):
            row_values = values[offsets[i] : offsets[i + 1]]
            bad = row_values[~np.isfinite(row_values)]
            if bad.size:
                raise InputError(f"{rows.name(i)}: {name} holds {_describe(bad[0])}")
    overflow = ~np.isfinite(estimate.kl)
    if overflow.any():
        i = int(np.flatnonzero(overflow)[0])
        raise InputError(
            f"{rows.name(i)}: the {estimator} KL overflows (|policy − ref| up to "
            f"{estimate.max_abs_diff[i]:.0f} nats); the policy and reference almost certainly tokenized differently"
        )


# -- the report -------------------------------------------------------------------------------------


def _build_report(config, files, output, batches: _ControllerBatches, totals: _RunTotals, warnings, started) -> dict:
    controller = batches.controller
    kls = np.concatenate(totals.row_kls) if totals.row_kls else np.zeros(0)
    rows = totals.rows
    summary = {"rows": rows, "batches": batches.batch_count}
    summary.update(
        report.kl_statistics(kls, controller.kl_coeff, controller.adaptation_count, controller.samples_processed)
    )
    summary.update(
        {
            "kl_coeff_before": batches.kl_coeff_before,
            "kl_coeff_after": controller.kl_coeff,
            "negative_k1_fraction": totals.negative_k1 / rows if rows else 0.0,
            "reward_mean_before": math.fsum(totals.reward_sums) / rows if rows else 0.0,
            "reward_mean_after": math.fsum(totals.adjusted_sums) / rows if rows else 0.0,
        }
    )
    settings = _settings(config)
    settings["state"] = str(config.state) if config.state is not None else None
    settings["reset_state"] = config.reset_state
    return {
        "inputs": [str(p) for p in files],
        "output": str(output),
        "config": settings,
        "summary": summary,
        "steps": batches.steps,
        "histogram": report.histogram(kls),
        "extreme_rows": {
            "threshold_nats": config.extreme_nats,
            "count": totals.extreme_count,
            "named": totals.extreme_rows,
        },
        "warnings": list(warnings),
        "seconds": round(time.perf_counter() - started, 3),
    }
