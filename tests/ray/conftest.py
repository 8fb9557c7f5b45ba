"""One Ray test cluster for the whole session, stopped at the end whatever happened, with nothing of it left.

pytest tears fixtures down after a failure and after Ctrl-C (KeyboardInterrupt); a SIGTERM (a CI time limit,
`kill`) is turned into the same interrupt, so it stops the cluster too.
"""

from __future__ import annotations

import signal

import pytest

from tests.ray.cluster import Cluster


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session")
def cluster():
    pytest.importorskip("ray", reason="`make test-ray` installs Ray (the klpipe[ray] extra)")
    ray_cluster = Cluster()
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        ray_cluster.start()
        yield ray_cluster
    finally:
        try:
            ray_cluster.stop()
            assert not ray_cluster.processes(), "processes of the test cluster outlived stop()"
        finally:
            signal.signal(signal.SIGTERM, previous)
