import os

# No test may reach the hub: every model is a tiny one under sample_data/.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "sample_data"
TINY_GEMMA = SAMPLE / "tiny-gemma4"
TINY_LLAMA = SAMPLE / "tiny-llama"
ROLLOUTS = SAMPLE / "rollouts.parquet"


@pytest.fixture(scope="session")
def sample_dir() -> Path:
    return SAMPLE
