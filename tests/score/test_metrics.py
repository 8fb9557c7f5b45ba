"""`klpipe score --tensorboard` and `--metrics-jsonl`: real runs, events read back with TensorBoard's own reader.

Every scalar of every step is held against the report's per-step entries (or, without a step
column, against the scored rows), and a continuation through `--state` against one run over both days.
"""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from klpipe.cache import POLICY_LOGPROBS, REWARD, STEP
from klpipe.score.metrics import METRICS, PREFIX
from tests.helpers import (
    CACHE_SCHEMA,
    EXACT_SCHEMA,
    RUN_KLPIPE,
    block_imports,
    exact_provenance,
    make_rows,
    run_cli,
    run_python,
    with_exact_columns,
    write_cache,
)

TARGET = 3.0  # the default --kl-target
STRING_STEPS = pa.schema([pa.field(STEP, pa.string()) if f.name == STEP else f for f in CACHE_SCHEMA])
NO_STEPS = pa.schema([f for f in CACHE_SCHEMA if f.name != STEP])


def read_events(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] over every event file in `directory`, as TensorBoard reads them."""
    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0})  # 0: every point, not a sample
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def as_events(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """What the event files must hold for `records`: TensorBoard keeps scalars as float32."""
    return {PREFIX + name: [(r["step"], float(np.float32(r[name]))) for r in records] for name in METRICS}


def from_report(report: dict, steps: list[int]) -> list[dict]:
    """The metrics records the report's per-step entries stand for, at x values `steps`."""
    return [
        {"step": x, "kl": s["kl_mean"], "kl_coef": s["kl_coeff_before"], "kl_coef_after": s["kl_coeff_after"],
         "reward_kl_penalty": s["kl_mean"], "reward_kl_penalty_coeff": s["kl_coeff_before"],
         "reward": s["reward_mean_before"], "kl_penalty": s["kl_penalty_mean"],
         "adjusted_reward": s["reward_mean_after"],
         "kl_target": TARGET, "kl_target_low": 0.5 * TARGET, "kl_target_high": 1.5 * TARGET,
         "rows": s["rows"], "tokens": s["tokens"]}
        for x, s in zip(steps, report["steps"], strict=True)
    ]  # fmt: skip


def from_scored_rows(scored: Path, first: int) -> list[dict]:
    """Without a step column each row is a batch: its record is the row's own values in the scored file."""
    rows = pq.read_table(scored).to_pylist()
    return [
        {"step": first + i, "kl": r["kl"], "kl_coef": r["kl_coeff"],
         "kl_coef_after": rows[i + 1]["kl_coeff"] if i + 1 < len(rows) else None,  # the last: the state's coefficient
         "reward_kl_penalty": r["kl"], "reward_kl_penalty_coeff": r["kl_coeff"],
         "reward": r[REWARD], "kl_penalty": r["kl_penalty"], "adjusted_reward": r["adjusted_reward"],
         "kl_target": TARGET, "kl_target_low": 0.5 * TARGET, "kl_target_high": 1.5 * TARGET,
         "rows": 1, "tokens": len(r[POLICY_LOGPROBS])}
        for i, r in enumerate(rows)
    ]  # fmt: skip


def score(tmp_path: Path, cache: Path, name: str, *options: str) -> dict:
    """`klpipe score CACHE` as a fresh process, writing NAME.parquet and NAME.json; returns the report."""
    result = run_cli("score", str(cache), "-o", str(tmp_path / f"{name}.parquet"),
                     "--report", str(tmp_path / f"{name}.json"), *options)
    assert result.returncode == 0, result.stderr
    return json.loads((tmp_path / f"{name}.json").read_text())


def test_every_scalar_of_every_step_matches_the_report(tmp_path):
    rows = make_rows(48, rows_per_step=4)  # 12 integer steps; the window rule adapts the coefficient on the way
    cache = write_cache(tmp_path / "day.parquet", rows)
    runs, jsonl = tmp_path / "runs", tmp_path / "metrics.jsonl"
    report = score(tmp_path, cache, "out", "--tensorboard", str(runs), "--metrics-jsonl", str(jsonl))

    steps = report["steps"]
    assert [s["step"] for s in steps] == list(range(12))
    assert len({s["kl_coeff_before"] for s in steps}) > 1  # the curves have something to show
    # The entries' new values, against the scored rows themselves.
    scored = pq.read_table(tmp_path / "out.parquet").to_pylist()
    for entry in steps:
        step_rows = [r for r in scored if r[STEP] == entry["step"]]
        assert entry["tokens"] == sum(len(r[POLICY_LOGPROBS]) for r in step_rows)
        assert entry["kl_mean"] == pytest.approx(np.mean([r["kl"] for r in step_rows]), abs=1e-12)
        assert entry["kl_penalty_mean"] == pytest.approx(np.mean([r["kl_penalty"] for r in step_rows]), abs=1e-12)

    expected = from_report(report, [s["step"] for s in steps])
    assert read_jsonl(jsonl) == expected  # full precision, key order included
    assert [list(r) for r in read_jsonl(jsonl)] == [["step", *METRICS]] * 12
    assert read_events(runs) == as_events(expected)
    assert [p.name for p in runs.iterdir()] == ["events.out.tfevents.00000000000000000000.klpipe"]


def test_the_exact_figures_of_every_step_go_beside_the_kl(tmp_path):
    """With the exact KL's columns each record gains score/exact.py's figures, as the report's step entries hold them,
    under klpipe/ in TensorBoard like the rest."""
    rows = with_exact_columns(make_rows(24, rows_per_step=4, dyadic=False))
    cache = write_cache(tmp_path / "day.parquet", rows, schema=EXACT_SCHEMA, provenance=exact_provenance())
    runs, jsonl = tmp_path / "runs", tmp_path / "metrics.jsonl"
    report = score(tmp_path, cache, "out", "--tensorboard", str(runs), "--metrics-jsonl", str(jsonl))
    steps = report["steps"]
    figures = ["exact_kl", "exact_kl_ref_policy", "k1_kl", "k3_kl", "k1_spread", "k3_spread", "policy_entropy",
               "ref_entropy"]
    expected = [entry["exact"] | record for entry, record in zip(steps, from_report(report, list(range(6))),
                                                                  strict=True)]
    assert all(set(entry["exact"]) == set(figures) for entry in steps)
    assert read_jsonl(jsonl) == expected
    events = read_events(runs)
    assert events == as_events(expected) | {
        PREFIX + name: [(r["step"], float(np.float32(r[name]))) for r in expected] for name in figures}
    assert {tag for tag in events if not tag.startswith(PREFIX)} == set()  # every tag under klpipe/


def write_days(tmp_path: Path, kind: str) -> tuple[Path, Path, Path]:
    """Day 1, day 2 and both days as one cache, with integer steps, string steps or no step column."""
    rows = make_rows(40, rows_per_step=4)
    schema = {"integer": CACHE_SCHEMA, "string": STRING_STEPS, "none": NO_STEPS}[kind]
    if kind == "string":
        rows = [{**r, STEP: f"2026-11-29/{r[STEP]:02d}"} for r in rows]
    cut = 24 if kind != "none" else 15  # step-aligned for steps; mid-"step" does not matter without them
    return tuple(write_cache(tmp_path / f"cache-{name}.parquet", part, schema)
                 for name, part in (("day1", rows[:cut]), ("day2", rows[cut:]), ("both", rows)))


@pytest.mark.parametrize("kind", ["integer", "string", "none"])
def test_day_two_continues_the_curves_and_a_rerun_replaces_its_points(tmp_path, kind):
    day1, day2, both = write_days(tmp_path, kind)
    state, runs = tmp_path / "state.json", tmp_path / "runs"

    def day(cache: Path, name: str) -> dict:
        return score(tmp_path, cache, name, "--state", str(state), "--tensorboard", str(runs),
                     "--metrics-jsonl", str(tmp_path / f"{name}.jsonl"))

    day(day1, "day1")
    after_day1 = state.read_text()
    report2 = day(day2, "day2")
    whole = score(tmp_path, both, "whole", "--tensorboard", str(tmp_path / "whole-runs"),
                  "--metrics-jsonl", str(tmp_path / "whole.jsonl"))

    # Day 1 then day 2 draws exactly the curves of one run over both days: same steps, same values.
    events = read_events(runs)
    assert set(events) == {PREFIX + name for name in METRICS}
    assert events == read_events(tmp_path / "whole-runs")
    batches = whole["summary"]["batches"]  # 10 steps, or 40 rows each its own batch
    assert all([step for step, _ in points] == list(range(batches)) for points in events.values())
    assert read_jsonl(tmp_path / "day1.jsonl") + read_jsonl(tmp_path / "day2.jsonl") == read_jsonl(
        tmp_path / "whole.jsonl")
    assert json.loads(state.read_text())["last_run"]["controller_batches"] == batches
    day2_first = read_jsonl(tmp_path / "day2.jsonl")[0]["step"]
    assert day2_first == (6 if kind != "none" else 15)
    names = ["events.out.tfevents.00000000000000000000.klpipe", f"events.out.tfevents.{day2_first:020d}.klpipe"]
    assert sorted(p.name for p in runs.iterdir()) == names  # run order; no scratch directory left behind

    # What the records hold, against the report (steps) or the scored rows (no step column).
    day2_jsonl = read_jsonl(tmp_path / "day2.jsonl")
    if kind == "none":
        expected = from_scored_rows(tmp_path / "day2.parquet", first=day2_first)
        expected[-1]["kl_coef_after"] = json.loads(state.read_text())["kl_coeff"]
        assert report2["steps"] == []  # each row is its batch: the scored file holds the values, not the report
    else:
        expected = from_report(report2, list(range(day2_first, day2_first + len(report2["steps"]))))
    assert day2_jsonl == expected

    # A crash after the events but before the state was saved: the same continuation again.
    state.write_text(after_day1)
    day(day2, "day2")
    assert sorted(p.name for p in runs.iterdir()) == names
    assert read_events(runs) == events
    assert read_jsonl(tmp_path / "day2.jsonl") == day2_jsonl


def test_integer_steps_are_the_x_axis_as_they_are(tmp_path):
    rows = [{**r, STEP: 1000 + 10 * r[STEP]} for r in make_rows(12, rows_per_step=4)]  # steps 1000, 1010, 1020
    cache = write_cache(tmp_path / "day.parquet", rows)
    score(tmp_path, cache, "out", "--metrics-jsonl", str(tmp_path / "m.jsonl"), "--tensorboard", str(tmp_path / "tb"))
    assert [r["step"] for r in read_jsonl(tmp_path / "m.jsonl")] == [1000, 1010, 1020]
    assert [step for step, _ in read_events(tmp_path / "tb")[PREFIX + "kl"]] == [1000, 1010, 1020]
    assert [p.name for p in (tmp_path / "tb").iterdir()] == ["events.out.tfevents.00000000000000001000.klpipe"]


def test_the_options_read_their_environment_variables(tmp_path):
    cache = write_cache(tmp_path / "day.parquet", make_rows(8))
    env = {"KLPIPE_SCORE_TENSORBOARD": str(tmp_path / "tb"), "KLPIPE_SCORE_METRICS_JSONL": str(tmp_path / "m.jsonl")}
    result = run_cli("score", str(cache), "-o", str(tmp_path / "out.parquet"), env=env)
    assert result.returncode == 0, result.stderr
    assert len(read_jsonl(tmp_path / "m.jsonl")) == 2 and len(read_events(tmp_path / "tb")[PREFIX + "kl"]) == 2


# -- the optional extra -----------------------------------------------------------------------------

def test_a_missing_tensorboardx_is_one_line_before_scoring(tmp_path):
    cache = write_cache(tmp_path / "day.parquet", make_rows(8))
    code = block_imports("tensorboardX") + RUN_KLPIPE
    result = run_python(code, "score", str(cache), "-o", str(tmp_path / "out.parquet"), "--tensorboard", "runs/kl")
    assert result.returncode == 2
    assert result.stderr == "Error: runs/kl: --tensorboard needs tensorboardX: pip install 'klpipe[tensorboard]'\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["day.parquet"]  # nothing scored
    # --metrics-jsonl alone needs nothing beyond klpipe.
    result = run_python(code, "score", str(cache), "-o", str(tmp_path / "out.parquet"), "--metrics-jsonl",
                     str(tmp_path / "m.jsonl"))
    assert result.returncode == 0, result.stderr
    assert len(read_jsonl(tmp_path / "m.jsonl")) == 2


def test_tensorboardx_is_imported_only_when_asked_for_and_torch_never(tmp_path):
    cache = write_cache(tmp_path / "day.parquet", make_rows(8))
    code = (
        "import sys\nfrom pathlib import Path\nfrom klpipe.score import ScoreConfig, score\n"
        "cache, tmp = Path(sys.argv[1]), Path(sys.argv[2])\n"
        "score(ScoreConfig(inputs=[cache], output=tmp / 'a.parquet', metrics_jsonl=tmp / 'm.jsonl'))\n"
        "assert 'tensorboardX' not in sys.modules\n"
        "score(ScoreConfig(inputs=[cache], output=tmp / 'b.parquet', tensorboard=tmp / 'tb'))\n"
        "assert 'tensorboardX' in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)\n"
    )
    result = run_python(code, str(cache), str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert len(read_events(tmp_path / "tb")[PREFIX + "kl"]) == 2


def test_tensorboard_into_a_file_is_refused_before_scoring(tmp_path):
    cache = write_cache(tmp_path / "day.parquet", make_rows(8))
    (tmp_path / "runs").write_text("not a directory")
    result = run_cli("score", str(cache), "-o", str(tmp_path / "out.parquet"), "--tensorboard", str(tmp_path / "runs"))
    assert result.returncode == 2
    assert result.stderr == f"Error: {tmp_path / 'runs'}: --tensorboard needs a directory, and this is a file\n"
    assert not (tmp_path / "out.parquet").exists()


def test_a_killed_runs_scratch_directory_is_removed_by_the_next(tmp_path):
    # What a kill -9 while the events are written leaves: TensorBoard would show it as a run.
    runs = tmp_path / "runs"
    (runs / ".klpipe-tensorboard.abcd1234.tmp").mkdir(parents=True)
    (runs / ".klpipe-tensorboard.abcd1234.tmp" / "events.out.tfevents.1.host").write_bytes(b"half")
    cache = write_cache(tmp_path / "day.parquet", make_rows(8))
    score(tmp_path, cache, "out", "--tensorboard", str(runs))
    assert [p.name for p in runs.iterdir()] == ["events.out.tfevents.00000000000000000000.klpipe"]
