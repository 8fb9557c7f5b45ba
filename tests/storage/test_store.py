"""storage/store.py and storage/upload.py against a real S3-compatible server: moto's, over HTTP on 127.0.0.1.

The stages end to end on S3 are in tests/s3/ (`make test-s3`); here, the layer under them: URIs and
local paths, listings and patterns, fingerprints from what the store says, errors that name the
URI, and uploads that never leave half an object, also when pyarrow's own streams would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from klpipe.errors import InputError, StoreError
from klpipe.storage.download import local_copy
from klpipe.storage.fingerprint import fingerprint
from klpipe.storage.parquet import open_parquet
from klpipe.storage.store import StorePath, check_output, expand, location
from klpipe.storage.upload import publish
from tests.helpers import ROOT, make_rows, provenance, write_cache

MIB = 1 << 20


@pytest.fixture
def aws(s3_server, monkeypatch):
    """The writer's credentials and the server's endpoint in this process's environment, as a user sets them."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return s3_server


def test_local_paths_stay_paths_and_uris_name_store_objects():
    assert location("day.parquet") == Path("day.parquet")
    assert location(Path("/data/day.parquet")) == Path("/data/day.parquet")
    assert location("file:///data/day%201.parquet") == Path("/data/day 1.parquet")
    remote = location("s3://bkt/caches/day.parquet/")
    assert isinstance(remote, StorePath)
    assert str(remote) == "s3://bkt/caches/day.parquet"
    assert remote.name == "day.parquet"
    assert remote.parent == location("s3://bkt/caches")
    assert remote.with_name("day.scored.parquet").uri == "s3://bkt/caches/day.scored.parquet"
    assert (remote.parent / "part-00000-of-00002.done").uri == "s3://bkt/caches/part-00000-of-00002.done"
    assert location("s3://bkt").parent == location("s3://bkt") and location("s3://bkt").name == "bkt"
    with pytest.raises(InputError, match="names no bucket"):
        location("s3:///key")


def test_a_prefix_is_a_directory_and_a_pattern_names_its_matches(aws, bucket):
    for key in ("caches/day-1.parquet", "caches/day-2.parquet", "caches/notes.txt", "caches/old/day-0.parquet"):
        aws.put(bucket, key, b"x" * 3)
    caches = location(f"s3://{bucket}/caches/")
    assert caches.exists() and caches.is_dir() and not caches.is_file()
    assert sorted(p.name for p in caches.iterdir()) == ["day-1.parquet", "day-2.parquet", "notes.txt", "old"]
    assert (caches / "notes.txt").stat().st_size == 3
    # `*` stays within one path component, as a shell's does.
    assert [p.uri for p in expand(f"s3://{bucket}/caches/day-*.parquet")] == [
        f"s3://{bucket}/caches/day-1.parquet", f"s3://{bucket}/caches/day-2.parquet"]
    assert [p.uri for p in expand(f"s3://{bucket}/caches/*/day-?.parquet")] == [f"s3://{bucket}/caches/old/day-0.parquet"]
    with pytest.raises(InputError, match=rf"^s3://{bucket}/caches/none-\*.parquet: no file matches"):
        expand(f"s3://{bucket}/caches/none-*.parquet")
    with pytest.raises(InputError, match=r"a pattern cannot be in the bucket"):
        expand("s3://klpipe-*/caches/day-1.parquet")


def test_a_store_object_is_fingerprinted_by_its_etag_size_and_mtime(aws, bucket):
    aws.put(bucket, "day.parquet", b"a" * 100)
    path = location(f"s3://{bucket}/day.parquet")
    head = aws.client().head_object(Bucket=bucket, Key="day.parquet")
    first = fingerprint(path)
    assert first == {"name": "day.parquet", "size": 100, "etag": head["ETag"],
                     "mtime": head["LastModified"].strftime("%Y-%m-%dT%H:%M:%SZ")}
    assert fingerprint(path) == first
    aws.put(bucket, "day.parquet", b"b" * 100)  # same size, same name: another object
    assert fingerprint(path)["etag"] != first["etag"]


def test_parquet_on_a_store_is_read_in_ranges_with_checksums(aws, bucket, tmp_path):
    local = write_cache(tmp_path / "cache.parquet", make_rows(40), provenance=provenance())
    aws.put(bucket, "cache.parquet", local.read_bytes())
    with open_parquet(location(f"s3://{bucket}/cache.parquet")) as reader:
        assert reader.read().equals(pq.read_table(local))


def test_a_download_for_datasets_is_made_once_and_names_the_object(aws, bucket):
    aws.put(bucket, "day.jsonl", b'{"a": 1}\n')
    path = location(f"s3://{bucket}/day.jsonl")
    copy = local_copy(path)
    assert copy.read_bytes() == b'{"a": 1}\n' and copy.name == "day.jsonl"
    assert local_copy(path) == copy  # unchanged: not downloaded again
    aws.put(bucket, "day.jsonl", b'{"a": 2}\n')
    assert local_copy(path).read_bytes() == b'{"a": 2}\n'  # changed: its new ETag is a new copy


def test_missing_keys_and_buckets_are_named(aws, bucket):
    with pytest.raises(InputError, match=rf"^s3://{bucket}/nothing.parquet: no such file or directory$"):
        location(f"s3://{bucket}/nothing.parquet").open_input_file()
    with pytest.raises(StoreError,
                       match=r"^s3://klpipe-no-such-bucket/x.parquet: no such bucket 'klpipe-no-such-bucket'$"):
        location("s3://klpipe-no-such-bucket/x.parquet").open_input_file()
    # An output's bucket is checked before any work, not at the upload hours later.
    with pytest.raises(StoreError, match="no such bucket 'klpipe-no-such-bucket'"):
        check_output(location("s3://klpipe-no-such-bucket/out.parquet"))
    check_output(location(f"s3://{bucket}/out.parquet"))


def test_publish_uploads_whole_files_in_order(aws, bucket, tmp_path):
    small = tmp_path / "marker.done"
    small.write_text('{"rows": 3}\n')
    large = tmp_path / "part.parquet"
    large.write_bytes(os.urandom(25 * MIB))  # three 10 MiB parts of a multipart upload
    publish([(large, location(f"s3://{bucket}/parts/part.parquet")), (small, location(f"s3://{bucket}/parts/marker.done"))])
    assert aws.read(bucket, "parts/part.parquet") == large.read_bytes()
    assert aws.read(bucket, "parts/marker.done") == small.read_bytes()
    assert aws.keys_under(bucket) == ["parts/marker.done", "parts/part.parquet"]


def test_a_file_larger_than_one_s3_upload_can_hold_is_refused_before_it_starts(aws, bucket, tmp_path, monkeypatch):
    from klpipe.errors import OutputError
    from klpipe.storage import upload

    monkeypatch.setattr(upload, "S3_MAX_OBJECT_BYTES", MIB)  # as if 2 MiB were more than 10,000 parts
    big = tmp_path / "cache.parquet"
    big.write_bytes(b"x" * (2 * MIB))
    with pytest.raises(OutputError, match=rf"^s3://{bucket}/cache.parquet: 0.0 GiB is more than one upload to S3 "
                                          r"can hold here \(0.0 GiB: 10,000 parts of pyarrow's 10 MiB\); shard"):
        publish([(big, location(f"s3://{bucket}/cache.parquet"))])
    assert aws.keys_under(bucket) == []


def test_pyarrow_alone_commits_half_an_object_when_a_write_fails(aws, bucket):
    """Why upload.py exists: an exception inside pyarrow's `with` still completes the multipart upload."""
    path = location(f"s3://{bucket}/cache.parquet")
    with pytest.raises(RuntimeError), path.filesystem.open_output_stream(path.fs_path) as out:
        out.write(b"a" * (11 * MIB))
        raise RuntimeError("a failure half-way through the cache")
    assert aws.client().head_object(Bucket=bucket, Key="cache.parquet")["ContentLength"] == 11 * MIB


def _feed(fifo: Path, nbytes: int, hold: threading.Event | None = None) -> threading.Thread:
    """A thread writing `nbytes` into the FIFO (blocking until they are read), then holding it open until `hold` is
    set."""
    sent = threading.Event()

    def feed():
        with open(fifo, "wb") as out:
            out.write(os.urandom(nbytes))
            sent.set()
            if hold is not None:
                hold.wait(60)

    thread = threading.Thread(target=feed, daemon=True)
    thread.sent = sent
    thread.start()
    return thread


def test_an_upload_that_fails_half_way_never_replaces_the_object(aws, bucket, tmp_path):
    aws.put(bucket, "cache.parquet", b"the good cache")
    fifo = tmp_path / "source"
    os.mkfifo(fifo)  # its size reads as 0: the child fails once it has sent 25 MiB, two parts of them uploaded
    feeder = _feed(fifo, 25 * MIB)
    with pytest.raises(StoreError, match=rf"^s3://{bucket}/cache.parquet: store error \(read 26214400 bytes"):
        publish([(fifo, location(f"s3://{bucket}/cache.parquet"))])
    feeder.join(10)
    assert aws.read(bucket, "cache.parquet") == b"the good cache"
    assert aws.keys_under(bucket) == ["cache.parquet"]


def test_an_upload_interrupted_by_ctrl_c_never_appears(aws, bucket, tmp_path):
    aws.put(bucket, "cache.parquet", b"the good cache")
    fifo = tmp_path / "source"
    os.mkfifo(fifo)
    # Ctrl-C's own disposition in the child, as a terminal gives it: a shell that starts jobs in the background
    # (nohup, `&` without job control) leaves SIGINT ignored in every process it starts.
    code = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from pathlib import Path; from klpipe.storage.upload import publish; "
            "from klpipe.storage.store import location; publish([(Path(sys.argv[1]), location(sys.argv[2]))])")
    process = subprocess.Popen([sys.executable, "-c", code, str(fifo), f"s3://{bucket}/cache.parquet"], cwd=ROOT,
                               stderr=subprocess.PIPE, text=True)
    hold = threading.Event()
    feeder = _feed(fifo, 25 * MIB, hold)
    assert feeder.sent.wait(60)  # the uploader has read 25 MiB and waits for more: mid-upload
    (uploader,) = _children(process.pid)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    # klpipe killed the uploader on its way out: left alone, it would finish whatever it was sending.
    assert not Path(f"/proc/{uploader}").exists() or _state(uploader) == "Z"
    hold.set()
    feeder.join(10)
    assert process.returncode != 0 and "KeyboardInterrupt" in stderr
    assert aws.read(bucket, "cache.parquet") == b"the good cache"
    assert aws.keys_under(bucket) == ["cache.parquet"]


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_any_fsspec_filesystem_takes_the_same_path(tmp_path):
    """A scheme pyarrow does not know goes through fsspec: here its in-memory filesystem, read by `klpipe score`."""
    fsspec = pytest.importorskip("fsspec")
    from klpipe.score import ScoreConfig, score

    local = write_cache(tmp_path / "cache.parquet", make_rows(40), provenance=provenance())
    memory = fsspec.filesystem("memory")
    memory.pipe("/klpipe-test/caches/day-1.parquet", local.read_bytes())
    caches = location("memory://klpipe-test/caches")
    assert caches.is_dir() and [p.name for p in caches.iterdir()] == ["day-1.parquet"]
    assert fingerprint(caches / "day-1.parquet")["size"] == local.stat().st_size  # no ETag here: every byte hashed
    assert "sha256" in fingerprint(caches / "day-1.parquet")
    from_memory = score(ScoreConfig(inputs=["memory://klpipe-test/caches/"], output=tmp_path / "a.parquet"))
    from_disk = score(ScoreConfig(inputs=[local], output=tmp_path / "b.parquet"))
    assert from_memory.report["summary"] == from_disk.report["summary"]
    assert pq.read_table(tmp_path / "a.parquet").equals(pq.read_table(tmp_path / "b.parquet"))
