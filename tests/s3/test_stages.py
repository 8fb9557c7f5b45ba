"""Both stages with their inputs and outputs on S3: a real S3-compatible server (moto) over HTTP on 127.0.0.1.

klpipe runs as a user runs it, a fresh `python -m klpipe` process configured by the standard AWS
variables alone (tests/moto_server.py), against a server that authenticates every request. Each
result on the store is compared with the same command on local files, bit for bit where the two
runs share their provenance. `make test-s3` runs this directory (the precompute runs take a couple
of minutes on two cores); tests/storage/test_store.py, in `make test`, covers the layer under it.
"""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from klpipe.cache import read_provenance
from tests.helpers import (
    ROLLOUTS,
    TINY_GEMMA,
    TINY_LLAMA,
    free_ports,
    kill_9_after_chunks,
    make_rows,
    provenance,
    repeated_rollouts,
    run_cli,
    write_cache,
)
from tests.test_examples import EXAMPLES, run_array, script_env, without_metadata

ARGS = ("--device", "cpu", "--progress", "none")


def klpipe(server, *args, user: str = "writer", cwd: Path | None = None, **env):
    """`python -m klpipe ARGS` with `user`'s credentials for the test server, one torch thread."""
    return run_cli(*map(str, args), env={**server.env(user), "OMP_NUM_THREADS": "1", **env}, cwd=cwd)


def read_table(server, bucket: str, key: str) -> pa.Table:
    return pq.read_table(io.BytesIO(server.read(bucket, key)))


def test_precompute_from_s3_to_s3_then_a_rerun_finds_it_done(s3_server, bucket, tmp_path):
    s3_server.put(bucket, "rollouts/day1.parquet", ROLLOUTS.read_bytes())
    s3_server.put(bucket, "rollouts/notes.txt", b"not rollouts")  # not a rollout file: left out of the directory
    cache_dir = tmp_path / "cache"  # KLPIPE_CACHE_DIR: the default work directories of outputs on a store
    output = f"s3://{bucket}/caches/day1.cached.parquet"
    args = ("precompute", "-m", TINY_GEMMA, f"s3://{bucket}/rollouts/", "-o", output, *ARGS)
    run = klpipe(s3_server, *args, KLPIPE_CACHE_DIR=cache_dir)
    assert run.returncode == 0, run.stderr
    assert f"wrote {output}: 48 rows" in run.stderr
    assert s3_server.keys_under(bucket) == ["caches/day1.cached.parquet", "rollouts/day1.parquet", "rollouts/notes.txt"]
    assert list((cache_dir / "work").iterdir()) == []  # the work directory went once the cache was in place

    local = klpipe(s3_server, "precompute", "-m", TINY_GEMMA, ROLLOUTS, "-o", tmp_path / "local.parquet", *ARGS)
    assert local.returncode == 0, local.stderr
    got = read_table(s3_server, bucket, "caches/day1.cached.parquet")
    assert got.equals(pq.read_table(tmp_path / "local.parquet"))  # every column; the provenance differs:
    (tmp_path / "got.parquet").write_bytes(s3_server.read(bucket, "caches/day1.cached.parquet"))
    head = s3_server.client().head_object(Bucket=bucket, Key="rollouts/day1.parquet")
    assert read_provenance(tmp_path / "got.parquet").inputs == [{
        "name": "day1.parquet", "size": ROLLOUTS.stat().st_size, "etag": head["ETag"],
        "mtime": head["LastModified"].strftime("%Y-%m-%dT%H:%M:%SZ")}]

    rerun = klpipe(s3_server, *args, KLPIPE_CACHE_DIR=cache_dir)
    assert rerun.returncode == 0, rerun.stderr
    said = f"{output} is already complete for these inputs, this model and these settings; nothing to do"
    assert said in rerun.stderr
    assert read_table(s3_server, bucket, "caches/day1.cached.parquet").equals(got)


def test_json_lines_on_s3_and_the_default_output_beside_them(s3_server, bucket, tmp_path):
    rows = pq.read_table(ROLLOUTS).to_pylist()
    s3_server.put(bucket, "dump/day1.jsonl", "".join(json.dumps(row) + "\n" for row in rows).encode())
    run = klpipe(s3_server, "precompute", "-m", TINY_GEMMA, f"s3://{bucket}/dump/day1.jsonl", *ARGS,
                 KLPIPE_CACHE_DIR=tmp_path / "cache")
    assert run.returncode == 0, run.stderr
    assert s3_server.keys_under(bucket) == ["dump/day1.cached.parquet", "dump/day1.jsonl"]
    local = klpipe(s3_server, "precompute", "-m", TINY_GEMMA, ROLLOUTS, "-o", tmp_path / "local.parquet", *ARGS)
    assert local.returncode == 0, local.stderr
    got = read_table(s3_server, bucket, "dump/day1.cached.parquet")
    assert got.column("ref_logprobs").equals(pq.read_table(tmp_path / "local.parquet").column("ref_logprobs"))


def many_rollouts(copies: int = 10) -> bytes:
    sink = io.BytesIO()
    pq.write_table(repeated_rollouts(copies), sink, row_group_size=100)
    return sink.getvalue()


def test_kill_9_then_rerun_resumes_to_the_same_object(s3_server, bucket, tmp_path):
    s3_server.put(bucket, "rollouts.parquet", many_rollouts())  # 480 rows: 60 chunks of 8
    work = tmp_path / "work"
    args = ("precompute", "-m", TINY_GEMMA, f"s3://{bucket}/rollouts.parquet", "-o", f"s3://{bucket}/cached.parquet",
            "--chunk-rows", "8", "--work-dir", work, *ARGS)
    finished = kill_9_after_chunks(args, work, "*.partial/chunk-*.parquet",
                                   env={**s3_server.env(), "OMP_NUM_THREADS": "1"}, timeout=180)
    assert 3 <= finished < 60, finished
    assert s3_server.keys_under(bucket) == ["rollouts.parquet"]  # nothing under the output's name

    rerun = klpipe(s3_server, *args)
    assert rerun.returncode == 0, rerun.stderr
    assert f"resuming: {finished} of 60 chunks already done in {work}" in rerun.stderr
    assert list(work.iterdir()) == []
    uninterrupted = klpipe(s3_server, *[f"s3://{bucket}/reference.parquet" if a == f"s3://{bucket}/cached.parquet"
                                        else a for a in args])
    assert uninterrupted.returncode == 0, uninterrupted.stderr
    assert s3_server.read(bucket, "cached.parquet") == s3_server.read(bucket, "reference.parquet")  # bit for bit
    assert read_table(s3_server, bucket, "cached.parquet").column("id").to_pylist() == [f"r{i}" for i in range(480)]


SCORE_OUTPUTS = {"--output": "scored.parquet", "--report": "report.json", "--state": "kl_state.json",
                 "--metrics-jsonl": "metrics.jsonl", "--tensorboard": "tb", "--plot": "report.png"}


def score_args(caches, where) -> list[str]:
    args = ["score", *caches, "--kl-target", "1", "--window", "4"]
    for option, name in SCORE_OUTPUTS.items():
        args += [option, f"{where}/{name}"]
    return args


def test_score_reads_and_writes_every_file_on_s3(s3_server, bucket, tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in2").mkdir()
    day1 = write_cache(tmp_path / "in" / "day1.parquet", make_rows(60, seed=1), provenance=provenance())
    day2 = write_cache(tmp_path / "in2" / "day2.parquet", make_rows(40, seed=2), provenance=provenance())
    s3_server.put(bucket, "caches/day1.parquet", day1.read_bytes())
    s3_server.put(bucket, "caches2/day2.parquet", day2.read_bytes())
    local = tmp_path / "local"
    for day, caches in ((1, [tmp_path / "in"]), (2, [day2])):
        run = klpipe(s3_server, *score_args(caches, local))
        assert run.returncode == 0, run.stderr
        remote = [f"s3://{bucket}/caches/"] if day == 1 else [f"s3://{bucket}/caches2/day*.parquet"]  # a pattern
        run = klpipe(s3_server, *score_args(remote, f"s3://{bucket}/out"), cwd=tmp_path)
        assert run.returncode == 0, run.stderr
        assert f"Wrote s3://{bucket}/out/scored.parquet" in run.stderr
        # Day 2 continues from the state that day 1 left on S3, exactly as it does from a local file.
        assert read_table(s3_server, bucket, "out/scored.parquet").equals(pq.read_table(local / "scored.parquet"))
        remote_state = json.loads(s3_server.read(bucket, "out/kl_state.json"))
        local_state = json.loads((local / "kl_state.json").read_text())
        assert remote_state.pop("last_run")["controller_batches"] == local_state.pop("last_run")["controller_batches"]
        assert remote_state == local_state
        assert s3_server.read(bucket, "out/metrics.jsonl") == (local / "metrics.jsonl").read_bytes()
        # One event file per run, named by its first step, as locally.
        assert s3_server.keys_under(bucket, "out/tb/") == sorted(f"out/tb/{p.name}" for p in (local / "tb").iterdir())
        report = json.loads(s3_server.read(bucket, "out/report.json"))
        assert report["output"] == f"s3://{bucket}/out/scored.parquet"
        assert report["summary"] == json.loads((local / "report.json").read_text())["summary"]
        assert s3_server.read(bucket, "out/report.png")[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "in2", "local"]  # nothing local from the S3 runs
    assert s3_server.keys_under(bucket, "out/") == sorted(
        [f"out/{name}" for name in ("scored.parquet", "report.json", "kl_state.json", "metrics.jsonl", "report.png")]
        + s3_server.keys_under(bucket, "out/tb/"))

    # No --output: beside the first cache, on the same store.
    run = klpipe(s3_server, "score", f"s3://{bucket}/caches/day1.parquet")
    assert run.returncode == 0, run.stderr
    assert "caches/day1.scored.parquet" in s3_server.keys_under(bucket, "caches/")


def test_a_slurm_array_writes_parts_to_s3_and_score_reads_the_prefix(s3_server, bucket, tmp_path):
    s3_server.put(bucket, "rollouts/day1.parquet", ROLLOUTS.read_bytes())
    parts = f"s3://{bucket}/parts"
    env = script_env(tmp_path, **s3_server.env(), KLPIPE_MODEL=TINY_LLAMA, ROLLOUTS=f"s3://{bucket}/rollouts",
                     CACHE_DIR=parts, SCORE_DIR=f"s3://{bucket}/scored", KL_STATE=f"s3://{bucket}/kl_state.json",
                     KLPIPE_CACHE_DIR=tmp_path / "cache", KLPIPE_DEVICE="cpu")
    for result in run_array(EXAMPLES / "precompute-array.sbatch", range(3), tmp_path, env):
        assert result.returncode == 0, result.stdout
    names = [f"part-{i:05d}-of-00003" for i in range(3)]
    assert s3_server.keys_under(bucket, "parts/") == sorted(f"parts/{n}{s}"
                                                           for n in names for s in (".done", ".parquet"))
    for name in names:
        marker = json.loads(s3_server.read(bucket, f"parts/{name}.done"))
        assert marker["rows"] == read_table(s3_server, bucket, f"parts/{name}.parquet").num_rows > 0

    # The same rows as one process writing one local cache, scored the same.
    single = klpipe(s3_server, "precompute", "-m", TINY_LLAMA, ROLLOUTS, "-o", tmp_path / "single.parquet",
                    "--chunk-rows", env["KLPIPE_CHUNK_ROWS"], *ARGS)
    assert single.returncode == 0, single.stderr
    concatenated = pa.concat_tables([without_metadata(read_table(s3_server, bucket, f"parts/{n}.parquet"))
                                     for n in names])
    assert concatenated.equals(without_metadata(pq.read_table(tmp_path / "single.parquet")))
    scored = subprocess.run(["bash", str(EXAMPLES / "score-after.sbatch")], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300, check=False)
    assert scored.returncode == 0, scored.stderr
    local = klpipe(s3_server, "score", tmp_path / "single.parquet", "-o", tmp_path / "scored.parquet")
    assert local.returncode == 0, local.stderr
    assert read_table(s3_server, bucket, "scored/scored.parquet").equals(pq.read_table(tmp_path / "scored.parquet"))
    assert "kl_state.json" in s3_server.keys_under(bucket)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(("slurm", "cache"))) == [
        "scored.parquet", "single.parquet"]  # nothing else written locally: no `s3:` directory

    # A finished shard's rerun finds its part on the store; a part without its marker is refused.
    again = klpipe(s3_server, "precompute", "-m", TINY_LLAMA, f"s3://{bucket}/rollouts", "-o", parts,
                   "--shard-index", "1", "--num-shards", "3", "--chunk-rows", env["KLPIPE_CHUNK_ROWS"], *ARGS,
                   KLPIPE_CACHE_DIR=tmp_path / "cache")
    assert again.returncode == 0, again.stderr
    assert f"shard 1 of 3 ({parts}/part-00001-of-00003.parquet) is already complete" in again.stderr
    s3_server.client().delete_object(Bucket=bucket, Key="parts/part-00002-of-00003.done")
    refused = klpipe(s3_server, "score", f"{parts}/", "-o", tmp_path / "never.parquet")
    assert refused.returncode == 2
    assert refused.stderr.strip() == (f"Error: {parts}: incomplete: no completion marker for shard 2 of 3; "
                                      "rerun those shards of klpipe precompute first")
    assert not (tmp_path / "never.parquet").exists()


# -- errors: one line naming the URI, exit 2, nothing written -----------------------------------------


# case → (environment changes, the command's URIs [input, output], the expected line). The test fills in
# {bucket} and {endpoint}, an address where nothing listens.
CACHE_URI, OUT_URI = "s3://{bucket}/caches/day1.parquet", "s3://{bucket}/out/result.parquet"
ERROR_CASES = {
    "missing bucket": ({}, ["s3://klpipe-no-such-bucket/day1.parquet", OUT_URI],
                       "Error: s3://klpipe-no-such-bucket/day1.parquet: no such bucket 'klpipe-no-such-bucket'"),
    "missing key": ({}, ["s3://{bucket}/caches/day9.parquet", OUT_URI],
                    "Error: s3://{bucket}/caches/day9.parquet: no such file or directory"),
    "unknown access key": ({"AWS_ACCESS_KEY_ID": "AKIAKLPIPEUNKNOWN000"}, [CACHE_URI, OUT_URI],
                           (f"Error: {CACHE_URI}: the store does not accept these credentials: the access key is "
                            "unknown (check AWS_ACCESS_KEY_ID or AWS_PROFILE)")),
    "wrong secret": ({"AWS_SECRET_ACCESS_KEY": "not-the-secret"}, [CACHE_URI, OUT_URI],
                     (f"Error: {CACHE_URI}: the store does not accept these credentials: the secret key does not "
                      "match (check AWS_SECRET_ACCESS_KEY or AWS_PROFILE)")),
    "access denied": ({"user": "denied"}, [CACHE_URI, OUT_URI],
                      f"Error: {CACHE_URI}: access denied: these credentials may not do this here"),
    "unreachable endpoint": ({"AWS_ENDPOINT_URL": "{endpoint}"}, [CACHE_URI, OUT_URI],
                             (f"Error: {CACHE_URI}: cannot reach the store at {{endpoint}} (check AWS_ENDPOINT_URL "
                              "and the network)")),
    "output bucket missing": ({}, [CACHE_URI, "s3://klpipe-no-such-bucket/result.parquet"],
                              ("Error: s3://klpipe-no-such-bucket/result.parquet: no such bucket "
                               "'klpipe-no-such-bucket'")),
    "output denied": ({"user": "reader"}, [CACHE_URI, OUT_URI],
                      f"Error: {OUT_URI}: access denied: these credentials may not do this here"),
}


@pytest.mark.parametrize("command", ["score", "precompute"])
@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_each_store_error_is_one_line_naming_the_uri(s3_server, bucket, tmp_path, command, case):
    rollouts = command == "precompute"
    source = ROLLOUTS if rollouts else write_cache(tmp_path / "day1.parquet", make_rows(20), provenance=provenance())
    s3_server.put(bucket, "caches/day1.parquet", source.read_bytes())
    endpoint = f"http://127.0.0.1:{free_ports(1)[0]}"

    def fill(text: str) -> str:
        return text.format(bucket=bucket, endpoint=endpoint)

    changes, uris, expected = ERROR_CASES[case]
    changes = {name: fill(value) for name, value in changes.items()}
    (source_uri, output_uri), expected = map(fill, uris), fill(expected)
    user = changes.pop("user", "writer")
    cwd, scratch, cache = tmp_path / "cwd", tmp_path / "tmp", tmp_path / "cache"
    for directory in (cwd, scratch, cache):
        directory.mkdir()
    args = [command, source_uri, "-o", output_uri]
    if rollouts:
        args += ["-m", TINY_LLAMA, *ARGS]
    run = klpipe(s3_server, *args, user=user, cwd=cwd, TMPDIR=scratch, KLPIPE_CACHE_DIR=cache, **changes)
    assert run.returncode == 2, run.stderr
    assert run.stderr.splitlines()[-1] == expected and "Traceback" not in run.stderr
    assert sum(line.startswith("Error:") for line in run.stderr.splitlines()) == 1
    # Nothing that looks like an output, anywhere: not in the directory it ran in, not in $TMPDIR,
    # not on the store. A precompute that failed at its upload keeps its chunks to resume from.
    assert list(cwd.iterdir()) == []
    # torch's own cache aside
    assert [p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor_")] == []
    assert s3_server.keys_under(bucket) == ["caches/day1.parquet"]
    partial = list(cache.glob("work/*.partial"))
    if rollouts and case == "output denied":
        (work,) = partial
        assert sorted(p.name for p in work.iterdir())[:1] == ["chunk-00000000.parquet"]
        resumed = klpipe(s3_server, *args, KLPIPE_CACHE_DIR=cache)  # with credentials that may write
        assert resumed.returncode == 0 and "resuming: 1 of 1 chunks already done" in resumed.stderr, resumed.stderr
        assert s3_server.keys_under(bucket, "out/") == ["out/result.parquet"]
    else:
        assert partial == []
