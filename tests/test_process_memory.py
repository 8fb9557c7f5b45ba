"""This process's memory as the kernel counts it (klpipe/process_memory.py), held to /proc/self/status's own words."""

import sys
from pathlib import Path

import pytest

from klpipe import process_memory


def status(field: str) -> int:
    """A /proc/self/status field (VmRSS, RssAnon), in bytes."""
    text = Path("/proc/self/status").read_text()
    return int(text.split(f"{field}:")[1].split()[0]) << 10


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/statm is Linux's")
def test_resident_and_own_are_the_kernels_rss_and_rss_anon():
    held = bytearray(64 << 20)  # 64 MiB of the process's own, touched
    held[::4096] = b"\1" * len(held[::4096])
    assert abs(process_memory.resident() - status("VmRSS")) < 4 << 20
    assert abs(process_memory.own() - status("RssAnon")) < 4 << 20
    assert process_memory.own() >= 64 << 20
    assert process_memory.resident() > process_memory.own()  # the libraries' shared pages, counted by one only
    del held
