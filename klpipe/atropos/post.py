"""Posting groups to a running Atropos API server, as an environment does (atroposlib's `api/server.py`).

The groups of a written file go to `POST /scored_data_list`, a few per request, in file order; the trainer
takes them from the server with `GET /batch`. A request that fails to connect, times out or gets a 5xx is
retried with backoff; one the server refuses (4xx: a group its `ScoredData` model rejects) is not.

A marker beside the file, `<file>.posted.json`, records how many of its groups the server accepted and a
digest of the file: a rerun after a failure posts only the rest of the same file, and a file written anew
(another digest) is posted whole. Standard library only (urllib): one POST of JSON needs nothing more.
"""

from __future__ import annotations

import hashlib
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from klpipe.errors import KlpipeError, first_line
from klpipe.storage.atomic import write_json_atomic

GROUPS_PER_REQUEST = 16
ATTEMPTS = 4  # tries per request: the first, then retries after 0.5, 1 and 2 seconds
TIMEOUT = 60.0  # seconds per request
MARKER_SUFFIX = ".posted.json"


class ApiError(KlpipeError):
    """The Atropos API server is down, or refused what klpipe posted."""

    exit_code = 69  # EX_UNAVAILABLE: the service, not the input; a rerun posts what is left


@dataclass
class Posted:
    url: str
    groups: int  # groups the server holds from this file, with earlier runs'
    sent: int  # of those, posted by this run
    marker: Path


def marker_path(path: Path) -> Path:
    return path.with_name(path.name + MARKER_SUFFIX)


def post_groups(path: Path, url: str, per_request: int = GROUPS_PER_REQUEST, attempts: int = ATTEMPTS,
                backoff: float = 0.5) -> Posted:
    """Post every group of `path` (JSON Lines) not yet accepted to the server at `url`, in order."""
    endpoint = url.rstrip("/") + "/scored_data_list"
    digest = _digest(path)
    marker = marker_path(path)
    done = _read_marker(marker, digest, url)
    index, sent, pending = 0, 0, []
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            if not line.strip():
                continue
            index += 1
            if index <= done:
                continue
            pending.append(line)
            if len(pending) == per_request:
                _post(endpoint, pending, attempts, backoff, first=index - len(pending) + 1)
                sent += len(pending)
                pending = []
                write_json_atomic(marker, {"url": url, "sha256": digest, "groups": index})
    if pending:
        _post(endpoint, pending, attempts, backoff, first=index - len(pending) + 1)
        sent += len(pending)
    write_json_atomic(marker, {"url": url, "sha256": digest, "groups": index})
    return Posted(url=url, groups=index, sent=sent, marker=marker)


def _post(endpoint: str, lines: list[str], attempts: int, backoff: float, first: int) -> None:
    # The lines are sent as they are, not re-encoded: the server gets every field as the file holds it.
    body = ("[" + ",".join(line.rstrip("\r\n") for line in lines) + "]").encode()
    what = f"groups {first} to {first + len(lines) - 1}" if len(lines) > 1 else f"group {first}"
    for attempt in range(attempts):
        request = urllib.request.Request(endpoint, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
                reply = json.loads(response.read() or b"{}")
            if reply.get("status") != "received":
                raise ApiError(f"{endpoint}: the server did not take {what} (it answered {reply})")
            return
        except urllib.error.HTTPError as exc:
            if exc.code < 500:  # refused: retrying sends the same refused body
                detail = exc.read()[:300].decode(errors="replace")
                raise ApiError(f"{endpoint} refused {what}: HTTP {exc.code} {' '.join(detail.split())}") from None
            problem = f"HTTP {exc.code}"
        except (urllib.error.URLError, OSError, ValueError) as exc:
            problem = first_line(getattr(exc, "reason", None) or exc)
        if attempt + 1 < attempts:
            time.sleep(backoff * 2 ** attempt)
    raise ApiError(f"{endpoint}: cannot post {what} after {attempts} tries ({problem}); rerun the same command "
                   "to post the groups not yet taken")


def _read_marker(marker: Path, digest: str, url: str) -> int:
    """Groups of this very file already taken by this server; 0 for another file or server."""
    try:
        state = json.loads(marker.read_text())
    except (OSError, ValueError):
        return 0
    if not isinstance(state, dict) or state.get("sha256") != digest or state.get("url") != url:
        return 0
    groups = state.get("groups")
    return groups if isinstance(groups, int) and groups >= 0 else 0


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()
