"""The load-time checks' verdicts, remembered beside the fingerprints' digests (fingerprint.cache_dir()/verdicts).

A cron job loads the same model with the same settings every day; the checks that hold klpipe's paths to the
model's own forward reach the same decisions every time. An entry is a JSON file named by the sha256 of its key (every
part that could change a decision: the weights' and adapters' fingerprints, the versions, the device, the options
that select paths; precompute/verdict_key.py) and holding the key itself, so that a file under another key's name is
never taken for it. It is written whole (atomic.py: a temporary file renamed into place), so two runs that write the
same entry at once leave one whole entry or the other, never half of each. An entry that cannot be read back as
written (cut short, edited, of another version's layout) is one warning, and the checks run again and write it anew.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from klpipe.errors import OutputError
from klpipe.storage.atomic import write_json_atomic
from klpipe.storage.fingerprint import cache_dir

FORMAT = 1  # the entries' layout: another is read as unreadable, and written anew


def key_digest(key: dict[str, Any]) -> str:
    """sha256 of the key as canonical JSON: the entry's file name."""
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


class VerdictCache:
    """The verdicts under `directory` (default: the cache directory's `verdicts/`); `log` hears of an unreadable
    entry."""

    def __init__(self, directory: Path | None = None, log: Callable[[str], object] = print):
        self.directory = Path(directory) if directory is not None else cache_dir() / "verdicts"
        self.log = log

    def path(self, key: dict[str, Any]) -> Path:
        return self.directory / f"{key_digest(key)}.json"

    def read(self, key: dict[str, Any], parse: Callable[[Any], object] | None = None) -> object | None:
        """The verdict remembered under `key` (as `parse(record)` makes it, where given), or None: none remembered,
        or an entry that cannot be read (one warning: the checks run again and write it anew)."""
        path = self.path(key)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:
            self._unreadable(path, getattr(exc, "strerror", None) or str(exc))
            return None
        try:
            entry = json.loads(text)
            if not isinstance(entry, dict) or entry.get("format") != FORMAT or "verdict" not in entry:
                raise ValueError("not an entry klpipe wrote")
            if entry.get("key") != json.loads(json.dumps(key, sort_keys=True, default=str)):
                raise ValueError("written for another key")
            verdict: object = entry["verdict"]
            return parse(verdict) if parse is not None else verdict
        except (ValueError, TypeError) as exc:
            self._unreadable(path, str(exc))
            return None

    def write(self, key: dict[str, Any], verdict: dict[str, Any]) -> None:
        """Remember `verdict` under `key`, whole or not at all. Best effort: a cache directory that cannot be written
        only means the checks run again next time."""
        entry = {"format": FORMAT, "key": key, "verdict": verdict}
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.path(key), json.loads(json.dumps(entry, default=str)))
        except (OSError, OutputError):
            pass

    def _unreadable(self, path: Path, why: str) -> None:
        self.log(f"warning: the remembered verdict {path} is unreadable ({why}); the load-time checks run again")
