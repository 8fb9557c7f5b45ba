"""One test cluster for the whole session, stopped at the end whatever happened, and no job of one
test left running into the next.

pytest tears fixtures down after a failure and after Ctrl-C (KeyboardInterrupt); a SIGTERM (a CI
time limit, `kill`) is turned into the same interrupt, so it stops the daemons too.
"""

from __future__ import annotations

import signal

import pytest

from tests.slurm.cluster import Cluster


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session")
def slurm():
    cluster = Cluster()
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        cluster.start()
        yield cluster
    finally:
        try:
            cluster.stop()
        finally:
            signal.signal(signal.SIGTERM, previous)


@pytest.fixture(autouse=True)
def no_leftover_jobs(slurm):
    """A test that fails while its jobs still run leaves them to this, not to the next test."""
    yield
    slurm.cancel_all()
