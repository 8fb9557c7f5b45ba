"""One three-host Ray cluster (cluster.py) and one S3 server on its bridge for the whole session, stopped and
removed at the end whatever happened: the nodes, the server, the namespaces and the bridge.

pytest tears fixtures down after a failure and after Ctrl-C (KeyboardInterrupt); a SIGTERM (a CI time limit,
`kill`) is turned into the same interrupt, so it tears them down too.
"""

from __future__ import annotations

import signal

import pytest

from tests.moto_server import S3Server
from tests.ray_hosts.cluster import HostsCluster


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session")
def hosts(tmp_path_factory):
    """(the cluster, the S3 server on its bridge)."""
    pytest.importorskip("ray", reason="`make test-ray-hosts` installs Ray (the klpipe[ray] extra)")
    cluster = HostsCluster()
    previous = signal.signal(signal.SIGTERM, _interrupt)
    server = None
    try:
        cluster.make_hosts()
        server = S3Server.start(tmp_path_factory.mktemp("moto") / "moto.log", host=cluster.network.gateway)
        cluster.server_env = server.env("writer")
        cluster.start()
        yield cluster, server
    finally:
        try:
            cluster.stop()
            assert not cluster.processes(), "processes of the test cluster outlived stop()"
            assert not cluster.network.hosts
        finally:
            if server is not None:
                server.stop()
            signal.signal(signal.SIGTERM, previous)
