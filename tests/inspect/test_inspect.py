"""`klpipe inspect` without a browser: which rows, how tokens decode, what the page holds, and bad input.

The files are real parquet caches of token ids from the sample tokenizer, scored by klpipe score itself;
the expected values come from the files (pyarrow) and from the tokenizers library's own decode, never from
the code under test. tests/browser/ opens the pages in Chromium.
"""

import base64
import json
import re
import socket

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer
from typer.testing import CliRunner

from klpipe.cache import FULL_KL_COLUMNS, KL_POLICY_REF, METADATA_KEY, POLICY_ENTROPY, REF_ENTROPY
from klpipe.cli import app
from klpipe.errors import InputError
from klpipe.inspect import InspectConfig, inspect
from klpipe.inspect.decode import load_decoder
from klpipe.score import ScoreConfig, score
from tests.helpers import RUN_KLPIPE, TINY_GEMMA, block_imports, mismatch_cache, provenance, run_cli, run_python

TOKENIZER = Tokenizer.from_file(str(TINY_GEMMA / "tokenizer.json"))
TEXTS = ["the café ☕ costs 3€\n\tthen<end_of_turn>\n", "a plain answer", "line one\nline two\n\n  indented",
         "<tool_call>{\"city\": \"Rome\"}</tool_call>", "ok"]

SCHEMA = pa.schema([("id", pa.string()), ("step", pa.int64()), ("prompt_ids", pa.list_(pa.int32())),
                    ("response_ids", pa.list_(pa.int32())), ("policy_logprobs", pa.list_(pa.float32())),
                    ("ref_logprobs", pa.list_(pa.float32())), ("reward", pa.float64()), ("mask", pa.list_(pa.int8()))])


def token_rows(n: int = 12, seed: int = 0, extreme: tuple[int, ...] = ()) -> list[dict]:
    """Rows of real token ids with float32 logprobs; rows in `extreme` get one 25-nat token; odd rows a tool span."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        response = TOKENIZER.encode(TEXTS[i % len(TEXTS)] + f" #{i}", add_special_tokens=False).ids
        policy = -rng.exponential(1.0, len(response)).astype(np.float32)
        ref = (policy - rng.normal(0.3 * (i % 4), 0.5, len(response))).astype(np.float32)
        mask = np.ones(len(response), dtype=np.int8)
        if i % 2 and len(response) > 6:
            mask[2:5] = 0  # a tool's result: TRL's placeholder 0.0 where the policy did not sample
            policy[2:5] = 0.0
        if i in extreme:
            ref[1] = policy[1] - 25.0
        rows.append({"id": f"r{i}", "step": i // 4, "prompt_ids": TOKENIZER.encode(f"question {i}?").ids,
                     "response_ids": response, "policy_logprobs": policy.tolist(),
                     "ref_logprobs": [None if not m else float(r) for r, m in zip(ref, mask, strict=True)],
                     "reward": float(rng.normal()), "mask": mask.tolist()})
    return rows


def write(path, rows, schema=SCHEMA, model=str(TINY_GEMMA)):
    table = pa.Table.from_pylist([{k: r.get(k) for k in schema.names} for r in rows], schema=schema)
    table = table.replace_schema_metadata({METADATA_KEY: provenance(model=model, revision="local:abc").to_json()})
    pq.write_table(table, path)
    return path


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inspect")
    cache = write(tmp / "cache.parquet", token_rows(12, extreme=(7,)))
    score(ScoreConfig(inputs=[cache], output=tmp / "scored.parquet"))
    return tmp / "scored.parquet"


def page_data(html: str) -> dict:
    raw = re.search(r'<script type="application/json" id="klpipe-data">(.*?)</script>', html, re.S).group(1)
    return json.loads(raw)


def decoded(b64: str, dtype: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype=dtype)


# -- selection --------------------------------------------------------------------------------------


def test_the_top_rows_are_the_largest_kl_with_the_extreme_row_first(scored, tmp_path):
    inspect(InspectConfig(input=scored, output=tmp_path / "kl.html", top=5))
    data = page_data((tmp_path / "kl.html").read_text())
    table = pq.read_table(scored).to_pylist()
    by_kl = sorted(range(len(table)), key=lambda i: -table[i]["kl"])
    assert [r["index"] for r in data["rows"]] == [7] + [i for i in by_kl if i != 7][:4]
    assert [r["extreme"] for r in data["rows"]] == [True, False, False, False, False]
    assert ('<aside class="extreme-note" role="note"><strong>1 embedded row(s) have a token with |policy − ref| '
            "above 20 nats</strong>") in (tmp_path / "kl.html").read_text()
    assert [r["kl"] for r in data["rows"]] == [table[r["index"]]["kl"] for r in data["rows"]]
    assert [r["penalty"] for r in data["rows"]] == [table[r["index"]]["kl_penalty"] for r in data["rows"]]


@pytest.mark.parametrize("sort, column", [("penalty", "kl_penalty"), ("max-token", None)])
def test_other_sort_keys(scored, tmp_path, sort, column):
    inspect(InspectConfig(input=scored, output=tmp_path / "kl.html", top=12, sort=sort, extreme_nats=1e9))
    data = page_data((tmp_path / "kl.html").read_text())
    table = pq.read_table(scored).to_pylist()

    def key(row):
        if column:
            return row[column]
        pairs = zip(row["policy_logprobs"], row["ref_logprobs"], row["mask"], strict=True)
        gaps = [abs(p - r) for p, r, m in pairs if m]
        return max(gaps, default=0.0)

    got = [key(table[r["index"]]) for r in data["rows"]]
    assert got == sorted(got, reverse=True) and len(got) == 12


def test_rows_by_id_and_steps(scored, tmp_path):
    out = tmp_path / "kl.html"
    inspect(InspectConfig(input=scored, output=out, rows=["r3", "r0"]))
    data = page_data(out.read_text())
    assert [r["id"] for r in data["rows"]] == ["r3", "r0"]
    assert "This page embeds 2 of the 12 rows in the file: 2 row(s) named with --row." in out.read_text()
    inspect(InspectConfig(input=scored, output=out, steps=["1"], top=50))
    assert sorted(r["id"] for r in page_data(out.read_text())["rows"]) == ["r4", "r5", "r6", "r7"]


def test_a_cache_gets_scores_kl_computed_by_scores_own_code(scored, tmp_path):
    # The unscored cache: per-row KL as score computes it (its defaults), equal to the scored file's.
    cache = scored.parent / "cache.parquet"
    inspect(InspectConfig(input=cache, output=tmp_path / "kl.html", top=12))
    data = page_data((tmp_path / "kl.html").read_text())
    kl = pq.read_table(scored, columns=["kl"]).column("kl").to_pylist()
    assert {r["index"]: r["kl"] for r in data["rows"]} == dict(enumerate(kl))
    assert all(r["penalty"] is None for r in data["rows"])


# -- decoding ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS + ["émoji 🎉 and ñ\r\n"])
def test_token_texts_join_into_the_tokenizers_own_decode(text):
    decoder = load_decoder(str(TINY_GEMMA))
    ids = np.array(TOKENIZER.encode(text).ids)  # with <bos>, a special token
    tokens = decoder.decode(np.zeros(0, dtype=np.int64), ids)
    assert "".join(tokens.texts) == TOKENIZER.decode(ids.tolist(), skip_special_tokens=False)
    assert tokens.texts[0] == "<bos>" and 2 in decoder.special
    # Each multi-byte character sits whole on the token that completes it; the ones before are partial.
    for k in np.flatnonzero(tokens.partial):
        assert tokens.texts[k] == "" and decoder.piece_bytes(ids[k])
    if "\n" in text:
        assert any(t.endswith("\n") for t in tokens.texts)


def test_a_local_tokenizer_never_reaches_for_the_hub(monkeypatch, tmp_path):
    monkeypatch.setitem(__import__("sys").modules, "huggingface_hub", None)  # importing it now fails
    assert load_decoder(str(TINY_GEMMA)).vocab_size == TOKENIZER.get_vocab_size()
    assert load_decoder(str(TINY_GEMMA / "tokenizer.json")).fingerprint == load_decoder(str(TINY_GEMMA)).fingerprint
    with pytest.raises(InputError, match=f"^{tmp_path}/missing: no such tokenizer directory or file; pass "):
        load_decoder(str(tmp_path / "missing"))


def test_the_response_is_decoded_after_its_prompt():
    decoder = load_decoder(str(TINY_GEMMA))
    ids = TOKENIZER.encode("héllo wörld", add_special_tokens=False).ids
    split = next(i for i in range(1, len(ids)) if TOKENIZER.decode(ids[:i]).endswith("\ufffd"))
    tokens = decoder.decode(np.array(ids[:split]), np.array(ids[split:]))
    # The character cut by the prompt's end is completed by the response's first token.
    assert "".join(tokens.texts) == TOKENIZER.decode(ids)[len(TOKENIZER.decode(ids[:split]).rstrip("\ufffd")):]


# -- the page ---------------------------------------------------------------------------------------


def test_the_page_holds_the_files_values_and_nothing_to_fetch(scored, tmp_path):
    out = tmp_path / "kl.html"
    inspect(InspectConfig(input=scored, output=out, top=12))
    html = out.read_text()
    data = page_data(html)
    table = pq.read_table(scored).to_pylist()
    for row in data["rows"]:
        file_row = table[row["index"]]
        policy = decoded(row["policy"], "<f4")
        assert policy.tolist() == np.array(file_row["policy_logprobs"], dtype=np.float32).tolist()
        ref = decoded(row["ref"], "<f4")
        expected = np.array([np.nan if v is None else v for v in file_row["ref_logprobs"]], dtype=np.float32)
        np.testing.assert_array_equal(ref, expected)  # NaN where the mask is 0
        assert decoded(row["mask"], "u1").tolist() == file_row["mask"]
        assert data["index"] == "u2"  # a table of fewer than 65,536 distinct tokens
        pieces = [data["pieces"][i] for i in decoded(row["response"], "<u2")]
        assert [p[0] for p in pieces] == file_row["response_ids"]
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)  # nothing from elsewhere
    assert "connect-src 'none'" in html and "<link" not in html and "@import" not in html and "url(" not in html


def test_text_from_the_file_is_escaped(tmp_path):
    rows = token_rows(3)
    rows[0]["id"] = "<img src=x onerror=alert(1)></script><script>alert(2)</script>{{script}}"
    rows[1]["response_ids"] = TOKENIZER.encode("</script><b>bold</b>", add_special_tokens=False).ids
    rows[1]["policy_logprobs"] = [-1.0] * len(rows[1]["response_ids"])
    rows[1]["ref_logprobs"] = [-1.5] * len(rows[1]["response_ids"])
    rows[1]["mask"] = [1] * len(rows[1]["response_ids"])
    cache = write(tmp_path / "cache.parquet", rows)
    inspect(InspectConfig(input=cache, output=tmp_path / "kl.html"))
    html = (tmp_path / "kl.html").read_text()
    assert html.count("<script") == 2 and html.count("</script>") == 2  # the data's and the page's own
    assert "<img" not in html and "<b>" not in html
    assert html.count("{{script}}") == 0 or "\\u003cimg" in html  # a value is never expanded as a placeholder
    data = page_data(html)
    assert data["rows"][[r["index"] for r in data["rows"]].index(0)]["id"] == rows[0]["id"]
    assert "".join(p[1] for p in data["pieces"]).count("</") >= 1  # the text survives, as data


# -- bad input --------------------------------------------------------------------------------------


def run(*args):
    return CliRunner().invoke(app, ["inspect", *map(str, args)])


def test_bad_input_is_one_line_exit_2_and_no_page(scored, tmp_path):
    out = tmp_path / "kl.html"
    no_ids = tmp_path / "no_ids.parquet"
    write(no_ids, token_rows(3), pa.schema([f for f in SCHEMA if f.name != "response_ids"]))
    no_ref = tmp_path / "no_ref.parquet"
    write(no_ref, token_rows(3), pa.schema([f for f in SCHEMA if f.name != "ref_logprobs"]))
    small = tmp_path / "small.json"
    tiny = Tokenizer(__import__("tokenizers").models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    tiny.save(str(small))
    cases = [
        ((no_ids, "-o", out), (f"Error: {no_ids}: no response_ids column; klpipe inspect decodes the response's "
                               "token ids (a cache klpipe precompute wrote has them)")),
        ((no_ref, "-o", out), (f"Error: {no_ref}: no ref_logprobs column; run `klpipe precompute` on it first to add "
                               "the reference logprobs")),
        ((scored, "-o", out, "--row", "r99"), f"Error: {scored}: no row with id 'r99'"),
        ((scored, "-o", out, "--step", "9"), f"Error: {scored}: no row of step '9'"),
        ((scored.parent / "cache.parquet", "-o", out, "--sort", "penalty"),
         (f"Error: {scored.parent / 'cache.parquet'}: --sort penalty needs a scored file (kl_penalty); this is a "
          "cache: run klpipe score on it, or sort by kl")),
        ((scored, "-o", out, "--tokenizer", small), None),
        ((scored, "-o", scored), f"Error: {scored}: is also an input; pass another --output"),
    ]
    for args, message in cases:
        result = run(*args)
        assert result.exit_code == 2, (args, result.output)
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
        if message:
            assert lines[0] == message
        else:
            assert re.fullmatch(rf"Error: {re.escape(str(scored))}: row \d+ \(id 'r\d+'\): token id \d+ is not in the "
                                rf"vocabulary of the tokenizer from {re.escape(str(small))} \(3 tokens\); pass the "
                                r"tokenizer the rows were made with \(--tokenizer\)", lines[0]), lines[0]
        assert not out.exists() and not list(tmp_path.glob(".kl.html*"))
    assert pq.read_table(scored).num_rows == 12  # the input is untouched


def test_a_hub_id_offline_never_touches_the_network_and_inspect_needs_no_torch(scored, tmp_path, monkeypatch):
    # An endpoint on 127.0.0.1 that would see any request; HF_HUB_OFFLINE=1 must send none.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.2)
        env = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": f"http://127.0.0.1:{server.getsockname()[1]}",
               "HF_HUB_CACHE": str(tmp_path / "hub")}
        out = tmp_path / "kl.html"
        result = run_cli("inspect", str(scored), "-o", str(out), "--tokenizer", "someone/model", env=env)
        assert result.returncode == 2 and result.stderr == (
            "Error: someone/model: no such directory here, and no tokenizer.json for it from the hub (not in the "
            "local Hugging Face cache, and HF_HUB_OFFLINE is set); pass --tokenizer DIR|ID\n")
        assert not out.exists()
        with pytest.raises(TimeoutError):
            server.accept()
        # In the local cache the same id loads, still without a request, in a process that cannot import torch.
        repo = tmp_path / "hub" / "models--someone--model"
        (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
        (repo / "snapshots" / ("0" * 40) / "tokenizer.json").write_bytes((TINY_GEMMA / "tokenizer.json").read_bytes())
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("0" * 40)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        code = block_imports("torch", "transformers", "datasets") + RUN_KLPIPE
        result = run_python(code, "inspect", str(scored), "-o", str(out), "--tokenizer", "someone/model", "--top", "3")
        assert result.returncode == 0, result.stderr
        assert result.stderr.startswith(f"Wrote {out} (") and result.stderr.endswith(": 3 of 12 rows)\n")
        assert "decoded with</dt><dd>someone/model" in out.read_text()
        with pytest.raises(TimeoutError):
            server.accept()


# -- the sampler against the trainer ------------------------------------------------------------------


@pytest.fixture(scope="module")
def with_sampler(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mismatch")
    cache = mismatch_cache(tmp / "cache.parquet", fault="temperature", rows=32)
    score(ScoreConfig(inputs=[cache], output=tmp / "scored.parquet"))
    return tmp / "scored.parquet"


def test_the_mismatch_view_carries_the_samplers_logprobs_and_each_rows_log_ppl_diff(with_sampler, tmp_path):
    inspect(InspectConfig(input=with_sampler, output=tmp_path / "kl.html", top=32, tokenizer=str(TINY_GEMMA)))
    html = (tmp_path / "kl.html").read_text()
    data = page_data(html)
    table = pq.read_table(with_sampler).to_pylist()
    assert data["mismatch"] is True and len(data["rows"]) == 32
    ratios = []
    for entry in data["rows"]:
        row = table[entry["index"]]
        # The file's own float32 values, digit for digit, for the hover's third logprob.
        assert entry["float"] == "f4"
        np.testing.assert_array_equal(decoded(entry["sampler"], "<f4"), np.array(row["sampler_logprobs"], np.float32))
        keep = np.array(row["mask"], bool)
        trainer = np.array(row["policy_logprobs"], np.float64)[keep]
        sampler = np.array(row["sampler_logprobs"], np.float64)[keep]
        assert entry["logPplDiff"] == pytest.approx(np.mean(sampler) - np.mean(trainer), rel=1e-9)
        ratios.append(np.abs(trainer - sampler))
    assert data["mismatchScale"] == pytest.approx(np.percentile(np.concatenate(ratios), 99), rel=1e-12)
    assert '<h2 id="mismatch-heading">Sampler against trainer</h2>' in html
    assert "mismatch diagnosis: temperature" in html
    # One bar per scheme and threshold of the report's sweep, each titled with its value.
    again = score(ScoreConfig(inputs=[with_sampler], output=tmp_path / "again.parquet"))
    sweep = again.report["mismatch"]["corrections"]
    figure = html.split('class="sweep"')[1].split("</figure>")[0]
    bars = re.findall(r'<rect class="bar"[^>]*><title>([^<]*)</title>', figure)
    assert len(bars) == len(sweep)
    assert bars[0].startswith(f"{sweep[0]['scheme']} {sweep[0]['threshold']}")
    # The worst rows by |log_ppl_diff| are listed first.
    listed = re.findall(r'<li><a href="#row-(\d+)">', html)
    ranks = {entry["rank"]: abs(entry["logPplDiff"]) for entry in data["rows"]}
    assert [ranks[int(r)] for r in listed] == sorted(ranks.values(), reverse=True)[:10]
    assert 'data-key="logPplDiff"' in html


def test_sort_by_log_ppl_diff_embeds_the_worst_rows(with_sampler, tmp_path):
    inspect(InspectConfig(input=with_sampler, output=tmp_path / "kl.html", top=5, sort="log-ppl-diff",
                          tokenizer=str(TINY_GEMMA), extreme_nats=1e9))
    data = page_data((tmp_path / "kl.html").read_text())
    table = pq.read_table(with_sampler).to_pylist()
    expected = sorted(range(len(table)), key=lambda i: -abs(table[i]["log_ppl_diff"]))[:5]
    assert [r["index"] for r in data["rows"]] == expected


def test_sort_by_log_ppl_diff_needs_the_samplers_logprobs(scored, tmp_path):
    with pytest.raises(InputError, match="--sort log-ppl-diff needs the sampler's logprobs"):
        inspect(InspectConfig(input=scored, output=tmp_path / "kl.html", sort="log-ppl-diff"))
    assert not (tmp_path / "kl.html").exists()


# -- the exact KL's layers --------------------------------------------------------------------------


EXACT_FIELDS = [(name, pa.list_(pa.float32())) for name in FULL_KL_COLUMNS]


def with_exact(rows: list[dict], seed: int = 5) -> list[dict]:
    """token_rows' rows with the exact KL's columns as precompute --policy writes them: values ≥ 0 on mask-1 tokens
    (float32-exact), null where the mask is 0."""
    rng = np.random.default_rng(seed)
    out = []
    for row in rows:
        values = {name: [float(np.float32(rng.gamma(1.0, scale))) if m else None for m in row["mask"]]
                  for name, scale in zip(FULL_KL_COLUMNS, (0.3, 0.3, 2.0, 2.5), strict=True)}
        out.append(row | values)
    return out


@pytest.fixture(scope="module")
def exact_scored(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("exact")
    rows = with_exact(token_rows(12, extreme=(7,)))
    schema = pa.schema(list(SCHEMA) + EXACT_FIELDS)
    table = pa.Table.from_pylist(rows, schema=schema).replace_schema_metadata({METADATA_KEY: provenance(
        model=str(TINY_GEMMA), revision="local:abc", policy_model="policy", full_kl=True).to_json()})
    pq.write_table(table, tmp / "cache.parquet")
    report = score(ScoreConfig(inputs=[tmp / "cache.parquet"], output=tmp / "scored.parquet", estimator="full")).report
    return tmp / "scored.parquet", report


def sampled(row: dict, name: str) -> np.ndarray:
    return np.array([v for v, m in zip(row[name], row["mask"], strict=True) if m], np.float64)


@pytest.mark.parametrize("which", ["scored", "cache"])
def test_the_exact_kl_and_the_policys_entropy_are_layers_beside_k1(exact_scored, tmp_path, which):
    scored, _ = exact_scored
    path = scored if which == "scored" else scored.parent / "cache.parquet"
    inspect(InspectConfig(input=path, output=tmp_path / "kl.html", top=12, tokenizer=str(TINY_GEMMA)))
    html = (tmp_path / "kl.html").read_text()
    data = page_data(html)
    table = pq.read_table(scored).to_pylist()
    assert data["exact"] is True and len(data["rows"]) == 12
    for entry in data["rows"]:
        row = table[entry["index"]]
        for key, name in (("exact", KL_POLICY_REF), ("entropy", POLICY_ENTROPY)):  # the file's float32, NaN at mask 0
            expected = np.array([np.nan if v is None else v for v in row[name]], np.float32)
            np.testing.assert_array_equal(decoded(entry[key], "<f4"), expected)
        assert entry["exactKl"] == pytest.approx(sampled(row, KL_POLICY_REF).mean(), rel=1e-12)
        assert entry["entropyMean"] == pytest.approx(sampled(row, POLICY_ENTROPY).mean(), rel=1e-12)
        if which == "scored":  # scored with full: the row's KL is its mean exact KL
            assert entry["kl"] == pytest.approx(entry["exactKl"], rel=1e-12)
    # Each layer's colours saturate at the 99th percentile of the embedded sampled tokens' values.
    for key, name in (("exactScale", KL_POLICY_REF), ("entropyScale", POLICY_ENTROPY)):
        assert data[key] == pytest.approx(np.percentile(np.concatenate([sampled(r, name) for r in table]), 99),
                                          rel=1e-12)
    assert 'data-key="exactKl"' in html
    every = {name: np.concatenate([sampled(r, name) for r in table]) for name in FULL_KL_COLUMNS}
    assert (f"KL(π‖π_ref) {every[KL_POLICY_REF].mean():.4g} against k1" in html
            and f"entropy π {every[POLICY_ENTROPY].mean():.4g}, π_ref {every[REF_ENTROPY].mean():.4g}" in html)
    assert ("scored with</dt><dd>full mean" in html) == (which == "scored")


def test_without_the_exact_columns_there_are_no_layers(scored, tmp_path):
    inspect(InspectConfig(input=scored, output=tmp_path / "kl.html", top=3))
    html = (tmp_path / "kl.html").read_text()
    data = page_data(html)
    assert data["exact"] is False and all(r["exact"] is None and r["exactKl"] is None for r in data["rows"])
    served = html.split('<script type="application/json"')[0]  # the page without its script
    assert 'data-key="exactKl"' not in served and "KL(π‖π_ref)" not in served


def test_a_file_scored_with_full_that_lost_its_exact_columns_is_refused(exact_scored, tmp_path):
    scored, _ = exact_scored
    table = pq.read_table(scored)
    pq.write_table(table.drop_columns([KL_POLICY_REF]), tmp_path / "dropped.parquet")
    with pytest.raises(InputError, match=r"--estimator full reads the exact per-token KL \(kl_policy_ref\), and this "
                                         r"cache has no kl_policy_ref column"):
        inspect(InspectConfig(input=tmp_path / "dropped.parquet", output=tmp_path / "kl.html",
                              tokenizer=str(TINY_GEMMA)))
    assert not (tmp_path / "kl.html").exists()
