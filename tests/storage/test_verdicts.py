"""The remembered verdicts on disk (klpipe/storage/verdicts.py): an entry reads back as written under its own key only,
one that cannot is one warning, and a write is whole or nothing."""

import json
import os

import pytest

from klpipe.storage.verdicts import VerdictCache, key_digest

KEY = {"weights": "local:abc", "torch": "2.13.0", "device": {"name": "cpu", "capability": "AVX512"}}


def test_an_entry_reads_back_under_its_own_key_only(tmp_path):
    said = []
    cache = VerdictCache(tmp_path / "verdicts", said.append)
    assert cache.read(KEY) is None and said == []  # nothing remembered: no warning
    cache.write(KEY, {"packed": True})
    assert cache.read(KEY) == {"packed": True}
    assert cache.read({**KEY, "torch": "2.14.0"}) is None and said == []
    assert cache.path(KEY).name == f"{key_digest(KEY)}.json" and key_digest(KEY) != key_digest({**KEY, "torch": "x"})
    assert cache.read(KEY, parse=lambda verdict: ("parsed", verdict)) == ("parsed", {"packed": True})


@pytest.mark.parametrize("damage, why", [
    (lambda entry: entry.write_text("{\"format\": 1, \"ke"), "Unterminated string"),
    (lambda entry: entry.write_bytes(b"\xff\xfe"), "can't decode"),
    (lambda entry: entry.write_text(json.dumps({"format": 1, "key": {"torch": "9"}, "verdict": {}})),
     "written for another key"),
    (lambda entry: entry.write_text(json.dumps({"format": 0, "key": KEY, "verdict": {}})), "not an entry klpipe wrote"),
])
def test_an_unreadable_entry_is_one_warning(tmp_path, damage, why):
    said = []
    cache = VerdictCache(tmp_path / "verdicts", said.append)
    cache.write(KEY, {"packed": True})
    damage(cache.path(KEY))
    assert cache.read(KEY) is None
    assert len(said) == 1 and said[0].startswith(f"warning: the remembered verdict {cache.path(KEY)} is unreadable (")
    assert why in said[0] and said[0].endswith("; the load-time checks run again")


def test_a_verdict_its_parser_refuses_is_one_warning(tmp_path):
    said = []
    cache = VerdictCache(tmp_path / "verdicts", said.append)
    cache.write(KEY, {"packed": "yes"})

    def parse(verdict):
        raise ValueError("packed: not of the record's type")

    assert cache.read(KEY, parse) is None and len(said) == 1 and "packed: not of the record's type" in said[0]


def test_a_cache_that_cannot_be_written_only_means_checking_again(tmp_path):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the directory would go")
    cache = VerdictCache(blocked / "verdicts", lambda line: None)
    cache.write(KEY, {"packed": True})  # no error
    assert cache.read(KEY) is None


def test_a_write_leaves_no_temporary_file(tmp_path):
    cache = VerdictCache(tmp_path / "verdicts", lambda line: None)
    for value in range(3):
        cache.write(KEY, {"value": value})
    assert os.listdir(tmp_path / "verdicts") == [cache.path(KEY).name] and cache.read(KEY) == {"value": 2}
