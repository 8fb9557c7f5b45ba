"""The correction sweep (klpipe/score/corrections.py): each scheme at each threshold, against a naive numpy
application of it to the cache's own columns, row by row, written here."""

import numpy as np
import pyarrow.parquet as pq
import pytest

from klpipe.score import ScoreConfig, score
from tests.helpers import mismatch_cache


def naive(rows, entry) -> dict:
    """Apply one scheme to every row as a trainer would, and measure what it did."""
    scheme, low, high = entry["scheme"], entry["low"], entry["high"]
    tokens_hit = rows_hit = 0
    before = after = 0.0
    weights = []  # the weights the ESS counts: per token or per row
    lost_groups = set()
    n_tokens = sum(len(r["ratio"]) for r in rows)
    for row in rows:
        ratio = row["ratio"]
        r = np.exp(ratio)
        if scheme == "token_tis":
            hit = r > high
            w = np.minimum(r, high)
            before, after = before + r.sum(), after + w.sum()
            weights += list(w)
        elif scheme == "icepop":
            hit = (r < low) | (r > high)
            w = np.where(hit, 0.0, r)
            before, after = before + r.sum(), after + w.sum()
            weights += list(w)
            if hit.all():
                lost_groups.add(row["group"])
        elif scheme in ("sequence_is", "geometric_is"):
            weight = np.exp(np.clip(ratio.sum(), -20, 20)) if scheme == "sequence_is" else np.exp(ratio.mean())
            hit = np.full(len(r), weight > high)
            before, after = before + weight, after + min(weight, high)
            weights.append(min(weight, high))
        else:  # geometric_rs, veto: reject the row
            if scheme == "veto":
                rejected = bool(np.any(r < low))
            else:
                geo = np.exp(ratio.mean())
                rejected = geo < low or geo > high
            hit = np.full(len(r), rejected)
            before, after = before + len(r), after + (0 if rejected else len(r))
            weights.append(0.0 if rejected else 1.0)
            if rejected:
                lost_groups.add(row["group"])
        tokens_hit += int(hit.sum())
        rows_hit += int(hit.any())
    weights = np.array(weights)
    return {
        "tokens_affected_fraction": tokens_hit / n_tokens,
        "rows_affected_fraction": rows_hit / len(rows),
        "weight_kept": after / before,
        "ess_fraction": weights.sum() ** 2 / (len(weights) * np.sum(weights ** 2)) if np.any(weights) else 0.0,
        "groups_losing_members": len(lost_groups) if scheme in ("icepop", "geometric_rs", "veto") else None,
    }


@pytest.mark.parametrize("fault", [None, "temperature"])
def test_every_scheme_and_threshold_against_a_naive_application(tmp_path, fault):
    cache = mismatch_cache(tmp_path / "c.parquet", fault=fault, rows=96)
    result = score(ScoreConfig(inputs=[cache], output=tmp_path / "o.parquet"))
    table = result.report["mismatch"]["corrections"]
    rows = []
    for row in pq.read_table(cache).to_pylist():
        keep = np.array(row["mask"], bool)
        ratio = (np.array(row["policy_logprobs"], np.float64) - np.array(row["sampler_logprobs"], np.float64))[keep]
        rows.append({"ratio": ratio, "group": (row["step"], tuple(row["prompt_ids"]))})
    assert result.report["mismatch"]["groups"] == len({r["group"] for r in rows})
    touched = 0
    for entry in table:
        expected = naive(rows, entry)
        for key, value in expected.items():
            if value is None:
                assert entry[key] is None, (entry["scheme"], key)
            else:
                where = (entry["scheme"], entry["threshold"], key)
                assert entry[key] == pytest.approx(value, rel=1e-9, abs=1e-12), where
        touched += entry["rows_affected_fraction"] > 0
    assert touched >= 3  # the data moves several schemes, or the comparison would prove little


def test_the_grid_holds_each_peers_default(tmp_path):
    cache = mismatch_cache(tmp_path / "c.parquet", rows=16)
    table = score(ScoreConfig(inputs=[cache], output=tmp_path / "o.parquet")).report["mismatch"]["corrections"]
    defaults = {(e["scheme"], e["default_of"]): (e["low"], e["high"]) for e in table if e["default_of"]}
    assert defaults == {("token_tis", "verl"): (None, 2.0), ("token_tis", "TRL"): (None, 3.0),
                        ("sequence_is", "verl"): (None, 2.0), ("icepop", "IcePop"): (0.5, 5.0),
                        ("geometric_rs", "verl"): (0.999, 1.001), ("veto", "verl"): (1e-4, None)}
