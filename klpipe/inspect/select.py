"""The first pass over the file: every row's figures, the curves per step, and the rows the page embeds.

The file is read as `klpipe score` reads a cache (score/input.py: the same column checks, the same row
checks, the same KL code), but only the columns the figures need, one record batch at a time. What stays
in memory is a few numbers per row, as score keeps its per-row KLs; the token values of the rows picked
are read in a second pass (gather.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from klpipe.arrow import from_numpy, numpy_valid, numpy_view
from klpipe.cache import (
    FULL_KL_COLUMNS,
    ID,
    MASK,
    POLICY_LOGPROBS,
    PROMPT,
    PROMPT_IDS,
    REF_LOGPROBS,
    REWARD,
    SAMPLER_LOGPROBS,
    SCORED_METADATA_KEY,
    STEP,
    Provenance,
    read_provenance,
)
from klpipe.columns import ColumnMap
from klpipe.errors import InputError
from klpipe.rows import RowLocator
from klpipe.score.config import ScoreConfig
from klpipe.score.exact import ExactRun, ExactTokens, exact_source, read_exact
from klpipe.score.input import check_batch, check_finite, open_caches, read_batches
from klpipe.score.kl import row_kl, row_reduce
from klpipe.score.sampler import SamplerRun, group_keys
from klpipe.storage.parquet import read_schema
from klpipe.storage.store import Location

# The columns klpipe score adds (score/run.py names them; repeated here so that reading a file's figures
# does not import the scoring stage's writer).
KL, KL_COEFF, KL_PENALTY, ADJUSTED_REWARD = "kl", "kl_coeff", "kl_penalty", "adjusted_reward"
SCORED = (KL, KL_COEFF, KL_PENALTY, ADJUSTED_REWARD)

# A cache that was never scored gets score's own defaults for its per-row KL.
_SCORE_DEFAULTS = {"estimator": ScoreConfig.estimator, "aggregate": ScoreConfig.aggregate, "clamp": ScoreConfig.clamp}


@dataclass
class Source:
    """What the file is: its columns by role, how it was made and, for a scored file, how it was scored."""

    path: Location
    schema: pa.Schema
    columns: ColumnMap  # role -> the file's column
    provenance: Provenance | None  # precompute's record; None for a file klpipe did not write
    settings: dict[str, Any]  # score's settings (estimator, aggregate, clamp, controller) or score's defaults
    scored: bool  # the file has klpipe score's columns
    exact: bool = False  # the file holds the exact KL's columns (cache.FULL_KL_COLUMNS) as precompute wrote them

    def has(self, role: str) -> bool:
        return self.columns.name(role) in self.schema.names


def open_source(path: Location) -> Source:
    """Check `path` as klpipe score checks a cache; a scored file also brings the settings it was scored with."""
    provenance = read_provenance(path)
    metadata = read_schema(path).metadata or {}
    settings: dict[str, Any] = dict(_SCORE_DEFAULTS)
    given: dict[str, str] = dict(provenance.columns) if provenance is not None else {}
    raw = metadata.get(SCORED_METADATA_KEY)
    if raw is not None:
        try:
            recorded = json.loads(raw)
        except ValueError as exc:
            raise InputError(f"{path}: corrupt klpipe score metadata ({exc})") from None
        settings.update(recorded)
        given.update(recorded.get("columns") or {})
    schema, columns, _ = open_caches([path], ColumnMap(given))
    present = [name for name in SCORED if name in schema.names]
    if present and len(present) < len(SCORED):
        missing = ", ".join(name for name in SCORED if name not in schema.names)
        raise InputError(f"{path}: has {', '.join(present)} but no {missing}; inspect a file klpipe score wrote whole")
    exact, _ = exact_source([path], schema, settings["estimator"])  # a file scored with `full` must still have them
    return Source(path, schema, columns, provenance, settings, scored=bool(present), exact=exact)


@dataclass
class RowFigures:
    """One value per row of the file, in file order."""

    ids: pa.Array | None  # the id column, when the file has one
    steps: pa.Array | None  # the step column, when the file has one
    reward: np.ndarray  # (rows,) float64
    kl: np.ndarray  # (rows,) the file's `kl`, or the per-row KL computed as score would
    kl_coeff: np.ndarray | None  # (rows,) scored files only
    penalty: np.ndarray | None
    adjusted: np.ndarray | None
    tokens: np.ndarray  # (rows,) int64: response tokens scored (mask 1)
    masked: np.ndarray  # (rows,) int64: response tokens the mask left out
    max_gap: np.ndarray  # (rows,) float64: the largest |policy − ref| of a scored token
    negative_k1: np.ndarray  # (rows,) bool: the row's raw k1 sum is below zero
    # With a sampler_logprobs column: each row's log_ppl_diff (NaN without a usable sampled token), and the
    # mismatch section klpipe score would write (score/sampler.py), the whole file as one controller batch.
    log_ppl_diff: np.ndarray | None = None
    mismatch: dict | None = None
    # With the exact KL's columns: each row's mean exact KL(π ‖ π_ref) and H(π) over its scored tokens (NaN
    # without one), and the exact section klpipe score would write (score/exact.py) for the whole file.
    exact_kl: np.ndarray | None = None
    policy_entropy: np.ndarray | None = None
    exact: dict | None = None

    def __len__(self) -> int:
        return len(self.reward)

    def row_id(self, i: int) -> object:
        return None if self.ids is None else self.ids[i].as_py()


def read_figures(source: Source, batch_tokens: int) -> RowFigures:
    """Every row's figures, one record batch at a time, with score's checks on every row."""
    names = source.columns
    has_sampler = source.has(SAMPLER_LOGPROBS)
    roles = (ID, STEP, REWARD, POLICY_LOGPROBS, REF_LOGPROBS, MASK) + ((SAMPLER_LOGPROBS, PROMPT_IDS, PROMPT)
                                                                      if has_sampler else ())
    wanted = [names.name(role) for role in roles if source.has(role)]
    sampler = SamplerRun(source.settings["estimator"], has_steps=False) if has_sampler else None
    log_ppl_diff = []
    wanted += [name for name in SCORED if source.scored] + (list(FULL_KL_COLUMNS) if source.exact else [])
    exact = ExactRun(has_steps=False) if source.exact else None
    exact_means: dict[str, list[np.ndarray]] = {"kl": [], "policy_entropy": []}
    has_steps = source.has(STEP)
    parts: dict[str, list[Any]] = {key: [] for key in ("ids", "steps", "reward", "kl", "kl_coeff", "penalty",
                                                       "adjusted", "tokens", "masked", "max_gap", "negative_k1")}
    settings = source.settings
    batch_bytes = ScoreConfig.batch_bytes
    for batch, rows in read_batches([source.path], batch_tokens, batch_bytes, names, only=wanted):
        logprobs = check_batch(batch, rows, has_steps, names)
        exact_tokens = None
        if exact is not None:
            exact_tokens = read_exact(batch, logprobs, rows, names.name(POLICY_LOGPROBS))
        full = exact_tokens.kl if exact_tokens is not None and settings["estimator"] == "full" else None
        estimate = row_kl(logprobs.policy, logprobs.ref, logprobs.offsets, settings["estimator"],
                          settings["aggregate"], settings["clamp"], exact=full)
        check_finite(estimate, logprobs, rows, settings["estimator"], names)
        if exact is not None and exact_tokens is not None:
            exact.measure(exact_tokens)
            for key, means in _exact_row_means(exact_tokens, tuple(exact_means)).items():
                exact_means[key].append(means)
        if sampler is not None:
            keys = group_keys(batch, [names.name(PROMPT_IDS), names.name(PROMPT)])
            measured = sampler.measure(logprobs, rows.name, keys)[0]
            log_ppl_diff.append(np.where(measured.has_tokens, measured.log_ppl_diff, np.nan))
        tokens = np.diff(logprobs.offsets)
        response = tokens if logprobs.response_offsets is None else np.diff(logprobs.response_offsets)
        parts["tokens"].append(tokens)
        parts["masked"].append(response - tokens)
        parts["max_gap"].append(estimate.max_abs_diff)
        parts["negative_k1"].append(estimate.negative_k1)
        parts["reward"].append(logprobs.reward)
        if source.has(ID):
            parts["ids"].append(batch.column(names.name(ID)))
        if has_steps:
            parts["steps"].append(batch.column(names.name(STEP)))
        if source.scored:
            for key, values in _scored_columns(batch, rows).items():
                parts[key].append(values)
        else:
            parts["kl"].append(estimate.kl)

    def joined(key: str, dtype: type = np.float64) -> np.ndarray:
        return np.concatenate(parts[key]) if parts[key] else np.zeros(0, dtype=dtype)

    def exact_joined(key: str) -> np.ndarray:
        return np.concatenate(exact_means[key]) if exact_means[key] else np.zeros(0)

    def arrow(key: str) -> pa.Array | None:
        if not parts[key]:
            return None
        return pa.chunked_array(parts[key]).combine_chunks()

    return RowFigures(
        ids=arrow("ids") if source.has(ID) else None,
        steps=arrow("steps") if has_steps else None,
        reward=joined("reward"), kl=joined("kl"),
        kl_coeff=joined("kl_coeff") if source.scored else None,
        penalty=joined("penalty") if source.scored else None,
        adjusted=joined("adjusted") if source.scored else None,
        tokens=joined("tokens", np.int64), masked=joined("masked", np.int64),
        max_gap=joined("max_gap"), negative_k1=joined("negative_k1", bool),
        log_ppl_diff=(np.concatenate(log_ppl_diff) if log_ppl_diff else np.zeros(0)) if has_sampler else None,
        mismatch=sampler.section(names.name(SAMPLER_LOGPROBS), names.name(POLICY_LOGPROBS), "trainer", None)
        if sampler is not None else None,
        exact_kl=exact_joined("kl") if source.exact else None,
        policy_entropy=exact_joined("policy_entropy") if source.exact else None,
        exact=None if exact is None else exact.section(names.name(POLICY_LOGPROBS)),
    )  # fmt: skip


def _exact_row_means(exact_tokens: ExactTokens, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Each row's mean of the exact figures `keys` (kl, policy_entropy) over its scored tokens; NaN without one."""
    counts = np.diff(exact_tokens.offsets)
    means: dict[str, np.ndarray] = {}
    for key in keys:
        sums = row_reduce(np.add, getattr(exact_tokens, key).astype(np.float64), exact_tokens.offsets, empty=np.nan)
        means[key] = sums / np.maximum(counts, 1)
    return means


def _scored_columns(batch: pa.RecordBatch, rows: RowLocator) -> dict[str, np.ndarray]:
    """A scored file's own kl, kl_coeff, kl_penalty and adjusted_reward (float64), by RowFigures' names; a null is
    refused."""
    columns: dict[str, np.ndarray] = {}
    for key, name in (("kl", KL), ("kl_coeff", KL_COEFF), ("penalty", KL_PENALTY), ("adjusted", ADJUSTED_REWARD)):
        column = batch.column(name)
        if column.null_count:
            raise InputError(f"{rows.name(_first_null(column))}: {name} is null")
        columns[key] = numpy_view(column.cast(pa.float64()))
    return columns


def _first_null(column: pa.Array) -> int:
    return int(np.flatnonzero(~numpy_valid(column))[0])


# -- the curves -------------------------------------------------------------------------------------


@dataclass
class Curves:
    """One point per controller batch (consecutive rows of one step, as score forms them), or per row."""

    labels: list  # (batches,) the step label, or the row's position
    numeric: bool  # labels are numbers (an integer step column, or row positions)
    x_label: str
    rows: np.ndarray  # (batches,) rows in the batch
    kl_mean: np.ndarray  # (batches,)
    kl_coeff: np.ndarray | None  # (batches,) the coefficient applied to the batch (scored files)
    reward_mean: np.ndarray
    adjusted_mean: np.ndarray | None


def curves(figures: RowFigures) -> Curves:
    n = len(figures)
    if figures.steps is not None and n:
        steps = figures.steps
        codes = numpy_view(steps.dictionary_encode().indices)  # (rows,) one code per distinct step; no nulls
        starts = np.concatenate([[0], np.flatnonzero(codes[1:] != codes[:-1]) + 1])
        labels = steps.take(from_numpy(starts)).to_pylist()
        numeric = pa.types.is_integer(steps.type)
        x_label = "step" if numeric else "step (in order)"
    else:
        starts = np.arange(n)
        labels = list(range(n))
        numeric, x_label = True, "row"
    counts = np.diff(np.concatenate([starts, [n]]))

    def mean(values: np.ndarray) -> np.ndarray:
        means: np.ndarray = np.add.reduceat(values, starts) / counts if n else np.zeros(0)
        return means

    return Curves(labels=labels, numeric=numeric, x_label=x_label, rows=counts, kl_mean=mean(figures.kl),
                  kl_coeff=None if figures.kl_coeff is None else figures.kl_coeff[starts],
                  reward_mean=mean(figures.reward),
                  adjusted_mean=None if figures.adjusted is None else mean(figures.adjusted))


# -- which rows the page embeds ---------------------------------------------------------------------


@dataclass
class Selection:
    """The rows the page embeds, in the page's order: those behind the >N-nat warning first."""

    indices: np.ndarray  # (picked,) row positions in the file
    extreme: np.ndarray  # (picked,) bool: the row has a token above the threshold
    candidates: int  # rows the pick was made among (after --step)
    how: str  # how they were picked, said for a person


def _numpy_bool(array: pa.Array) -> np.ndarray:
    """(len,) bool, False where null; through the buffers (Array.to_numpy and fill_null load pandas: seconds)."""
    return numpy_view(array.cast(pa.int8())).astype(bool) & numpy_valid(array)


def sort_values(figures: RowFigures, sort: str, path: object) -> np.ndarray:
    """(rows,) the value `sort` orders rows by, largest first."""
    if sort == "kl":
        return figures.kl
    if sort == "max-token":
        return figures.max_gap
    if sort == "log-ppl-diff":
        if figures.log_ppl_diff is None:
            raise InputError(f"{path}: --sort log-ppl-diff needs the sampler's logprobs (a sampler_logprobs column) "
                             "beside the trainer's policy_logprobs")
        return np.nan_to_num(np.abs(figures.log_ppl_diff), nan=-1.0)  # rows without a usable token last
    if figures.penalty is None:
        raise InputError(f"{path}: --sort penalty needs a scored file (kl_penalty); this is a cache: "
                         "run klpipe score on it, or sort by kl")
    return figures.penalty


def select_rows(figures: RowFigures, path: object, *, sort: str = "kl", top: int = 50, rows: Sequence[str] = (),
                steps: Sequence[str] = (), extreme_nats: float = 20.0) -> Selection:
    """The rows named by `rows` (ids), or the `top` by `sort`, among those of `steps` when given.

    Rows with a token whose |policy − ref| exceeds `extreme_nats` come first (largest first), and are
    always among the top: they are what the >20-nat warning of klpipe score names. Ties keep file order.
    """
    n = len(figures)
    keep = np.ones(n, dtype=bool)
    if steps:
        if figures.steps is None:
            raise InputError(f"{path}: --step needs a step column; the file has none")
        labels = figures.steps.cast(pa.string())
        found = set(labels.to_pylist())
        absent = [s for s in steps if s not in found]
        if absent:
            raise InputError(f"{path}: no row of step {absent[0]!r}")
        keep &= _numpy_bool(pc.is_in(labels, value_set=pa.array(list(steps), pa.string())))
    values = sort_values(figures, sort, path)
    extreme_rows = figures.max_gap > extreme_nats
    if rows:
        if figures.ids is None:
            raise InputError(f"{path}: --row picks rows by id, and the file has no id column")
        ids = figures.ids.cast(pa.string())
        picked = []
        for wanted in dict.fromkeys(rows):  # once each, in the order given
            matches = np.flatnonzero(_numpy_bool(pc.equal(ids, wanted)) & keep)
            if not len(matches):
                where = f" in step {', '.join(steps)}" if steps else ""
                raise InputError(f"{path}: no row with id {wanted!r}{where}")
            picked.extend(matches.tolist())
        order = np.array(picked, dtype=np.int64)
        order = np.concatenate([order[extreme_rows[order]], order[~extreme_rows[order]]])
        how = f"{len(order)} row(s) named with --row"
    else:
        candidates = np.flatnonzero(keep)
        flagged = candidates[extreme_rows[candidates]]
        flagged = flagged[np.argsort(-figures.max_gap[flagged], kind="stable")]
        rest = candidates[~extreme_rows[candidates]]
        rest = rest[np.argsort(-values[rest], kind="stable")]
        order = np.concatenate([flagged, rest])[:top].astype(np.int64)
        how = f"the top {len(order)} by {sort}" + (f" in step {', '.join(steps)}" if steps else "")
    return Selection(indices=order, extreme=extreme_rows[order], candidates=int(keep.sum()), how=how)
