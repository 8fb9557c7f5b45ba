import json
import statistics
from itertools import groupby
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from klpipe.cache import ID, METADATA_KEY, POLICY_LOGPROBS, REF_LOGPROBS, REWARD, STEP
from klpipe.errors import InputError, OutputError, ProvenanceError, StateError
from klpipe.score import SCORE_METADATA_KEY, ScoreConfig, default_output, score
from klpipe.score.controller import ControllerConfig
from klpipe.score.input import rows_per_batch
from klpipe.sharding import mark_complete
from tests.helpers import (
    CACHE_SCHEMA,
    make_rows,
    provenance,
    seed_config,
    seed_controller,
    write_cache,
)

SCORED = ["kl", "kl_coeff", "kl_penalty", "adjusted_reward"]


def seed_scores(rows: list[dict], by_step: bool = True, **config) -> tuple[list[dict], object]:
    """The oracle: the seed's get_batch_penalty_from_logprobs over runs of equal `step`."""
    seed = seed_controller(**seed_config(**config))
    scored = []
    groups = [list(g) for _, g in groupby(rows, key=lambda r: r[STEP])] if by_step else [[r] for r in rows]
    for group in groups:
        coeff = seed.kl_coeff
        penalties, _ = seed.get_batch_penalty_from_logprobs(
            [r[POLICY_LOGPROBS] for r in group], [r[REF_LOGPROBS] for r in group]
        )
        kls = seed._kl_history[-len(group) :] if group else []
        for row, kl, penalty in zip(group, kls, penalties, strict=True):
            scored.append(
                {"kl": kl, "kl_coeff": coeff, "kl_penalty": penalty, "adjusted_reward": row[REWARD] - penalty}
            )
    return scored, seed


def read(path: Path, columns=None) -> list[dict]:
    return pq.read_table(path, columns=columns).to_pylist()


def run(tmp_path: Path, inputs, **options):
    options.setdefault("output", tmp_path / "scored.parquet")
    return score(ScoreConfig(inputs=list(inputs), **options))


CONTROL = {"kl_target": 0.6, "window": 6}  # moves the coefficient both ways on make_rows data


def test_output_matches_the_seed_with_steps_spanning_batches_and_files(tmp_path):
    rows = make_rows(60, rows_per_step=5)
    # Row 23 sits inside step 4, so that step spans the two files; 3-row record batches split steps too.
    first = write_cache(tmp_path / "a.parquet", rows[:23])
    second = write_cache(tmp_path / "b.parquet", rows[23:])
    assert rows_per_batch(pq.ParquetFile(first), 8, ScoreConfig.batch_bytes) < 5  # record batches smaller than a step
    result = run(tmp_path, [first, second], batch_tokens=8, controller=ControllerConfig(**CONTROL))

    expected, seed = seed_scores(rows, **CONTROL)
    assert read(result.output, SCORED) == expected
    assert read(result.output, CACHE_SCHEMA.names) == rows  # every input column, in order
    assert len({r["kl_coeff"] for r in expected}) > 3  # the oracle really adapted
    assert result.report["summary"]["kl_coeff_after"] == seed.kl_coeff


def test_the_readme_worked_example_by_hand(tmp_path):
    """The worked example on docs/score.md (Controllers, reports and state), every number derived by hand."""
    rows = [  # (id, step, policy, ref, reward): per-row KL = mean(policy − ref), clamped at 0
        ("a", 0, [-1.0, -2.0], [-2.0, -3.0], 1.0),  # (1 + 1) / 2 = 1
        ("b", 0, [-0.5], [-4.5], 2.0),  # 4
        ("c", 1, [-1.0], [-1.0], 0.5),  # 0
        ("d", 1, [-3.0, -1.0], [-1.0, -1.0], 0.0),  # (−2 + 0) / 2 = −1, clamped to 0
        ("e", 2, [-1.0], [-9.0], 3.0),  # 8
    ]
    cache = write_cache(tmp_path / "day.parquet", [
        {ID: i, STEP: step, POLICY_LOGPROBS: p, REF_LOGPROBS: r, REWARD: w} for i, step, p, r, w in rows])
    result = run(tmp_path, [cache], controller=ControllerConfig(kl_target=2.0, window=2))
    # step 0 at 0.1; last 2 KLs (1, 4) average 2.5, inside 1..3: stays 0.1
    # step 1 at 0.1; last 2 (0, 0) average 0 < 1: × 0.8 = 0.08
    # step 2 at 0.08; last 2 (0, 8) average 4 > 3: × 1.5 = 0.12
    assert read(result.output, SCORED) == [
        {"kl": 1.0, "kl_coeff": 0.1, "kl_penalty": 0.1, "adjusted_reward": 0.9},
        {"kl": 4.0, "kl_coeff": 0.1, "kl_penalty": 0.4, "adjusted_reward": 1.6},
        {"kl": 0.0, "kl_coeff": 0.1, "kl_penalty": 0.0, "adjusted_reward": 0.5},
        {"kl": 0.0, "kl_coeff": 0.1, "kl_penalty": 0.0, "adjusted_reward": 0.0},
        {"kl": 8.0, "kl_coeff": pytest.approx(0.08), "kl_penalty": pytest.approx(0.64),
         "adjusted_reward": pytest.approx(2.36)},
    ]
    summary = result.report["summary"]
    assert summary["kl_coeff_after"] == pytest.approx(0.12) and summary["kl/adaptation_count"] == 2
    assert [(s["step"], s["kl_coeff_before"]) for s in result.report["steps"]] == [
        (0, 0.1), (1, 0.1), (2, pytest.approx(0.08))]
    assert summary["kl/mean"] == 2.6 and summary["negative_k1_fraction"] == 0.2  # 13 / 5; row d


def test_without_a_step_column_each_row_is_its_own_batch(tmp_path):
    rows = make_rows(30)
    schema = pa.schema([f for f in CACHE_SCHEMA if f.name != STEP])
    cache = write_cache(tmp_path / "a.parquet", rows, schema=schema)
    result = run(tmp_path, [cache], batch_tokens=20, controller=ControllerConfig(**CONTROL))
    expected, _ = seed_scores(rows, by_step=False, **CONTROL)
    assert read(result.output, SCORED) == expected
    assert result.report["steps"] == [] and result.report["summary"]["batches"] == 30


@pytest.mark.parametrize("kind", ["proportional", "fixed"])
def test_other_controllers_apply_coefficient_before_each_step(tmp_path, kind):
    rows = make_rows(24, rows_per_step=6)
    cache = write_cache(tmp_path / "a.parquet", rows)
    result = run(tmp_path, [cache], controller=ControllerConfig(controller=kind, kl_target=0.5, horizon=10))
    scored = read(result.output)
    coeff = 0.1
    for _, group in groupby(scored, key=lambda r: r[STEP]):
        group = list(group)
        assert {r["kl_coeff"] for r in group} == {coeff}
        assert all(
            r["kl_penalty"] == coeff * r["kl"] and r["adjusted_reward"] == r[REWARD] - r["kl_penalty"] for r in group
        )
        if kind == "proportional":
            error = min(max(sum(r["kl"] for r in group) / len(group) / 0.5 - 1, -0.2), 0.2)
            coeff = min(1.0, max(0.01, coeff * (1 + error * len(group) / 10)))
    assert kind == "fixed" or coeff != 0.1


@pytest.mark.parametrize("estimator", ["abs", "k2", "k3"])
def test_estimators_and_sum_aggregate_with_per_token_lists(tmp_path, estimator):
    rows = make_rows(12)
    cache = write_cache(tmp_path / "a.parquet", rows)
    result = run(tmp_path, [cache], estimator=estimator, aggregate="sum", per_token=True)
    import math

    def token(p, r):
        d = p - r
        return {"abs": abs(d), "k2": 0.5 * d * d, "k3": math.exp(-d) + d - 1}[estimator]

    for row, out in zip(rows, read(result.output), strict=True):
        tokens = [token(p, r) for p, r in zip(row[POLICY_LOGPROBS], row[REF_LOGPROBS], strict=True)]
        assert out["kl_per_token"] == pytest.approx(tokens, rel=1e-12, abs=1e-12)
        assert out["kl"] == pytest.approx(sum(tokens), rel=1e-12, abs=1e-12)


def test_unclamped_k1_can_be_negative(tmp_path):
    rows = [
        {ID: "a", STEP: 0, POLICY_LOGPROBS: [-3.0], REF_LOGPROBS: [-1.0], REWARD: 1.0},
        {ID: "b", STEP: 0, POLICY_LOGPROBS: [], REF_LOGPROBS: [], REWARD: 1.0},
    ]
    cache = write_cache(tmp_path / "a.parquet", rows)
    assert [r["kl"] for r in read(run(tmp_path, [cache], clamp=False).output)] == [-2.0, 0.0]
    assert [r["kl"] for r in read(run(tmp_path, [cache]).output)] == [0.0, 0.0]


def test_report_summary_and_steps(tmp_path):
    rows = make_rows(40, rows_per_step=8)
    cache = write_cache(tmp_path / "a.parquet", rows)
    result = run(tmp_path, [cache], report=tmp_path / "report.json", controller=ControllerConfig(**CONTROL))
    report = json.loads((tmp_path / "report.json").read_text())
    assert report == json.loads(json.dumps(result.report))
    scored = read(result.output)
    kls = [r["kl"] for r in scored]
    summary = report["summary"]
    percentiles = statistics.quantiles(kls, n=100, method="inclusive")
    assert summary["rows"] == 40 and summary["batches"] == 5
    assert summary["kl/mean"] == round(statistics.fmean(kls), 4)
    assert summary["kl/std"] == round(statistics.pstdev(kls), 4)
    assert (summary["kl/min"], summary["kl/max"]) == (round(min(kls), 4), round(max(kls), 4))
    assert [summary["kl/p50"], summary["kl/p90"], summary["kl/p99"]] == [round(percentiles[i], 4) for i in (49, 89, 98)]
    assert summary["kl/samples_processed"] == 40
    raw_k1_sums = [sum(p - r for p, r in zip(row[POLICY_LOGPROBS], row[REF_LOGPROBS], strict=True)) for row in rows]
    assert summary["negative_k1_fraction"] == sum(total < 0 for total in raw_k1_sums) / 40
    assert summary["reward_mean_before"] == pytest.approx(statistics.fmean(r[REWARD] for r in rows))
    assert summary["reward_mean_after"] == pytest.approx(statistics.fmean(r["adjusted_reward"] for r in scored))
    assert summary["kl_coeff_before"] == 0.1
    assert sum(report["histogram"]["counts"]) == 40

    steps = report["steps"]
    assert [s["step"] for s in steps] == [0, 1, 2, 3, 4]
    for i, step in enumerate(steps):
        step_rows = [r for r in scored if r[STEP] == step["step"]]
        assert step["rows"] == 8
        assert step["kl_coeff_before"] == step_rows[0]["kl_coeff"]
        assert step["kl/mean"] == round(statistics.fmean(r["kl"] for r in step_rows), 4)
        assert step["reward_mean_after"] == pytest.approx(statistics.fmean(r["adjusted_reward"] for r in step_rows))
        assert step["tokens"] == sum(len(r[POLICY_LOGPROBS]) for r in step_rows)
        assert step["kl_mean"] == pytest.approx(statistics.fmean(r["kl"] for r in step_rows))
        assert step["kl_penalty_mean"] == pytest.approx(statistics.fmean(r["kl_penalty"] for r in step_rows))
        if i + 1 < len(steps):
            assert step["kl_coeff_after"] == steps[i + 1]["kl_coeff_before"]
    assert steps[-1]["kl_coeff_after"] == summary["kl_coeff_after"]
    assert summary["kl/adaptation_count"] == sum(s["kl_coeff_after"] != s["kl_coeff_before"] for s in steps)


def test_extreme_rows_are_named(tmp_path):
    rows = make_rows(6)
    rows[1][POLICY_LOGPROBS], rows[1][REF_LOGPROBS] = [-1.0, -0.5], [-26.0, -0.5]
    rows[4][POLICY_LOGPROBS], rows[4][REF_LOGPROBS] = [-30.0], [-1.0]
    cache = write_cache(tmp_path / "a.parquet", rows)
    result = run(tmp_path, [cache])
    assert result.warnings == [
        (f"2 row(s) have a token with |policy − ref| above 20 nats: {cache}: row 1 (id 'r1'); "
         f"{cache}: row 4 (id 'r4'). "
         "This almost always means the policy and the reference tokenized the text differently.")
    ]
    assert result.report["extreme_rows"]["count"] == 2


# -- state across runs ------------------------------------------------------------------------------


def test_day_one_then_day_two_equals_one_run(tmp_path):
    rows = make_rows(80, rows_per_step=4)
    day1 = write_cache(tmp_path / "day1.parquet", rows[:36])
    day2 = write_cache(tmp_path / "day2.parquet", rows[36:])
    both = write_cache(tmp_path / "both.parquet", rows)
    control = ControllerConfig(**CONTROL)
    state = tmp_path / "state.json"
    run(tmp_path, [day1], output=tmp_path / "out1.parquet", state=state, controller=control)
    split = run(tmp_path, [day2], output=tmp_path / "out2.parquet", state=state, controller=control)
    whole = run(tmp_path, [both], output=tmp_path / "whole.parquet", state=tmp_path / "whole.json", controller=control)

    assert read(tmp_path / "out1.parquet") + read(tmp_path / "out2.parquet") == read(tmp_path / "whole.parquet")
    split_state, whole_state = json.loads(state.read_text()), json.loads((tmp_path / "whole.json").read_text())
    split_run, whole_run = split_state.pop("last_run"), whole_state.pop("last_run")
    assert split_run["last_step"] == whole_run["last_step"] == 19
    assert split_run["controller_batches"] == whole_run["controller_batches"] == 20  # 9 steps on day 1, 11 on day 2
    assert split_state == whole_state
    assert split.warnings == [] and whole.report["summary"]["kl_coeff_after"] == split_state["kl_coeff"]


def test_state_from_another_target_is_refused_unless_reset(tmp_path):
    cache = write_cache(tmp_path / "a.parquet", make_rows(8))
    state = tmp_path / "state.json"
    run(tmp_path, [cache], state=state)
    with pytest.raises(StateError) as excinfo:
        run(
            tmp_path,
            [cache],
            state=state,
            output=tmp_path / "again.parquet",
            controller=ControllerConfig(kl_target=2.0),
        )
    assert str(excinfo.value) == (
        f"{state}: state was made with the window controller and kl_target 3.0, this run uses the window controller "
        "and kl_target 2.0; pass --reset-state to start a fresh controller"
    )
    assert not (tmp_path / "again.parquet").exists()
    run(tmp_path, [cache], state=state, reset_state=True, controller=ControllerConfig(kl_target=2.0))
    assert json.loads(state.read_text())["config"]["kl_target"] == 2.0


def test_state_warnings_for_a_split_step_and_a_repeated_run(tmp_path):
    rows = make_rows(12, rows_per_step=4)
    day1 = write_cache(tmp_path / "day1.parquet", rows[:6])
    day2 = write_cache(tmp_path / "day2.parquet", rows[6:])
    state = tmp_path / "state.json"
    run(tmp_path, [day1], state=state)
    assert run(tmp_path, [day2], state=state).warnings == [
        ("step 1 continues from the previous run recorded in the state file; it is scored as a new controller "
         "batch, so its coefficients differ from scoring both runs together")
    ]
    assert run(tmp_path, [day2], state=state).warnings == [
        f"{state}: these inputs were already scored into this state file; scoring them again moves the controller twice"
    ]


def test_corrupt_state_file_is_refused(tmp_path):
    state = tmp_path / "state.json"
    state.write_text("{not json")
    with pytest.raises(StateError, match=r"state.json: not a readable controller state file \(Expecting"):
        run(tmp_path, [write_cache(tmp_path / "a.parquet", make_rows(3))], state=state)


def test_a_state_with_a_bad_batch_count_is_refused(tmp_path):
    cache = write_cache(tmp_path / "a.parquet", make_rows(3))
    state = tmp_path / "state.json"
    run(tmp_path, [cache], state=state)
    saved = json.loads(state.read_text())
    saved["last_run"]["controller_batches"] = -1
    state.write_text(json.dumps(saved))
    with pytest.raises(StateError, match=r"state.json: last_run.controller_batches must be a non-negative integer, "
                                         r"got -1$"):
        run(tmp_path, [cache], state=state)


# -- inputs and outputs -----------------------------------------------------------------------------


def test_default_output_sits_beside_the_first_input(tmp_path):
    cache = write_cache(tmp_path / "day1.parquet", make_rows(3))
    assert default_output(cache) == tmp_path / "day1.scored.parquet"
    (tmp_path / "caches").mkdir()
    assert default_output(tmp_path / "caches") == tmp_path / "caches.scored.parquet"
    assert score(ScoreConfig(inputs=[cache])).output == tmp_path / "day1.scored.parquet"
    assert (tmp_path / "day1.scored.parquet").exists()


def test_temporary_files_a_killed_run_left_are_removed_by_the_next(tmp_path):
    cache = write_cache(tmp_path / "a.parquet", make_rows(4))
    left = [".scored.parquet.x7k2m9qa.tmp", ".state.json.p0o9i8u7.tmp", ".report.json.q1w2e3r4.tmp"]
    for name in left:  # a kill -9 mid-write leaves these beside the outputs
        (tmp_path / name).write_bytes(b"half")
    run(tmp_path, [cache], state=tmp_path / "state.json", report=tmp_path / "report.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.parquet", "report.json", "scored.parquet", "state.json"]


def test_a_directory_is_read_in_sorted_order(tmp_path):
    rows = make_rows(10)
    (tmp_path / "caches").mkdir()
    write_cache(tmp_path / "caches" / "b.parquet", rows[5:])
    write_cache(tmp_path / "caches" / "a.parquet", rows[:5])
    result = run(tmp_path, [tmp_path / "caches"])
    assert [r[ID] for r in read(result.output, [ID])] == [r[ID] for r in rows]


def test_provenance_is_kept_and_settings_recorded(tmp_path):
    cache = write_cache(tmp_path / "a.parquet", make_rows(3), provenance=provenance())
    result = run(tmp_path, [cache], estimator="k3")
    metadata = pq.read_schema(result.output).metadata
    assert metadata[METADATA_KEY] == provenance().to_json()
    assert json.loads(metadata[SCORE_METADATA_KEY])["estimator"] == "k3"


def test_rescoring_a_scored_file_replaces_its_columns(tmp_path):
    cache = write_cache(tmp_path / "a.parquet", make_rows(8))
    first = run(tmp_path, [cache], per_token=True, output=tmp_path / "once.parquet")
    second = run(tmp_path, [first.output], output=tmp_path / "twice.parquet", estimator="k2")
    assert second.warnings == [
        ("the input already has scored columns (kl, kl_coeff, kl_penalty, adjusted_reward, kl_per_token); "
         "they are replaced")
    ]
    assert pq.read_schema(second.output).names == CACHE_SCHEMA.names + SCORED


def test_wider_types_are_accepted(tmp_path):
    schema = pa.schema(
        [(POLICY_LOGPROBS, pa.large_list(pa.float64())), (REF_LOGPROBS, pa.list_(pa.float16())), (REWARD, pa.int32())]
    )
    rows = [{POLICY_LOGPROBS: [-1.0, -2.0], REF_LOGPROBS: [-2.0, -4.0], REWARD: 3}]
    result = run(tmp_path, [write_cache(tmp_path / "a.parquet", rows, schema=schema)])
    assert read(result.output, SCORED) == [
        {"kl": 1.5, "kl_coeff": 0.1, "kl_penalty": 0.15000000000000002, "adjusted_reward": 2.85}
    ]


def test_an_empty_cache_scores_to_an_empty_output(tmp_path):
    result = run(tmp_path, [write_cache(tmp_path / "a.parquet", [])], report=tmp_path / "r.json")
    assert pq.read_table(result.output).num_rows == 0
    assert result.report["summary"]["rows"] == 0 and result.report["summary"]["kl/p99"] == 0.0


BAD_ROWS = [
    (
        lambda rows: rows[2].update({REF_LOGPROBS: rows[2][REF_LOGPROBS] + [-1.0]}),
        {},
        ("row 2 (id 'r2'): policy_logprobs has {p} tokens but ref_logprobs has {r}; both must cover the same "
         "response tokens (rerun `klpipe precompute` with the policy's tokenization)"),
    ),
    (
        lambda rows: rows[3].update({POLICY_LOGPROBS: [float("nan")], REF_LOGPROBS: [-1.0]}),
        {},
        "row 3 (id 'r3'): policy_logprobs holds NaN",
    ),
    (
        lambda rows: rows[3].update({POLICY_LOGPROBS: [-1.0, -1.0], REF_LOGPROBS: [-1.0, float("inf")]}),
        {},
        "row 3 (id 'r3'): ref_logprobs holds +inf",
    ),
    (
        lambda rows: rows[3].update({POLICY_LOGPROBS: [float("-inf")], REF_LOGPROBS: [-1.0]}),
        {},
        "row 3 (id 'r3'): policy_logprobs holds -inf",
    ),
    (lambda rows: rows[5].update({REWARD: float("nan")}), {}, "row 5 (id 'r5'): reward is NaN"),
    (lambda rows: rows[5].update({REWARD: None}), {}, "row 5 (id 'r5'): reward is null"),
    (lambda rows: rows[1].update({REF_LOGPROBS: None}), {}, "row 1 (id 'r1'): ref_logprobs is null"),
    (
        lambda rows: rows[1].update({POLICY_LOGPROBS: [-1.0, None], REF_LOGPROBS: [-1.0, -1.0]}),
        {},
        "row 1 (id 'r1'): policy_logprobs holds a null",
    ),
    (lambda rows: rows[4].update({STEP: None}), {}, "row 4 (id 'r4'): step is null"),
    (
        lambda rows: rows[4].update({POLICY_LOGPROBS: [-800.0], REF_LOGPROBS: [-1.0]}),
        {"estimator": "k3"},
        ("row 4 (id 'r4'): the k3 KL overflows (|policy − ref| up to 799 nats); the policy and reference "
         "almost certainly tokenized differently"),
    ),
]


@pytest.mark.parametrize("change, options, message", BAD_ROWS)
def test_bad_rows_are_named(tmp_path, change, options, message):
    rows = make_rows(8)
    change(rows)
    message = message.format(p=len(rows[2][POLICY_LOGPROBS]), r=len(rows[2][REF_LOGPROBS]))
    cache = write_cache(tmp_path / "a.parquet", rows)
    with pytest.raises(InputError) as excinfo:
        run(tmp_path, [cache], batch_tokens=8, state=tmp_path / "state.json", report=tmp_path / "r.json", **options)
    assert str(excinfo.value) == f"{cache}: {message}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.parquet"]  # nothing written, no temp files


def test_rows_without_ids_are_named_by_index_within_their_file(tmp_path):
    schema = pa.schema([f for f in CACHE_SCHEMA if f.name != ID])
    rows = make_rows(10)
    rows[7][REWARD] = float("-inf")
    first = write_cache(tmp_path / "a.parquet", rows[:4], schema=schema)
    second = write_cache(tmp_path / "b.parquet", rows[4:], schema=schema)
    with pytest.raises(InputError) as excinfo:
        run(tmp_path, [first, second], batch_tokens=6)
    assert str(excinfo.value) == f"{second}: row 3: reward is -inf"


@pytest.mark.parametrize(
    "dropped, message",
    [
        (REF_LOGPROBS, "no ref_logprobs column; run `klpipe precompute` on it first to add the reference logprobs"),
        (
            POLICY_LOGPROBS,
            ("no policy_logprobs column; the rollouts must carry the sampling policy's per-token logprobs, or "
             "`klpipe precompute --policy MODEL` computes them"),
        ),
        (REWARD, "no reward column; add each rollout's reward before scoring"),
    ],
)
def test_missing_columns_say_what_to_do(tmp_path, dropped, message):
    schema = pa.schema([f for f in CACHE_SCHEMA if f.name != dropped])
    cache = write_cache(tmp_path / "a.parquet", make_rows(3), schema=schema)
    with pytest.raises(InputError) as excinfo:
        run(tmp_path, [cache])
    assert str(excinfo.value) == f"{cache}: {message}"


def test_wrong_column_types_are_refused(tmp_path):
    schema = pa.schema(
        [(POLICY_LOGPROBS, pa.list_(pa.float32())), (REF_LOGPROBS, pa.list_(pa.int64())), (REWARD, pa.float64())]
    )
    cache = write_cache(
        tmp_path / "a.parquet", [{POLICY_LOGPROBS: [-1.0], REF_LOGPROBS: [-1], REWARD: 0.0}], schema=schema
    )
    with pytest.raises(InputError) as excinfo:
        run(tmp_path, [cache])
    assert str(excinfo.value) == f"{cache}: ref_logprobs must be a list of floats, got list<element: int64>"


def test_caches_with_conflicting_provenance_are_refused(tmp_path):
    first = write_cache(tmp_path / "a.parquet", make_rows(3), provenance=provenance())
    second = write_cache(tmp_path / "b.parquet", make_rows(3), provenance=provenance(model="other"))
    with pytest.raises(ProvenanceError) as excinfo:
        run(tmp_path, [first, second])
    assert str(excinfo.value) == (
        f"caches disagree on model: {first} has 'tiny', {second} has 'other'; "
        "score caches made with one reference model and settings at a time"
    )


def test_caches_with_different_columns_are_refused(tmp_path):
    first = write_cache(tmp_path / "a.parquet", make_rows(3))
    second = write_cache(
        tmp_path / "b.parquet", make_rows(3), schema=pa.schema([f for f in CACHE_SCHEMA if f.name != ID])
    )
    with pytest.raises(InputError) as excinfo:
        run(tmp_path, [first, second])
    assert (
        str(excinfo.value)
        == f"{second}: columns differ from {first} (no id); score caches with the same columns together"
    )


def test_output_may_not_overwrite_an_input(tmp_path):
    cache = write_cache(tmp_path / "a.parquet", make_rows(3))
    with pytest.raises(OutputError) as excinfo:
        run(tmp_path, [cache], output=cache)
    assert str(excinfo.value) == f"{cache}: is also an input; pass another --output"


def _shard_directory(tmp_path: Path, rows: list[dict], count: int) -> Path:
    """What a sharded precompute leaves: part-<i>-of-<n>.parquet with provenance and a .done marker."""
    directory = tmp_path / "shards"
    directory.mkdir()
    bounds = [len(rows) * i // count for i in range(count + 1)]
    for i in range(count):
        shard = {"index": i, "count": count, "rows": [bounds[i], bounds[i + 1]]}
        part = write_cache(
            directory / f"part-{i}-of-{count}.parquet",
            rows[bounds[i] : bounds[i + 1]],
            provenance=provenance(shard=shard),
        )
        mark_complete(part, bounds[i + 1] - bounds[i], provenance(shard=shard), tmp_dir=directory)
    return directory


def test_a_shard_directory_is_scored_in_shard_order(tmp_path):
    rows = make_rows(44)
    directory = _shard_directory(tmp_path, rows, count=11)  # part-10 sorts before part-2 as text
    result = run(tmp_path, [directory])
    assert [r[ID] for r in read(result.output, [ID])] == [r[ID] for r in rows]


def test_an_incomplete_shard_directory_is_refused(tmp_path):
    directory = _shard_directory(tmp_path, make_rows(12), count=3)
    (directory / "part-1-of-3.done").unlink()
    with pytest.raises(InputError) as excinfo:
        run(tmp_path, [directory])
    assert str(excinfo.value) == (
        f"{directory}: incomplete: no completion marker for shard 1 of 3; rerun those shards of klpipe precompute first"
    )
    assert not (tmp_path / "scored.parquet").exists()
