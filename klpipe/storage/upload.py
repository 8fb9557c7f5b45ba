"""Putting finished files on a store: each object appears whole, or not at all.

pyarrow cannot abort an upload: closing an S3 output stream, which `with` and the C++ destructor both do after an
exception, completes the multipart upload with the parts sent so far. So only a complete local file is uploaded, by
a child process that closes the stream only after every byte is written and counted, and exits without closing
(`os._exit`) on any error or signal; the parent kills the child when it is interrupted itself. A file over what
S3's 10,000 parts of pyarrow's 10 MiB hold is refused before its upload starts. docs/operations.md ("An output
appears whole, or not at all") says the rest: object stores against other filesystems, kill -9, memory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from klpipe.errors import OutputError, first_line
from klpipe.storage.store import StorePath
from klpipe.storage.store_errors import store_error

if TYPE_CHECKING:
    import pyarrow as pa

READ_BYTES = 8 << 20  # what the child reads from the local file per write
FLUSH_BYTES = 128 << 20  # the most the child sends before it waits for its parts to be acknowledged
S3_PART_BYTES = 10 << 20  # the part size of pyarrow's S3 writer (arrow/filesystem/s3fs.cc kPartUploadSize)
S3_MAX_OBJECT_BYTES = 10_000 * S3_PART_BYTES  # S3's 10,000 parts per upload, at that size

# Every stream the child opened: never collected, so no destructor completes one early.
_streams: list[pa.NativeFile] = []


def publish(files: list[tuple[Path, StorePath]]) -> None:
    """Upload each complete local file to its place on a store, in order; the first failure stops the rest.

    Raises StoreError (or OutputError) naming the URI that failed; the files before it are in place.
    """
    if not files:
        return
    for source, destination in files:
        size = source.stat().st_size
        if destination.filesystem.type_name == "s3" and size > S3_MAX_OBJECT_BYTES:
            raise OutputError(f"{destination}: {size / 2**30:,.1f} GiB is more than one upload to S3 can hold here "
                              f"({S3_MAX_OBJECT_BYTES / 2**30:.1f} GiB: 10,000 parts of pyarrow's 10 MiB); "
                              "shard the run (--num-shards) so that each part is smaller")
    request = json.dumps([{"source": str(source), "uri": destination.uri} for source, destination in files])
    # Importable from the child whether or not klpipe is installed (a checkout on PYTHONPATH).
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    # Its own session: a Ctrl-C or a scheduler's signal to the process group reaches klpipe, which
    # decides, and not the child in the middle of a write.
    try:
        child = subprocess.Popen([sys.executable, "-m", "klpipe.storage.upload"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                 start_new_session=True)
    except OSError as exc:
        raise OutputError(f"{files[0][1]}: cannot start the upload ({exc.strerror or exc})") from None
    try:
        stdout, stderr = child.communicate(request)
    except BaseException:
        child.kill()  # an upload it had not completed never will
        child.wait()
        raise
    done = set()
    for line in stdout.splitlines():
        try:
            report = json.loads(line)
        except ValueError:
            report = None
        if not isinstance(report, dict):
            continue  # not the child's own report: a library's chatter
        if "failed" in report:
            raise store_error(StorePath(report["failed"]), report["error"])
        done.add(report["done"])
    if child.returncode != 0 or len(done) != len(files):
        first = next((destination for _, destination in files if destination.uri not in done), files[-1][1])
        why = stderr.strip().splitlines()[0] if stderr.strip() else f"the uploader exited with {child.returncode}"
        raise OutputError(f"{first}: upload failed ({why})")


def _main() -> None:
    """The child: upload each file of the request on stdin; one JSON line per file on stdout."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a signal kills it outright: no exception, no close
    for item in json.load(sys.stdin):
        uri = item["uri"]
        try:
            _put(Path(item["source"]), StorePath(uri))
        except BaseException as exc:  # noqa: BLE001 - whatever it is, the stream must not be closed
            print(json.dumps({"failed": uri, "error": first_line(exc)}), flush=True)
            os._exit(3)  # skips every `with`, finally and destructor that would complete the upload
        print(json.dumps({"done": uri}), flush=True)


def _put(source: Path, destination: StorePath) -> None:
    fs = destination.filesystem
    final = destination.fs_path
    direct = destination.appears_whole()
    target = final if direct else f"{final.rsplit('/', 1)[0]}/.{destination.name}.{uuid.uuid4().hex[:8]}.tmp"
    if not direct:
        fs.create_dir(final.rsplit("/", 1)[0], recursive=True)
    size = source.stat().st_size
    stream = fs.open_output_stream(target)
    _streams.append(stream)
    written = 0
    with open(source, "rb") as local:
        while block := local.read(READ_BYTES):
            stream.write(block)
            written += len(block)
            if written % FLUSH_BYTES < len(block):
                stream.flush()  # waits for the parts in flight; raises if one failed
    if written != size:
        raise OSError(f"read {written} bytes of {source}, which holds {size}")
    stream.close()  # completes the upload: the object appears, whole
    if not direct:
        fs.move(target, final)


if __name__ == "__main__":
    _main()
