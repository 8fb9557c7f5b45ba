"""The mask role in `klpipe score`: KL over the policy's own tokens only (klpipe/mask.py).

Expected values are worked out here token by token in plain Python, never by klpipe's KL code.
"""

import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from klpipe.errors import InputError
from klpipe.score import ScoreConfig, score

MASKED_SCHEMA = pa.schema([
    ("id", pa.string()), ("step", pa.int64()),
    ("policy_logprobs", pa.list_(pa.float32())), ("ref_logprobs", pa.list_(pa.float32())),
    ("tool_mask", pa.list_(pa.int64())), ("reward", pa.float64()),
])

# Dyadic values: every sum below is exact in float32 and float64 alike. A tool result's policy value
# is TRL's placeholder 0.0 (or NaN), its reference value whatever the reference made of the text.
ROWS = [
    # call, then a tool result of 3 tokens, then the answer
    {"id": "a", "step": 0, "policy_logprobs": [-0.5, -1.0, 0.0, 0.0, 0.0, -0.25],
     "ref_logprobs": [-1.5, -0.5, -9.0, -12.0, -7.0, -2.25], "tool_mask": [1, 1, 0, 0, 0, 1], "reward": 1.0},
    # no tool: every token the policy's
    {"id": "b", "step": 0, "policy_logprobs": [-2.0, -0.125], "ref_logprobs": [-1.0, -0.625],
     "tool_mask": [1, 1], "reward": 0.5},
    # masked whole (TRL masks a truncated completion so): nothing to score, KL 0
    {"id": "c", "step": 1, "policy_logprobs": [0.0, 0.0, 0.0], "ref_logprobs": [-20.0, -30.0, -25.0],
     "tool_mask": [0, 0, 0], "reward": 2.0},
    # NaN where the mask is 0: never read
    {"id": "d", "step": 1, "policy_logprobs": [-1.0, float("nan"), -3.0], "ref_logprobs": [-1.5, -8.0, -2.0],
     "tool_mask": [1, 0, 1], "reward": -1.0},
    # an empty response
    {"id": "e", "step": 1, "policy_logprobs": [], "ref_logprobs": [], "tool_mask": [], "reward": 0.0},
]


def hand_kl(row: dict, estimator: str, aggregate: str, clamp: bool) -> float:
    """The masked aggregate of one row, a token at a time."""
    values = []
    for p, r, m in zip(row["policy_logprobs"], row["ref_logprobs"], row["tool_mask"], strict=True):
        if not m:
            continue
        d = p - r
        values.append({"k1": d, "abs": abs(d), "k2": 0.5 * d * d, "k3": math.exp(-d) + d - 1}[estimator])
    if not values:
        return 0.0
    kl = sum(values) / (len(values) if aggregate == "mean" else 1)
    return max(kl, 0.0) if (estimator == "k1" and clamp) else kl


def write(path, rows=ROWS, schema=MASKED_SCHEMA):
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def run(tmp_path, cache, **options):
    options.setdefault("output", tmp_path / "scored.parquet")
    return score(ScoreConfig(inputs=[cache], **options))


@pytest.mark.parametrize("estimator", ["k1", "abs", "k2", "k3"])
@pytest.mark.parametrize("aggregate", ["mean", "sum"])
def test_kl_is_the_masked_aggregate_for_every_estimator(tmp_path, estimator, aggregate):
    cache = write(tmp_path / "cache.parquet")
    run(tmp_path, cache, estimator=estimator, aggregate=aggregate, per_token=True)
    out = pq.read_table(tmp_path / "scored.parquet").to_pylist()
    for row, scored in zip(ROWS, out, strict=True):
        assert scored["kl"] == pytest.approx(hand_kl(row, estimator, aggregate, True), rel=1e-12, abs=1e-12), row["id"]


def test_without_clamp_a_negative_masked_k1_stays_negative(tmp_path):
    cache = write(tmp_path / "cache.parquet")
    run(tmp_path, cache, clamp=False)
    kls = {r["id"]: r["kl"] for r in pq.read_table(tmp_path / "scored.parquet").to_pylist()}
    # d: -0.5-(-1.5)=1, -1-(-0.5)=-0.5, -0.25-(-2.25)=2 → mean 2.5/3; row b: -1, 0.5 → -0.25
    assert kls["a"] == pytest.approx(2.5 / 3, rel=1e-12)
    assert kls["b"] == -0.25
    assert kls["c"] == 0.0 and kls["e"] == 0.0


def test_per_token_kl_is_aligned_with_the_response_and_null_where_masked(tmp_path):
    cache = write(tmp_path / "cache.parquet")
    run(tmp_path, cache, per_token=True, estimator="k2")
    out = {r["id"]: r["kl_per_token"] for r in pq.read_table(tmp_path / "scored.parquet").to_pylist()}
    assert out["a"] == [0.5, 0.125, None, None, None, 2.0]
    assert out["c"] == [None, None, None]
    assert out["d"] == [0.125, None, 0.5]
    assert out["e"] == []


def test_the_report_counts_policy_and_masked_tokens_and_rows_with_none(tmp_path):
    cache = write(tmp_path / "cache.parquet")
    result = run(tmp_path, cache)
    summary = result.report["summary"]
    assert (summary["tokens"], summary["masked_tokens"], summary["rows_without_tokens"]) == (7, 7, 2)
    # per step: step 0 has a (3 policy tokens) and b (2); step 1 has d (2), c and e none
    assert [s["tokens"] for s in result.report["steps"]] == [5, 2]


def test_masked_tool_tokens_raise_no_extreme_warning_and_no_kl(tmp_path):
    # Row c's tool text is 20-30 nats below the placeholder: unmasked, it would be "extreme".
    cache = write(tmp_path / "cache.parquet")
    result = run(tmp_path, cache)
    assert not any("nats" in w for w in result.warnings), result.warnings
    assert result.report["extreme_rows"]["count"] == 0
    # kl/ keys keep the seed's 4-decimal rounding
    assert result.report["summary"]["kl/max"] == round(max(hand_kl(r, "k1", "mean", True) for r in ROWS), 4)


def test_the_mask_is_found_under_env_mask_and_named_by_column(tmp_path):
    renamed = MASKED_SCHEMA.set(4, pa.field("env_mask", pa.list_(pa.int64())))
    rows = [{("env_mask" if k == "tool_mask" else k): v for k, v in r.items()} for r in ROWS]
    result = run(tmp_path, write(tmp_path / "env.parquet", rows, renamed))
    assert result.report["summary"]["masked_tokens"] == 7
    other = MASKED_SCHEMA.set(4, pa.field("action_mask", pa.list_(pa.bool_())))
    # TRL's 0.0 placeholders, no NaN: unmasked, a NaN would be refused (as it is below)
    rows = [{**{k: v for k, v in r.items() if k != "tool_mask"}, "action_mask": [bool(m) for m in r["tool_mask"]],
             "policy_logprobs": [0.0 if math.isnan(p) else p for p in r["policy_logprobs"]]} for r in ROWS]
    cache = write(tmp_path / "openrlhf.parquet", rows, other)
    unmasked = run(tmp_path, cache, output=tmp_path / "unmasked.parquet")
    assert unmasked.report["summary"]["masked_tokens"] == 0  # an unknown name is not guessed
    masked = run(tmp_path, cache, output=tmp_path / "masked.parquet", columns={"mask": "action_mask"})
    kls = [r["kl"] for r in pq.read_table(tmp_path / "masked.parquet").to_pylist()]
    assert kls == pytest.approx([hand_kl(r, "k1", "mean", True) for r in ROWS], rel=1e-12)
    assert masked.report["summary"]["masked_tokens"] == 7


def test_a_null_reference_value_is_accepted_only_where_the_mask_is_0(tmp_path):
    rows = [dict(ROWS[0], ref_logprobs=[-1.5, -0.5, None, None, None, -2.25])]
    run(tmp_path, write(tmp_path / "ok.parquet", rows))
    assert pq.read_table(tmp_path / "scored.parquet")["kl"].to_pylist() == [pytest.approx(2.5 / 3, rel=1e-12)]
    rows = [dict(ROWS[0], ref_logprobs=[-1.5, None, -9.0, -12.0, -7.0, -2.25])]
    with pytest.raises(InputError,
                       match=r"bad\.parquet: row 0 \(id 'a'\): ref_logprobs holds a null where the mask is 1"):
        run(tmp_path, write(tmp_path / "bad.parquet", rows))


@pytest.mark.parametrize("change, message", [
    ({"tool_mask": [1, 1, 0, 0, 1]}, r"row 0 \(id 'a'\): tool_mask has 5 values but policy_logprobs has 6 tokens"),
    ({"tool_mask": [1, 1, 0, 2, 0, 1]}, r"row 0 \(id 'a'\): tool_mask holds 2; a mask holds 1 where"),
    ({"tool_mask": None}, r"row 0 \(id 'a'\): tool_mask is null"),
    ({"tool_mask": [1, 1, 0, None, 0, 1]}, r"row 0 \(id 'a'\): tool_mask holds a null"),
])
def test_a_bad_mask_is_one_line_naming_the_row(tmp_path, change, message):
    path = write(tmp_path / "cache.parquet", [dict(ROWS[0], **change)])
    with pytest.raises(InputError, match=message):
        run(tmp_path, path)
    assert not (tmp_path / "scored.parquet").exists()


def test_a_mask_that_is_not_a_list_and_two_candidate_masks_are_refused(tmp_path):
    schema = MASKED_SCHEMA.set(4, pa.field("tool_mask", pa.string()))
    path = write(tmp_path / "text.parquet", [dict(ROWS[1], tool_mask="11")], schema)
    with pytest.raises(InputError, match=r"text\.parquet: column tool_mask \(the mask\) must be a list of 0/1"):
        run(tmp_path, path)
    both = MASKED_SCHEMA.append(pa.field("env_mask", pa.list_(pa.int64())))
    path = write(tmp_path / "both.parquet", [dict(ROWS[1], env_mask=[1, 1])], both)
    with pytest.raises(InputError, match=r"both\.parquet: columns tool_mask and env_mask could each be the mask; "
                                         r"name the one to use with --column mask=tool_mask"):
        run(tmp_path, path)
    run(tmp_path, path, columns={"mask": "env_mask"})  # naming one settles it


def test_a_cache_without_a_mask_scores_every_token_as_before(tmp_path):
    schema = pa.schema([f for f in MASKED_SCHEMA if f.name != "tool_mask"])
    rows = [{k: v for k, v in r.items() if k != "tool_mask"} for r in ROWS if r["id"] != "d"]
    result = run(tmp_path, write(tmp_path / "plain.parquet", rows, schema))
    kls = pq.read_table(tmp_path / "scored.parquet")["kl"].to_pylist()
    everything = [dict(r, tool_mask=[1] * len(r["policy_logprobs"])) for r in rows]
    assert kls == pytest.approx([hand_kl(r, "k1", "mean", True) for r in everything], rel=1e-12)
    assert result.report["summary"]["masked_tokens"] == 0
    assert np.isclose(kls[2], (20 + 30 + 25) / 3)  # what the tool text costs a row when nothing masks it
