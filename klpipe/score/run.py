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
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from klpipe.arrow import from_numpy, list_array
from klpipe.atropos.writer import check_groups
from klpipe.cache import POLICY_LOGPROBS, PROMPT, PROMPT_IDS, SAMPLER_LOGPROBS, STEP
from klpipe.columns import ColumnMap, for_caches
from klpipe.errors import InputError, OutputError
from klpipe.progress import Progress
from klpipe.rows import RowLocator
from klpipe.score import exact as exact_section
from klpipe.score import report, scored_file, state
from klpipe.score import sampler as sampler_section
from klpipe.score.config import ScoreConfig
from klpipe.score.input import (
    Logprobs,
    check_batch,
    check_finite,
    expand_cache_inputs,
    open_caches,
    policy_source,
)
from klpipe.score.kl import RowKL, row_kl
from klpipe.score.scored_file import SCORED_COLUMNS
from klpipe.score.steps import ControllerSteps
from klpipe.storage.atomic import OutputGroup
from klpipe.storage.discover import (
    PARQUET_SUFFIXES,
    output_beside,
    refuse_overwriting_inputs,
)
from klpipe.storage.store import Location, check_output, expand

# Default output name beside the first input: cache.parquet → cache.scored.parquet.
OUTPUT_SUFFIX = ".scored.parquet"
ATROPOS_SUFFIX = ".scored.jsonl"  # --output-format atropos

# Extreme-row warnings name at most this many rows; the report counts them all.
EXTREME_ROWS_NAMED = 10


@dataclass
class ScoreResult:
    """What a run wrote and found; `report` is also what `--report` holds."""

    output: Location
    report: dict[str, Any]
    warnings: list[str]
    posted: object = None  # klpipe.atropos.post.Posted: what --atropos-api sent


def default_output(first_input: Location, groups: bool = False) -> Location:
    """<stem>.scored.parquet beside the first input (a directory's name is its stem; a URI pattern's, its first match);
    <stem>.scored.jsonl for Atropos groups."""
    return output_beside(expand(first_input)[0], ATROPOS_SUFFIX if groups else OUTPUT_SUFFIX, PARQUET_SUFFIXES)


def score(config: ScoreConfig, log: Callable[[str], object] = print) -> ScoreResult:
    """Score the caches in `config.inputs` and write the output, report, plot, metrics and state it asks for.

    Every file appears whole or not at all, and the state file, written last, is only advanced by a
    run that wrote everything. An error before the output is committed leaves nothing; one while
    the metrics are written (after it) leaves the state as it was, so a rerun replaces them all.
    The state is held from its read to its write (state.py): a second run on it waits for this one,
    then continues from the state this one saved. `log` hears of the wait and of progress.
    """
    started = time.perf_counter()
    if not config.inputs:
        raise InputError("no cache files given")
    files, skipped = expand_cache_inputs(config.inputs)
    output = config.output if config.output is not None else default_output(config.inputs[0], config.writes_groups)
    outputs_by_option = _outputs(config, output)
    refuse_overwriting_inputs(outputs_by_option, files)
    for path in outputs_by_option.values():
        if path is not None:
            check_output(path)  # a missing bucket fails now, before the scoring
    if config.plot is not None:
        _require_matplotlib(config.plot)
    if config.tensorboard is not None:
        from klpipe.score import metrics  # tensorboardX is imported only when asked for

        metrics.require_tensorboardx(config.tensorboard)
    names = for_caches(config.columns, files)  # role -> the caches' column names
    schema, names, rows = open_caches(files, names)
    if config.writes_groups:
        check_groups(schema, str(files[0]))
    warnings: list[str] = []
    if skipped:
        warnings.append(f"skipped {len(skipped)} file(s) that klpipe score wrote into an input directory, so "
                        f"they are not scored again: {', '.join(str(p) for p in skipped)}")
    caches = _Caches(files, output, schema, names, rows, policy_source(files))
    with state.HeldState(config.state, config.wait_for_state, log) as held:
        return _score(config, caches, held, warnings, started, log)


@dataclass(frozen=True)
class _Caches:
    """What the checks before the run found: the caches, in order, and where their scored rows go."""

    files: list[Location]
    output: Location
    schema: pa.Schema
    names: ColumnMap  # role -> the caches' column names
    rows: int  # in all the caches
    source: dict[str, Any]  # a sampler's logprobs, or a model's that precompute --policy ran (input.policy_source)


@dataclass(frozen=True)
class _Scoring:
    """What every record batch of a run is scored with, and where its figures go."""

    config: ScoreConfig
    steps: ControllerSteps  # hands each row its coefficient; holds the report's per-step entries
    totals: report.RunTotals  # the whole run's, added to batch by batch
    replaced: list[str]  # the input's scored columns, which the run's own replace
    names: ColumnMap  # role -> the caches' column names
    kl_from: str  # whose logprobs the KL reads: "trainer" or "sampler" (_kl_from)
    sampler: sampler_section.SamplerRun | None = None  # with a sampler column: the mismatch section
    exact: exact_section.ExactRun | None = None  # with the exact KL's columns: its section


def _score(config: ScoreConfig, caches: _Caches, held: state.HeldState, warnings: list[str], started: float,
           log: Callable[[str], object]) -> ScoreResult:
    """The run, from the state `held` read to the next state: the controller continues it, row batch by row batch."""
    files, output, schema, names, source = caches.files, caches.output, caches.schema, caches.names, caches.source
    controller, previous_run = state.load_controller(config, held, warnings)
    batches_before = state.batches_before(previous_run, config.state)
    if controller.kl_coeff == 0 and config.controller.kind != "fixed":
        warnings.append(f"the KL coefficient is 0: KL is measured and reported but not penalised, and the "
                        f"{config.controller.kind} controller keeps a coefficient of 0 at 0")
    run_inputs = [{"name": path.name, "size": path.stat().st_size} for path in files]
    if previous_run and previous_run.get("inputs") == run_inputs:
        warnings.append(
            f"{config.state}: these inputs were already scored into this state file; "
            "scoring them again moves the controller twice"
        )
    has_sampler = names.name(SAMPLER_LOGPROBS) in schema.names
    kl_from = _kl_from(config, has_sampler, source, names)
    has_exact, unread = exact_section.exact_source(files, schema, config.estimator)  # refuses full without it
    warnings += [unread] if unread else []
    replaced = [name for name in SCORED_COLUMNS + (sampler_section.COLUMNS if has_sampler else ())
                if name in schema.names]
    if replaced:
        warnings.append(f"the input already has scored columns ({', '.join(replaced)}); they are replaced")
    out_schema = scored_file.output_schema(schema, config, replaced, has_sampler)

    has_steps = names.name(STEP) in schema.names
    sampler = sampler_section.SamplerRun(config.estimator, has_steps) if has_sampler else None
    exact = exact_section.ExactRun(has_steps) if has_exact else None
    batches = ControllerSteps(
        controller,
        has_steps=has_steps,
        previous_last_step=(previous_run or {}).get("last_step"),
        warnings=warnings,
        keep_rows=_wants_metrics(config),
        sections={key: part for key, part in (("mismatch", sampler), ("exact", exact)) if part is not None},
    )
    scoring = _Scoring(config, batches, report.RunTotals(), replaced, names, kl_from, sampler, exact)
    totals = scoring.totals
    # The output, report, plot and metrics appear together, once all are written: a run that fails
    # on any of them (a full disk, say) leaves none. The state, the next run's starting point, is
    # written after them, so it only ever moves on from a run whose outputs are all in place.
    with OutputGroup() as outputs:
        progress = Progress(config.progress, total_rows=caches.rows, log=log, interval=config.log_interval)
        with outputs.file(output) as tmp, closing(progress):
            def score_batch(batch: pa.RecordBatch, rows: RowLocator) -> list[pa.Array]:
                tokens = totals.tokens
                columns = _score_batch(batch, rows, scoring)
                progress.update(batch.num_rows, totals.tokens - tokens)
                return columns

            write = scored_file.write_groups if config.writes_groups else scored_file.write_parquet
            write(tmp, files, config, score_batch, names, out_schema)
        batches.finish()
        # The run's own time, not the wait for the state.
        run_report = _report(scoring, caches, warnings, seconds=time.perf_counter() - started - held.waited)
        _write_extras(outputs, scoring, run_report, batches_before, schema)
        held.check()  # a state on a store that another run saved meanwhile: nothing is written
        outputs.commit()
    posted = None
    if config.atropos_api is not None:
        # Before the state: a run whose groups did not all reach the trainer leaves the state as it was, so a
        # rerun writes the same groups and posts only those the server has not taken (the marker says which).
        from klpipe.atropos.post import post_groups
        from klpipe.storage.download import local_copy

        posted = post_groups(local_copy(output), config.atropos_api)
    if config.state is not None:
        saved = controller.save_state()
        saved["last_run"] = {"inputs": run_inputs, "rows": totals.rows, "last_step": batches.last_label,
                             "controller_batches": batches_before + batches.batch_count}
        held.save(saved)
    return ScoreResult(output=output, report=run_report, warnings=warnings, posted=posted)


def _report(scoring: _Scoring, caches: _Caches, warnings: list[str], seconds: float) -> dict[str, Any]:
    """The report JSON of a run whose rows are all scored: build_report's, with the policy's and the sections'."""
    config, batches, totals, names, source = scoring.config, scoring.steps, scoring.totals, scoring.names, caches.source
    if totals.extreme_count:
        warnings.append(report.extreme_rows_warning(totals.extreme_rows, totals.extreme_count, config.extreme_nats,
                                                    source["computed"]))
    settings = scored_file.settings(config)
    settings["kl_from"] = scoring.kl_from
    settings.update(state=str(config.state) if config.state is not None else None, reset_state=config.reset_state)
    run = report.RunFacts(inputs=caches.files, output=caches.output, settings=settings,
                          extreme_nats=config.extreme_nats, warnings=warnings, seconds=seconds)
    run_report = report.build_report(run, batches.controller, batches.kl_coeff_before, batches.batch_count,
                                     batches.steps, totals)
    run_report["policy_logprobs"] = source
    run_report["mismatch"] = None if scoring.sampler is None else scoring.sampler.section(
        names.name(SAMPLER_LOGPROBS), names.name(POLICY_LOGPROBS), scoring.kl_from,
        source.get("model") if source["computed"] else None)
    run_report["exact"] = None if scoring.exact is None else scoring.exact.section(names.name(POLICY_LOGPROBS))
    return run_report


def _write_extras(outputs: OutputGroup, scoring: _Scoring, run_report: dict[str, Any], batches_before: int,
                  schema: pa.Schema) -> None:
    """The plot, the report and the metrics asked for, into the outputs that appear together."""
    config, batches, totals = scoring.config, scoring.steps, scoring.totals
    if config.plot is not None:
        trajectory = report.trajectory(batches.has_steps, batches.steps, totals, batches.per_row_coeffs)
        with outputs.file(config.plot) as tmp:
            report.plot(tmp, trajectory, run_report)
    if config.report is not None:
        with outputs.file(config.report) as tmp:
            tmp.write_text(json.dumps(run_report, indent=2, sort_keys=True) + "\n")
    if _wants_metrics(config):
        # A crash between these files and the state reruns the same continuation, whose event
        # file has the same name and replaces this one.
        from klpipe.score import metrics  # tensorboardX is imported only when asked for

        integer_steps = batches.has_steps and pa.types.is_integer(schema.field(scoring.names.name(STEP)).type)
        metrics.write_run(outputs, config, batches, totals, batches_before, integer_steps)


# -- outputs ----------------------------------------------------------------------------------------


def _outputs(config: ScoreConfig, output: Location) -> dict[str, Location | None]:
    """Every file this run writes, by option: none may be an input, and no two the same file.

    The state file is read as well as written, so it is an output here too: as an input cache, or
    as the report, it would be destroyed.
    """
    return {"--output": output, "--report": config.report, "--plot": config.plot, "--state": config.state,
            "--metrics-jsonl": config.metrics_jsonl, "--tensorboard": config.tensorboard}


def _wants_metrics(config: ScoreConfig) -> bool:
    return config.tensorboard is not None or config.metrics_jsonl is not None


def _require_matplotlib(plot_path: Location) -> None:
    # Checked before the run so a missing extra does not cost an hour of scoring.
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise OutputError(f"{plot_path}: --plot needs matplotlib: pip install 'klpipe[plot]'")


def _kl_from(config: ScoreConfig, has_sampler: bool, source: dict[str, Any], names: ColumnMap) -> str:
    """Whose logprobs the KL reads: "trainer" (policy_logprobs) or "sampler" (sampler_logprobs).

    Without a sampler column, policy_logprobs are the sampler's own unless precompute --policy computed them.
    """
    if config.kl_from != "sampler":
        return "trainer" if has_sampler or source["computed"] else "sampler"
    if not has_sampler and source["computed"]:
        raise InputError(f"--kl-from sampler: the caches hold no {names.name(SAMPLER_LOGPROBS)} column, and their "
                         f"{names.name(POLICY_LOGPROBS)} were computed by {source.get('model')}; the sampler's "
                         "logprobs were not kept")
    return "sampler"


# -- the stream -------------------------------------------------------------------------------------


def _score_batch(batch: pa.RecordBatch, rows: RowLocator, scoring: _Scoring) -> list[pa.Array]:
    """Check one record batch and return its output columns."""
    config, batches, totals, names = scoring.config, scoring.steps, scoring.totals, scoring.names
    sampler, exact = scoring.sampler, scoring.exact
    logprobs = check_batch(batch, rows, batches.has_steps, names, scoring.kl_from == "sampler")
    exact_tokens = None
    if exact is not None:  # measured before the coefficients, which hand each step its rows
        exact_tokens = exact_section.read_exact(batch, logprobs, rows, names.name(POLICY_LOGPROBS))
    full = exact_tokens.kl if exact_tokens is not None and config.estimator == "full" else None
    estimate = row_kl(logprobs.policy, logprobs.ref, logprobs.offsets, config.estimator, config.aggregate,
                      config.clamp, config.per_token, exact=full)
    check_finite(estimate, logprobs, rows, config.estimator, names)
    if exact is not None and exact_tokens is not None:
        exact.measure(exact_tokens)

    measured = None
    if sampler is not None:  # before the coefficients, which hand each step its rows
        keys = sampler_section.group_keys(batch, [names.name(PROMPT_IDS), names.name(PROMPT)])
        measured = sampler.measure(logprobs, rows.name, keys)

    kl = estimate.kl
    reward = logprobs.reward
    steps = batch.column(names.name(STEP)) if batches.has_steps else None
    coeffs = batches.coefficients(steps, kl, reward, estimate.negative_k1, np.diff(logprobs.offsets))  # scored tokens
    penalty = coeffs * kl
    adjusted = reward - penalty

    scored_tokens = np.diff(logprobs.offsets)
    totals.rows += len(kl)
    totals.tokens += int(logprobs.offsets[-1])
    totals.masked_tokens += logprobs.masked_tokens
    totals.rows_without_tokens += int(np.count_nonzero(scored_tokens == 0))
    totals.row_kls.append(kl)
    totals.reward_sums.append(float(np.sum(reward)))
    totals.adjusted_sums.append(float(np.sum(adjusted)))
    totals.negative_k1 += int(np.count_nonzero(estimate.negative_k1))
    extreme = np.flatnonzero(estimate.max_abs_diff > config.extreme_nats)
    if extreme.size:
        totals.extreme_count += int(extreme.size)
        room = EXTREME_ROWS_NAMED - len(totals.extreme_rows)
        totals.extreme_rows += [rows.name(int(i)) for i in extreme[:room]]

    columns = [batch.column(i) for i, f in enumerate(batch.schema) if f.name not in scoring.replaced]
    columns += [from_numpy(kl), from_numpy(coeffs), from_numpy(penalty), from_numpy(adjusted)]
    if config.per_token:
        columns.append(_per_token_column(estimate, logprobs))
    if measured is not None:
        columns += sampler_section.row_columns(measured[0], config.per_token, logprobs, measured[1])
    return columns


def _per_token_column(estimate: RowKL, logprobs: Logprobs) -> pa.Array:
    """`kl_per_token`: one value per response token, aligned with the response; null where the mask is 0."""
    assert estimate.token_kl is not None, "estimated with per_token"
    if logprobs.keep is None:
        return list_array(estimate.offsets, estimate.token_kl)
    assert logprobs.response_offsets is not None  # read with the mask
    values = np.zeros(len(logprobs.keep), dtype=np.float64)
    values[logprobs.keep] = estimate.token_kl
    return list_array(logprobs.response_offsets, values, valid=logprobs.keep)
