"""Fingerprints of input files: what a rerun compares to know its inputs are the ones it started with."""

from __future__ import annotations

import hashlib
from pathlib import Path

# Files up to this size are hashed whole; larger ones by their size, head and tail.
FULL_HASH_LIMIT = 64 << 20
SAMPLE_BYTES = 4 << 20


def fingerprint(path: Path) -> dict:
    """Name, size and a sha256 of a file (or of every file of a directory), to detect changed inputs.

    Every shard of a sharded run fingerprints every input, so hashing terabytes whole would cost
    each shard a full read. Past 64 MiB the hash covers the first and last 4 MiB (for parquet,
    the footer with every row group's offsets and statistics) plus the size.
    """
    digest = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    size = 0
    for file in files:
        file_size = file.stat().st_size
        size += file_size
        digest.update(f"{file.relative_to(path) if path.is_dir() else file.name}:{file_size}".encode())
        with open(file, "rb") as fh:
            if file_size <= FULL_HASH_LIMIT:
                while chunk := fh.read(1 << 22):
                    digest.update(chunk)
            else:
                digest.update(fh.read(SAMPLE_BYTES))
                fh.seek(file_size - SAMPLE_BYTES)
                digest.update(fh.read(SAMPLE_BYTES))
    return {"name": path.name, "size": size, "sha256": digest.hexdigest()}

