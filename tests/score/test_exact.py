"""The exact KL beside the sampled estimators (score/exact.py) and `--estimator full`, through real caches.

The caches are real parquet files with the exact KL's columns written as `klpipe precompute --policy` writes
them (cache.FULL_KL_COLUMNS, null where the mask is 0); every expected value is worked by hand or computed here
with numpy over the file's own columns, never by the code under test.
"""

import json
import math
import statistics

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from klpipe.api import kl_divergence
from klpipe.cache import (
    FULL_KL_COLUMNS,
    ID,
    KL_POLICY_REF,
    KL_REF_POLICY,
    MASK,
    POLICY_ENTROPY,
    POLICY_LOGPROBS,
    REF_ENTROPY,
    REF_LOGPROBS,
    REWARD,
    STEP,
)
from klpipe.errors import InputError
from klpipe.score import ScoreConfig, score
from klpipe.score.controller import ControllerConfig
from klpipe.score.report import exact_line
from tests.helpers import (
    CACHE_SCHEMA,
    EXACT_SCHEMA,
    ROOT,
    exact_provenance,
    make_rows,
    provenance,
    with_exact_columns,
    write_cache,
)

SCORED = ["kl", "kl_coeff", "kl_penalty", "adjusted_reward"]
FIGURES = {"exact_kl", "exact_kl_ref_policy", "k1_kl", "k3_kl", "k1_spread", "k3_spread", "policy_entropy",
           "ref_entropy"}


def run(tmp_path, inputs, **options):
    options.setdefault("output", tmp_path / "scored.parquet")
    return score(ScoreConfig(inputs=list(inputs), **options))


def read(path, columns=None) -> list[dict]:
    return pq.read_table(path, columns=columns).to_pylist()


def k3(k1: float) -> float:
    return math.exp(-k1) + k1 - 1


# (id, step, policy, ref, mask, kl_policy_ref, reward): the KL a sampled estimator would read differs on purpose.
WORKED = [
    ("a", 0, [-1.0, -1.0, -1.0], [-1.0, -2.0, -1.0], [1, 1, 1], [0.5, 1.0, 1.5], 1.0),  # k1 1/3; exact mean 1
    ("b", 0, [-2.0, 0.0, -1.0], [-1.0, None, -3.0], [1, 0, 1], [3.0, None, 5.0], 2.0),  # a tool token: exact 4
    ("c", 1, [-3.0], [-1.0], [1], [0.0], 0.5),  # k1 −2; exact 0
    ("d", 1, [-1.0] * 4, [-1.0] * 4, [1] * 4, [0.25, 0.25, 0.5, 1.0], 0.0),  # k1 0; exact 0.5
    ("e", 2, [-1.0], [-1.0], [1], [8.0], 3.0),  # k1 0; exact 8
]


def worked_cache(tmp_path):
    rows = []
    for i, step, policy, ref, mask, kl, reward in WORKED:
        other = [None if v is None else v / 2 for v in kl]  # the other columns: any values ≥ 0, read by the section
        rows.append({ID: i, STEP: step, POLICY_LOGPROBS: policy, REF_LOGPROBS: ref, MASK: mask, KL_POLICY_REF: kl,
                     KL_REF_POLICY: other, POLICY_ENTROPY: [None if v is None else 2.0 for v in kl],
                     REF_ENTROPY: [None if v is None else 3.0 for v in kl], REWARD: reward})
    return write_cache(tmp_path / "day.parquet", rows, schema=EXACT_SCHEMA, provenance=exact_provenance())


def test_full_replays_the_controller_by_hand(tmp_path):
    """--estimator full, mean: the per-row KL is the mean exact KL over the mask-1 tokens; --kl-target 2 --window 2."""
    result = run(tmp_path, [worked_cache(tmp_path)], estimator="full", controller=ControllerConfig(kl_target=2.0,
                                                                                                    window=2))
    # step 0 at 0.1: a 1.0 (k1 would say 1/3), b (3 + 5) / 2 = 4 (its tool token's null is not a token);
    #   the last 2 KLs (1, 4) average 2.5, inside 1..3: stays 0.1
    # step 1 at 0.1: c 0 (k1 −2, and no clamp is needed), d 2 / 4 = 0.5; (0, 0.5) average 0.25 < 1: × 0.8 = 0.08
    # step 2 at 0.08: e 8; (0.5, 8) average 4.25 > 3: × 1.5 = 0.12
    assert read(result.output, SCORED) == [
        {"kl": 1.0, "kl_coeff": 0.1, "kl_penalty": 0.1, "adjusted_reward": 0.9},
        {"kl": 4.0, "kl_coeff": 0.1, "kl_penalty": 0.4, "adjusted_reward": 1.6},
        {"kl": 0.0, "kl_coeff": 0.1, "kl_penalty": 0.0, "adjusted_reward": 0.5},
        {"kl": 0.5, "kl_coeff": 0.1, "kl_penalty": 0.05, "adjusted_reward": -0.05},
        {"kl": 8.0, "kl_coeff": pytest.approx(0.08), "kl_penalty": pytest.approx(0.64),
         "adjusted_reward": pytest.approx(2.36)},
    ]
    summary = result.report["summary"]
    assert summary["kl_coeff_after"] == pytest.approx(0.12) and summary["kl/adaptation_count"] == 2
    assert summary["kl/mean"] == 2.7  # 13.5 / 5
    assert summary["negative_k1_fraction"] == 0.2  # row c: its raw k1 still says where the policy sits
    assert result.report["config"]["estimator"] == "full"
    steps = result.report["steps"]
    assert [(s["step"], s["kl_coeff_before"], s["kl_mean"]) for s in steps] == [
        (0, 0.1, 2.5), (1, 0.1, 0.25), (2, pytest.approx(0.08), 8.0)]
    # A step's exact figures are token-weighted: over the 5 sampled tokens of step 0.
    first = steps[0]["exact"]
    assert first["exact_kl"] == 11 / 5  # (0.5 + 1 + 1.5 + 3 + 5) / 5, not the rows' mean 2.5
    k1 = [0.0, 1.0, 0.0, -1.0, 2.0]  # policy − ref of a's three tokens and b's two sampled ones
    exact = [0.5, 1.0, 1.5, 3.0, 5.0]
    assert first["k1_kl"] == pytest.approx(2 / 5, rel=1e-15)
    assert first["k3_kl"] == pytest.approx(sum(k3(d) for d in k1) / 5, rel=1e-12)
    assert first["k1_spread"] == pytest.approx(math.sqrt(2.26), rel=1e-12)  # deviations 1.3, 1.8, 0.3, −2.2, −1.2
    pairs = list(zip(k1, exact, strict=True))
    assert first["k1_spread"] == pytest.approx(statistics.pstdev([a - b for a, b in pairs]), rel=1e-12)
    assert first["k3_spread"] == pytest.approx(statistics.pstdev([k3(a) - b for a, b in pairs]), rel=1e-12)
    assert first["exact_kl_ref_policy"] == 11 / 10 and first["policy_entropy"] == 2.0 and first["ref_entropy"] == 3.0
    assert steps[1]["exact"]["exact_kl"] == 2 / 5 and steps[2]["exact"]["k1_spread"] == 0.0  # 0, .25, .25, .5, 1; 8
    run_figures = result.report["exact"]["run"]
    assert run_figures["tokens"] == 11 and run_figures["exact_kl"] == 21 / 11  # 11 + 2 + 8 over 11 tokens
    assert run_figures["k1_kl"] == pytest.approx(0.0, abs=1e-15)  # 2 − 2 (row c) + 0
    every_k1 = k1 + [-2.0, 0, 0, 0, 0, 0.0]
    every_exact = exact + [0.0, 0.25, 0.25, 0.5, 1.0, 8.0]
    assert run_figures["k1_spread"] == pytest.approx(statistics.pstdev(
        [a - b for a, b in zip(every_k1, every_exact, strict=True)]), rel=1e-12)
    # docs/score.md shows this run's stderr line.
    assert exact_line(result.report["exact"]) in (ROOT / "docs" / "score.md").read_text()


def test_full_with_the_sum_aggregate_by_hand(tmp_path):
    result = run(tmp_path, [worked_cache(tmp_path)], estimator="full", aggregate="sum", per_token=True,
                 controller=ControllerConfig(kl_target=2.0, window=2))
    # step 0 at 0.1: a 3, b 8; (3, 8) average 5.5 > 3: × 1.5 = 0.15
    # step 1 at 0.15: c 0, d 2; (0, 2) average 1, not below 1: stays 0.15
    # step 2 at 0.15: e 8; (2, 8) average 5 > 3: × 1.5 = 0.225
    scored = read(result.output, SCORED + ["kl_per_token"])
    assert [(r["kl"], r["kl_coeff"]) for r in scored] == [
        (3.0, 0.1), (8.0, 0.1), (0.0, pytest.approx(0.15)), (2.0, pytest.approx(0.15)), (8.0, pytest.approx(0.15))]
    assert [r["kl_penalty"] for r in scored] == pytest.approx([0.3, 0.8, 0.0, 0.3, 1.2], rel=1e-12)
    assert result.report["summary"]["kl_coeff_after"] == pytest.approx(0.225)
    # --per-token writes the exact values themselves, null where the mask is 0.
    assert [r["kl_per_token"] for r in scored] == [row[5] for row in WORKED]


def test_the_exact_kl_is_the_mean_of_k1_over_tokens_sampled_from_the_policy(tmp_path):
    """At one position with π and π_ref known, k1 of tokens drawn from π averages to KL(π ‖ π_ref) within its
    standard error; score reads the same from a cache of those samples, k1 beside the exact value."""
    rng = np.random.default_rng(59)
    vocab, draws = 50, 200_000
    # A policy fine-tuned some way from its reference: logits moved by noise of a third of their spread.
    logits = rng.normal(0, 1.5, vocab)
    moved = logits + rng.normal(0, 0.5, vocab)
    ref, policy = np.exp(logits) / np.exp(logits).sum(), np.exp(moved) / np.exp(moved).sum()
    exact = kl_divergence(policy, ref)
    assert exact == pytest.approx(float(np.sum(policy * np.log(policy / ref))), rel=1e-12)  # Σ π log(π / π_ref)
    tokens = rng.choice(vocab, size=draws, p=policy)
    k1 = np.log(policy[tokens]) - np.log(ref[tokens])
    standard_error = k1.std() / math.sqrt(draws)
    assert abs(k1.mean() - exact) < 4 * standard_error
    k3s = np.expm1(-k1) + k1  # unbiased too
    assert abs(k3s.mean() - exact) < 4 * k3s.std() / math.sqrt(draws)
    # The test can fail: the other direction, KL(π_ref ‖ π), 10% away, is outside the error.
    assert abs(k1.mean() - kl_divergence(ref, policy)) > 5 * standard_error

    # The same samples as a cache, 100 tokens a row, each token's exact KL the position's: what klpipe score says.
    policy32, ref32 = np.log(policy[tokens]).astype(np.float32), np.log(ref[tokens]).astype(np.float32)
    values = {KL_POLICY_REF: exact, KL_REF_POLICY: kl_divergence(ref, policy),
              POLICY_ENTROPY: float(-np.sum(policy * np.log(policy))), REF_ENTROPY: float(-np.sum(ref * np.log(ref)))}
    rows = [{ID: f"r{i}", STEP: i // 40, POLICY_LOGPROBS: policy32[i * 100:(i + 1) * 100].tolist(),
             REF_LOGPROBS: ref32[i * 100:(i + 1) * 100].tolist(), MASK: [1] * 100, REWARD: 0.0,
             **{name: [value] * 100 for name, value in values.items()}} for i in range(draws // 100)]  # 2,000 rows
    cache = write_cache(tmp_path / "samples.parquet", rows, schema=EXACT_SCHEMA, provenance=exact_provenance())
    found = run(tmp_path, [cache], batch_tokens=30_000).report["exact"]["run"]  # steps span record batches
    stored = np.float32(exact).astype(np.float64)
    k1_stored = policy32.astype(np.float64) - ref32.astype(np.float64)
    assert found["tokens"] == draws and found["exact_kl"] == pytest.approx(stored, rel=1e-12)
    assert found["k1_kl"] == pytest.approx(k1_stored.mean(), rel=1e-9)
    assert found["k1_spread"] == pytest.approx(np.std(k1_stored - stored), rel=1e-9)
    assert abs(found["k1_kl"] - found["exact_kl"]) < 4 * found["k1_spread"] / math.sqrt(draws)
    assert found["policy_entropy"] == pytest.approx(np.float32(values[POLICY_ENTROPY]), rel=1e-12)


def exact_figures(tokens: list[dict]) -> dict:
    """The FIGURES over a list of sampled tokens {k1, kl, reverse, h, h_ref}, by numpy."""
    column = {key: np.array([t[key] for t in tokens]) for key in tokens[0]}
    k3s = np.expm1(-column["k1"]) + column["k1"]
    return {"exact_kl": column["kl"].mean(), "exact_kl_ref_policy": column["reverse"].mean(),
            "k1_kl": column["k1"].mean(), "k3_kl": k3s.mean(), "k1_spread": np.std(column["k1"] - column["kl"]),
            "k3_spread": np.std(k3s - column["kl"]), "policy_entropy": column["h"].mean(),
            "ref_entropy": column["h_ref"].mean()}


def sampled_tokens(rows: list[dict]) -> list[dict]:
    """Each row's mask-1 tokens with their values from the file, float32 read as float64."""
    out = []
    for row in rows:
        for k, keep in enumerate(row[MASK]):
            if keep:
                out.append({"k1": np.float64(np.float32(row[POLICY_LOGPROBS][k])) - np.float64(
                    np.float32(row[REF_LOGPROBS][k])), "kl": row[KL_POLICY_REF][k], "reverse": row[KL_REF_POLICY][k],
                            "h": row[POLICY_ENTROPY][k], "h_ref": row[REF_ENTROPY][k], "step": row[STEP]})
    return out


def test_every_steps_figures_match_numpy_over_the_files_columns(tmp_path):
    rows = with_exact_columns(make_rows(60, rows_per_step=7, dyadic=False), seed=3)
    first = write_cache(tmp_path / "a.parquet", rows[:25], schema=EXACT_SCHEMA, provenance=exact_provenance())
    second = write_cache(tmp_path / "b.parquet", rows[25:], schema=EXACT_SCHEMA, provenance=exact_provenance())
    result = run(tmp_path, [first, second], batch_tokens=10)  # k1: the exact figures come whatever --estimator is
    tokens = sampled_tokens(rows)
    for entry in result.report["steps"]:
        part = [{k: v for k, v in t.items() if k != "step"} for t in tokens if t["step"] == entry["step"]]
        assert entry["exact"] == pytest.approx(exact_figures(part), rel=1e-9, abs=1e-12), entry["step"]
    everything = [{k: v for k, v in t.items() if k != "step"} for t in tokens]
    assert result.report["exact"]["run"] == pytest.approx(exact_figures(everything) | {"tokens": len(tokens)},
                                                          rel=1e-9, abs=1e-12)
    # The per-row KL stays k1's, and the input's exact columns pass through untouched.
    without = pa.schema([f for f in EXACT_SCHEMA if f.name not in FULL_KL_COLUMNS])
    plain = run(tmp_path, [write_cache(tmp_path / "plain.parquet", rows, schema=without)],
                output=tmp_path / "plain.scored.parquet")
    assert read(result.output, SCORED) == read(plain.output, SCORED)
    assert read(result.output, list(FULL_KL_COLUMNS)) == read(first, list(FULL_KL_COLUMNS)) + read(second,
                                                                                                list(FULL_KL_COLUMNS))


def test_without_a_step_column_the_exact_figures_are_the_runs(tmp_path):
    rows = with_exact_columns(make_rows(20), seed=4)
    schema = pa.schema([f for f in EXACT_SCHEMA if f.name != STEP])
    result = run(tmp_path, [write_cache(tmp_path / "a.parquet", rows, schema=schema, provenance=exact_provenance())],
                 batch_tokens=8, estimator="full")
    tokens = [{k: v for k, v in t.items() if k != "step"} for t in sampled_tokens(rows)]
    assert result.report["steps"] == []
    assert result.report["exact"]["run"] == pytest.approx(exact_figures(tokens) | {"tokens": len(tokens)}, rel=1e-9)


def test_a_k3_that_overflows_is_null_and_left_out_of_the_metrics(tmp_path):
    rows = with_exact_columns(make_rows(8))
    rows[0][POLICY_LOGPROBS] = [-800.0] + rows[0][POLICY_LOGPROBS][1:]  # k1 = −800: exp(800) is past float64
    rows[0][REF_LOGPROBS] = [0.0] + rows[0][REF_LOGPROBS][1:]
    cache = write_cache(tmp_path / "a.parquet", rows, schema=EXACT_SCHEMA, provenance=exact_provenance())
    result = run(tmp_path, [cache], metrics_jsonl=tmp_path / "steps.jsonl")
    first = result.report["steps"][0]["exact"]
    assert first["k3_kl"] is None and first["k3_spread"] is None and first["k1_kl"] < -50
    assert result.report["steps"][1]["exact"]["k3_kl"] is not None  # the next step is its own
    record = json.loads((tmp_path / "steps.jsonl").read_text().splitlines()[0])
    assert "k3_kl" not in record and record["k1_kl"] == first["k1_kl"]


def test_without_the_columns_the_report_is_as_it_was(tmp_path):
    result = run(tmp_path, [write_cache(tmp_path / "a.parquet", make_rows(12))])
    assert result.report["exact"] is None  # as `mismatch` is null without a sampler column
    assert all("exact" not in entry for entry in result.report["steps"])


def test_columns_precompute_did_not_compute_are_passed_through_not_read(tmp_path):
    rows = with_exact_columns(make_rows(8))
    cache = write_cache(tmp_path / "a.parquet", rows, schema=EXACT_SCHEMA, provenance=exact_provenance(full_kl=False))
    result = run(tmp_path, [cache])
    assert result.report["exact"] is None and all("exact" not in entry for entry in result.report["steps"])
    assert (f"{cache}: holds {', '.join(FULL_KL_COLUMNS)} but its provenance says klpipe precompute did not compute "
            "the exact KL (full_kl false): those columns are passed through, not read") in result.warnings
    assert read(result.output, [KL_POLICY_REF]) == read(cache, [KL_POLICY_REF])


def bad(tmp_path, change, schema=EXACT_SCHEMA, made=None):
    rows = with_exact_columns(make_rows(8))
    change(rows)
    return write_cache(tmp_path / "bad.parquet", rows, schema=schema, provenance=made or exact_provenance())


def _set(row: int, name: str, token: int, value):
    def change(rows):
        rows[row][name] = list(rows[row][name])
        rows[row][name][token] = value
    return change


@pytest.mark.parametrize(("change", "options", "message"), [
    (_set(2, KL_POLICY_REF, 0, None), {},
     r"bad.parquet: row 2 \(id 'r2'\): kl_policy_ref holds a null where the mask is 1$"),
    (_set(5, POLICY_ENTROPY, 0, -0.5), {},
     r"row 5 \(id 'r5'\): policy_entropy holds -0.5 where the mask is 1; a KL or an entropy is a finite number ≥ 0$"),
    (_set(3, REF_ENTROPY, 0, float("nan")), {}, r"row 3 \(id 'r3'\): ref_entropy holds NaN where the mask is 1"),
    (_set(6, KL_REF_POLICY, 0, float("inf")), {"estimator": "full"}, r"row 6 \(id 'r6'\): kl_ref_policy holds inf"),
    (lambda rows: rows[4].update({KL_POLICY_REF: rows[4][KL_POLICY_REF] + [1.0]}), {},
     r"row 4 \(id 'r4'\): kl_policy_ref has \d+ tokens but policy_logprobs has \d+; both must cover the same "),
    (lambda rows: rows[0].update({KL_REF_POLICY: None}), {}, r"row 0 \(id 'r0'\): kl_ref_policy is null$"),
])
def test_bad_exact_values_are_named(tmp_path, change, options, message):
    cache = bad(tmp_path, change)
    with pytest.raises(InputError, match=message):
        run(tmp_path, [cache], **options)
    assert not (tmp_path / "scored.parquet").exists()


def test_a_null_where_the_mask_is_0_is_not_a_token(tmp_path):
    rows = with_exact_columns(make_rows(12), seed=1)
    assert any(None in r[KL_POLICY_REF] for r in rows)  # tool spans: the test reads some nulls
    cache = write_cache(tmp_path / "a.parquet", rows, schema=EXACT_SCHEMA, provenance=exact_provenance())
    scored = read(run(tmp_path, [cache], estimator="full").output, ["kl"])
    assert [r["kl"] for r in scored] == [
        float(np.mean([v for v in r[KL_POLICY_REF] if v is not None])) if any(r[MASK]) else 0.0 for r in rows]


def test_full_without_the_exact_kl_is_refused_naming_precompute_policy(tmp_path):
    no_columns = write_cache(tmp_path / "plain.parquet", make_rows(4), provenance=provenance())
    with pytest.raises(InputError) as caught:
        run(tmp_path, [no_columns], estimator="full")
    assert str(caught.value) == (
        f"{no_columns}: --estimator full reads the exact per-token KL (kl_policy_ref), and this cache has no "
        f"{' or '.join(FULL_KL_COLUMNS)} column; `klpipe precompute --policy MODEL` computes it")
    made_without = bad(tmp_path, lambda rows: None, made=exact_provenance(full_kl=False))
    with pytest.raises(InputError, match=r"was made without it \(its provenance says full_kl false\); `klpipe "
                                         r"precompute --policy MODEL` computes it"):
        run(tmp_path, [made_without], estimator="full")
    part = pa.schema([f for f in EXACT_SCHEMA if f.name != REF_ENTROPY])
    with pytest.raises(InputError, match="this cache has no ref_entropy column"):
        run(tmp_path, [bad(tmp_path, lambda rows: None, schema=part)], estimator="full")
    assert not (tmp_path / "scored.parquet").exists()


def test_full_and_the_samplers_logprobs_are_refused_together():
    with pytest.raises(InputError, match="--estimator full reads the exact KL of the policy model klpipe precompute "
                                         "--policy ran, not the sampler's"):
        ScoreConfig(inputs=["a.parquet"], estimator="full", kl_from="sampler")


def test_beside_a_sampler_the_mismatch_kl_figures_are_k1s_under_full(tmp_path):
    from tests.helpers import mismatch_cache

    table = pq.read_table(mismatch_cache(tmp_path / "m.parquet", rows=16))
    lengths = pc.list_value_length(table.column(POLICY_LOGPROBS)).to_pylist()
    for name in FULL_KL_COLUMNS:
        table = table.append_column(name, pa.array([[0.25] * n for n in lengths], pa.list_(pa.float32())))
    table = table.replace_schema_metadata({b"klpipe": exact_provenance().to_json()})
    pq.write_table(table, tmp_path / "both.parquet")
    full = run(tmp_path, [tmp_path / "both.parquet"], estimator="full").report
    k1 = run(tmp_path, [tmp_path / "both.parquet"], output=tmp_path / "k1.parquet").report
    assert full["mismatch"]["run"]["mismatch/kl_trainer"] == k1["mismatch"]["run"]["mismatch/kl_trainer"]
    assert full["summary"]["kl/mean"] == 0.25 and full["exact"]["run"]["exact_kl"] == 0.25


def test_the_report_json_holds_the_section(tmp_path):
    rows = with_exact_columns(make_rows(8))
    cache = write_cache(tmp_path / "a.parquet", rows, schema=EXACT_SCHEMA, provenance=exact_provenance())
    run(tmp_path, [cache], report=tmp_path / "report.json")
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report["exact"]["run"]) == FIGURES | {"tokens"}
    assert report["exact"]["columns"] == {"kl": KL_POLICY_REF, "kl_ref_policy": KL_REF_POLICY,
                                          "policy_entropy": POLICY_ENTROPY, "ref_entropy": REF_ENTROPY}
    assert all(set(entry["exact"]) == FIGURES for entry in report["steps"])
    assert set(CACHE_SCHEMA.names) <= set(pq.read_schema(tmp_path / "scored.parquet").names)
