import atexit
import os
import shutil
import tempfile

# No test may reach the hub: every model is a tiny one under sample_data/ (tests/helpers.py).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Digests of the files the tests fingerprint are remembered here, not in the user's ~/.cache/klpipe.
_cache = tempfile.mkdtemp(prefix="klpipe-test-cache-")
os.environ["KLPIPE_CACHE_DIR"] = _cache
atexit.register(shutil.rmtree, _cache, ignore_errors=True)
