"""Local copies of files on a store, for readers that need a local path (`datasets`' save_to_disk directories)."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import pyarrow.fs as pafs

from klpipe.errors import InputError
from klpipe.storage.fingerprint import cache_dir, store_fingerprint
from klpipe.storage.store import Location, StorePath
from klpipe.storage.store_errors import missing, store_error


def local_copy(path: Location) -> Path:
    """A local copy of a file or directory on a store, for readers that need one (`datasets`); a local path itself.

    Kept in KLPIPE_CACHE_DIR/downloads under a name made of the URI, size, modification time and
    ETag, so a rerun (and each pass of one run) downloads an unchanged object once, and a changed
    one again. Appears atomically: downloaded beside, then renamed.
    """
    if not isinstance(path, StorePath):
        return path
    key = hashlib.sha256(f"{path.uri}\0{sorted(store_fingerprint(path).items())}".encode()).hexdigest()[:24]
    downloads = cache_dir() / "downloads"
    target = downloads / key / path.name
    if target.exists():
        return target
    try:
        downloads.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{key}.", suffix=".tmp", dir=downloads))
    except OSError as exc:
        raise InputError(f"{downloads}: cannot download {path} here ({exc.strerror or exc})") from None
    try:
        (scratch / path.name).parent.mkdir(parents=True, exist_ok=True)
        pafs.copy_files(path.fs_path, str(scratch / path.name), source_filesystem=path.filesystem,
                        destination_filesystem=pafs.LocalFileSystem(), use_threads=False)
        try:
            os.replace(scratch, downloads / key)
        except OSError:
            if not target.exists():  # another run renamed the same download into place first: use it
                raise
    except FileNotFoundError:
        raise missing(path) from None
    except OSError as exc:
        raise store_error(path, exc) from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target

