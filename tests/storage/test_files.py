"""File plumbing: atomic outputs, input discovery, fingerprints."""

import fcntl
import hashlib
import os
import stat
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from klpipe.errors import InputError, OutputError
from klpipe.storage import atomic, discover, fingerprint


def test_atomic_output_appears_only_on_success(tmp_path):
    target = tmp_path / "out.txt"
    with pytest.raises(RuntimeError), atomic.atomic_output(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash mid-write")
    assert list(tmp_path.iterdir()) == []
    with atomic.atomic_output(target) as tmp:
        tmp.write_text("whole")
    assert target.read_text() == "whole"
    assert list(tmp_path.iterdir()) == [target]
    # Not mkstemp's 0600: what open() would give under the process umask.
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~atomic._UMASK


def test_a_killed_writers_temporary_files_are_removed_by_the_next_write(tmp_path):
    target = tmp_path / "out.txt"
    for stale in (".out.txt.abcd1234.tmp", ".out.txt.k_9zq0xy.tmp"):  # what a kill -9 mid-write leaves
        (tmp_path / stale).write_text("half")
    (tmp_path / ".other.txt.abcd1234.tmp").write_text("another output's: not this write's business")
    with atomic.atomic_output(target) as tmp:
        tmp.write_text("whole")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.txt.abcd1234.tmp", "out.txt"]


def test_a_live_writers_temporary_file_is_left_alone(tmp_path):
    live = tmp_path / ".out.txt.live1234.tmp"
    with open(live, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as atomic_output holds its own until the rename
        with atomic.atomic_output(tmp_path / "out.txt") as tmp:
            tmp.write_text("whole")
        assert live.exists()


def test_a_scratch_directory_is_removed_and_a_killed_runs_is_too(tmp_path):
    stale = tmp_path / ".scratch.abcd1234.tmp"  # what a kill -9 leaves: a directory with a half-written file
    stale.mkdir()
    (stale / "half").write_text("half")
    live = tmp_path / ".scratch.live1234.tmp"
    live.mkdir()
    held = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)  # a live run's: left alone
        with atomic.scratch_directory(tmp_path, "scratch") as scratch, atomic.OutputGroup() as outputs:
            (scratch / "made").write_text("whole")
            with outputs.file(tmp_path / "out.txt") as tmp:
                os.replace(scratch / "made", tmp)
            outputs.commit()
            assert list(scratch.iterdir()) == []
        assert sorted(p.name for p in tmp_path.iterdir()) == [".scratch.live1234.tmp", "out.txt"]
    finally:
        os.close(held)
    assert (tmp_path / "out.txt").read_text() == "whole"


def test_a_group_of_outputs_appears_together_or_not_at_all(tmp_path):
    failed = pytest.raises(OutputError, match=r"out\.b: write failed \(No space left on device")
    with failed, atomic.OutputGroup() as outputs:
        with outputs.file(tmp_path / "out.a") as tmp:
            tmp.write_text("a")
        assert not (tmp_path / "out.a").exists()  # written, not yet in place
        with outputs.file(tmp_path / "out.b") as tmp:
            raise OSError(28, "No space left on device")
    assert list(tmp_path.iterdir()) == []  # out.a never appeared, and no temporary file is left
    with atomic.OutputGroup() as outputs:
        for name in ("out.a", "out.b"):
            with outputs.file(tmp_path / name) as tmp:
                tmp.write_text(name)
        outputs.commit()
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["out.a", "out.b"]


def test_atomic_output_into_an_unwritable_place_is_an_output_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OutputError, match=r"^.*/file/out\.txt: cannot write here"), \
            atomic.atomic_output(blocker / "out.txt"):
        pass


def test_expand_inputs(tmp_path):
    (tmp_path / "b.parquet").write_bytes(b"")
    (tmp_path / "a.parquet").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("")
    assert [p.name for p in discover.expand_inputs([tmp_path], (".parquet",))[0]] == ["a.parquet", "b.parquet"]
    with pytest.raises(InputError, match="no such file or directory"):
        discover.expand_inputs([tmp_path / "nope"], (".parquet",))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match=r"empty: directory holds no \.parquet files"):
        discover.expand_inputs([empty], (".parquet",))


def test_fingerprint_sees_changes_in_small_files_anywhere(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(1000))
    before = fingerprint.fingerprint(path)
    path.write_bytes(bytes(500) + b"\x01" + bytes(499))
    assert fingerprint.fingerprint(path)["sha256"] != before["sha256"]
    assert before["size"] == 1000 and before["name"] == "f.bin"


def test_fingerprint_reads_every_byte_of_a_large_file(tmp_path):
    # The middle of a 65 MiB file: the old policy hashed only the first and last 4 MiB past 64 MiB,
    # so an in-place edit there (same size, modification time put back) went unseen.
    path = tmp_path / "big.bin"
    size = 65 << 20
    with open(path, "wb") as fh:
        fh.truncate(size)
    before = fingerprint.fingerprint(path)
    stat = path.stat()
    with open(path, "r+b") as fh:
        fh.seek(size // 2)
        fh.write(b"\x01")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    after = fingerprint.fingerprint(path)
    assert after["size"] == before["size"] and after["sha256"] != before["sha256"]


def test_a_digest_is_remembered_until_the_file_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("KLPIPE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "weights.bin"
    path.write_bytes(b"a" * 100)
    first = fingerprint.file_digest(path)
    assert first == "sha256:" + hashlib.sha256(b"a" * 100).hexdigest()

    def must_not_read(_path):
        raise AssertionError("an unchanged file was read again")

    with monkeypatch.context() as patched:
        patched.setattr(fingerprint, "_hash_file", must_not_read)
        assert fingerprint.file_digest(path) == first  # remembered: no gigabytes read twice
    stat = path.stat()
    path.write_bytes(b"b" * 100)  # rewritten in place, same size, modification time put back
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert fingerprint.file_digest(path) == "sha256:" + hashlib.sha256(b"b" * 100).hexdigest()


def test_a_hugging_face_cache_file_costs_nothing(tmp_path, monkeypatch):
    # The hub cache names each blob by the sha256 of its content, and snapshot files link to blobs.
    blob_name = hashlib.sha256(b"the weights").hexdigest()
    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / blob_name).write_bytes(b"the weights")
    (tmp_path / "snapshot").mkdir()
    (tmp_path / "snapshot" / "model.safetensors").symlink_to(tmp_path / "blobs" / blob_name)
    monkeypatch.setattr(fingerprint, "_hash_file", lambda _path: pytest.fail("a content-addressed blob was read"))
    assert fingerprint.file_digest(tmp_path / "snapshot" / "model.safetensors") == f"sha256:{blob_name}"


def test_fingerprint_of_a_directory_includes_every_file(tmp_path):
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "a").write_bytes(b"1")
    (folder / "b").write_bytes(b"2")
    before = fingerprint.fingerprint(folder)
    (folder / "b").write_bytes(b"3")
    assert fingerprint.fingerprint(folder)["sha256"] != before["sha256"]
    os.rename(folder / "b", folder / "c")
    assert fingerprint.fingerprint(folder)["sha256"] != before["sha256"]



# A fresh process, so that arrow's peak (max_memory) is the write's: a 40 MB column of 20 kB rows, then the write.
_WIDE_WRITE = """
import sys, numpy as np, pyarrow as pa
from klpipe.storage.parquet import write_table
rows, width = 2048, 20_000
blob = pa.allocate_buffer(rows * width)  # in arrow's pool, as a chunk read from parquet is
np.frombuffer(blob, np.uint8)[:] = np.random.default_rng(0).integers(0, 256, rows * width, dtype=np.uint8)
offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * width).buffers()[1]
table = pa.table({"blob": pa.BinaryArray.from_buffers(pa.binary(), rows, [None, offsets, blob])})
held = pa.total_allocated_bytes()
write_table(table, sys.argv[1])
print(held, pa.default_memory_pool().max_memory())
"""


def test_writing_wide_rows_holds_about_a_page_beside_the_table(tmp_path):
    # pyarrow checks a page's size every 1,024 values: 1,024 rows of a 20 kB column made a 20 MB page, encoded
    # and compressed in memory whole. Writing a 41 MB chunk took 65 MB more; each of precompute's checkpoints
    # and its merge wrote so.
    done = subprocess.run([sys.executable, "-c", _WIDE_WRITE, str(tmp_path / "wide.parquet")], capture_output=True,
                          text=True, check=True)
    held, peak = map(int, done.stdout.split())
    assert peak - held <= 8 << 20, f"writing {held >> 20} MiB of rows took {(peak - held) >> 20} MiB more"
    assert pq.read_table(tmp_path / "wide.parquet").num_rows == 2048
