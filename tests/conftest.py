import atexit
import os
import shutil
import tempfile

import pytest

# No test may reach the hub: every model is a tiny one under sample_data/ (tests/helpers.py).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Digests of the files the tests fingerprint are remembered here, not in the user's ~/.cache/klpipe.
_cache = tempfile.mkdtemp(prefix="klpipe-test-cache-")
os.environ["KLPIPE_CACHE_DIR"] = _cache
atexit.register(shutil.rmtree, _cache, ignore_errors=True)


@pytest.fixture(autouse=True)
def _own_cache_dir(tmp_path_factory, monkeypatch):
    """Each test remembers digests and the load-time checks' verdicts (storage/verdicts.py) in a directory of its own:
    a test that puts a wrong substitute in place must meet the checks, not a verdict an earlier test left."""
    monkeypatch.setenv("KLPIPE_CACHE_DIR", str(tmp_path_factory.mktemp("klpipe-cache")))


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3-compatible server (moto's) on 127.0.0.1, for the whole session; stopped by its pid."""
    from tests.moto_server import S3Server

    server = S3Server.start(tmp_path_factory.mktemp("moto") / "moto.log")
    yield server
    server.stop()


@pytest.fixture
def bucket(s3_server):
    """A new, empty bucket on the test server."""
    import uuid

    return s3_server.bucket(f"klpipe-{uuid.uuid4().hex[:12]}")
