"""Fingerprints: what a rerun compares to know that its inputs and weights are the ones it started with.

One policy for every file, rollouts and model weights alike: a sha256 of every byte. Hashing only
a file's head would miss a model fine-tuned or LoRA-merged over the same directory (a safetensors
file opens with its header, which such a change leaves as it was). Reading gigabytes again on every
rerun would be slow, so a digest is remembered on this machine, keyed by the file's path, device,
inode, size, and modification and change times: rewriting a file changes them, and even a `touch -d`
that puts the modification time back moves the change time, which no user can set. A file in the
Hugging Face cache is a link to a blob named by the hash of its content, which costs nothing.

An object on a store (storage/store.py) is fingerprinted by what the store already says about it:
its ETag, size and modification time, from one HEAD request and without reading it. An S3 ETag
changes whenever the object is written again (it is the MD5 of its bytes, of its parts' MD5s for a
multipart upload, or random under SSE-KMS), and the modification time does too. Where a store
gives no ETag, every byte is hashed, as for a local file, and not remembered (nothing on this
machine tells that the object is unchanged).
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from klpipe.storage.store import Location, StorePath

CACHE_ENV = "KLPIPE_CACHE_DIR"  # where klpipe keeps what it remembers (digests); default ~/.cache/klpipe
READ_BYTES = 1 << 22

_DIGEST = re.compile(r"^(sha256:[0-9a-f]{64}|git-sha1:[0-9a-f]{40})$")


def cache_dir() -> Path:
    """$KLPIPE_CACHE_DIR, else $XDG_CACHE_HOME/klpipe, else ~/.cache/klpipe."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "klpipe"


def file_digest(path: str | Path) -> str:
    """`sha256:<hex>` of a file's bytes (or the hub cache's own content address), remembered per machine."""
    path = Path(path)
    real = path.resolve()
    blob = _hub_blob_digest(path, real)
    if blob is not None:
        return blob
    stat = real.stat()
    key = f"{real}\0{stat.st_dev}\0{stat.st_ino}\0{stat.st_size}\0{stat.st_mtime_ns}\0{stat.st_ctime_ns}"
    entry = cache_dir() / "digests" / hashlib.sha256(key.encode()).hexdigest()
    try:
        remembered = entry.read_text().strip()
        if _DIGEST.match(remembered):
            return remembered
    except OSError:
        pass  # not remembered yet, or no cache directory: hash it
    digest = "sha256:" + _hash_file(real)
    _remember(entry, digest)
    return digest


def fingerprint(path: Location) -> dict[str, Any]:
    """Name, size and a sha256 over every byte of a file, or of every file of a directory (`save_to_disk`);
    for an object on a store, name, size, ETag and modification time (store_fingerprint)."""
    if isinstance(path, StorePath):
        return store_fingerprint(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    digest = hashlib.sha256()
    size = 0
    for file in files:
        file_size = file.stat().st_size
        size += file_size
        name = file.relative_to(path) if path.is_dir() else file.name
        digest.update(f"{name}:{file_size}:{file_digest(file)}\n".encode())
    return {"name": path.name, "size": size, "sha256": digest.hexdigest()}


def store_fingerprint(path: StorePath) -> dict[str, Any]:
    """`{name, size, etag, mtime}` of an object on a store, from its metadata; of a directory, an etag made
    of every object's. `{name, size, sha256}` where the store gives no ETag."""
    files = path.walk_files() if path.is_dir() else [path]
    lines = []
    size = 0
    latest = ""
    for file in files:
        meta = file.object_metadata()
        etag = meta.get("ETag")
        file_size = int(meta.get("Content-Length", file.stat().st_size))
        if etag is None:
            return _hash_store_files(path, files)
        mtime = meta.get("Last-Modified") or str(file.stat().st_mtime)
        name = file.uri[len(path.uri) + 1:] if file is not path else file.name
        lines.append(f"{name}:{file_size}:{etag}:{mtime}\n")
        size += file_size
        latest = max(latest, mtime)
    if files == [path]:
        return {"name": path.name, "size": size, "etag": etag, "mtime": latest}
    return {"name": path.name, "size": size, "etag": "sha256:" + hashlib.sha256("".join(lines).encode()).hexdigest(),
            "mtime": latest}


def _hash_store_files(path: StorePath, files: list[StorePath]) -> dict[str, Any]:
    """Name, size and a sha256 over every byte, read from the store: for stores that give no ETag."""
    digest = hashlib.sha256()
    size = 0
    for file in files:
        content = hashlib.sha256()
        file_size = 0
        with file.open_input_file() as stream:
            while chunk := stream.read(READ_BYTES):
                content.update(chunk)
                file_size += len(chunk)
        size += file_size
        name = file.uri[len(path.uri) + 1:] if file is not path else file.name
        digest.update(f"{name}:{file_size}:sha256:{content.hexdigest()}\n".encode())
    return {"name": path.name, "size": size, "sha256": digest.hexdigest()}


def _hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(READ_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _hub_blob_digest(path: Path, real: Path) -> str | None:
    """The content address of a Hugging Face cache file: a link into `blobs/`, named by its sha256 (LFS
    files) or its git blob sha1 (small files); None for any other file."""
    if not path.is_symlink() or real.parent.name != "blobs":
        return None
    name = real.name
    if re.fullmatch(r"[0-9a-f]{64}", name):
        return f"sha256:{name}"
    if re.fullmatch(r"[0-9a-f]{40}", name):
        return f"git-sha1:{name}"
    return None


def _remember(entry: Path, digest: str) -> None:
    """Best effort: a read-only or full cache directory only means hashing again next time."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".digest.", dir=entry.parent)
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(digest + "\n")
        os.replace(tmp, entry)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
