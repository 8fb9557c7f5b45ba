"""Plumbing for the scoring tests: the seed as an oracle, and cache files written with pyarrow.

No torch here: the scoring tests must run where torch is not installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from klpipe.cache import ID, METADATA_KEY, POLICY_LOGPROBS, REF_LOGPROBS, REWARD, STEP, Provenance

ROOT = Path(__file__).resolve().parent.parent
SEED_PATH = ROOT.parent / "shared" / "seed" / "kl_controller.py"

CACHE_SCHEMA = pa.schema(
    [
        (ID, pa.string()),
        (STEP, pa.int64()),
        (POLICY_LOGPROBS, pa.list_(pa.float32())),
        (REF_LOGPROBS, pa.list_(pa.float32())),
        (REWARD, pa.float64()),
    ]
)


class _HideTorch(importlib.abc.MetaPathFinder):
    """Makes the seed take its CPU path without paying for a torch import (tests stay fast)."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError(f"{name} hidden by the test")
        return None


_seed = None


def load_seed():
    """The seed module (../shared/seed/kl_controller.py), imported once."""
    global _seed
    if _seed is None:
        blocker = _HideTorch()
        sys.meta_path.insert(0, blocker)
        try:
            spec = importlib.util.spec_from_file_location("seed_kl_controller", SEED_PATH)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        finally:
            sys.meta_path.remove(blocker)
        _seed = module
    return _seed


def seed_controller(**config):
    seed = load_seed()
    return seed.KLControllerBase(seed.KLConfig(reference_model_name="test", **config))


def seed_config(**ours) -> dict:
    """Our ControllerConfig keywords as the seed's KLConfig keywords."""
    renamed = dict(ours)
    if "window" in renamed:
        renamed["adaptation_window"] = renamed.pop("window")
    return renamed


def write_cache(
    path: Path,
    rows: list[dict],
    schema: pa.Schema = CACHE_SCHEMA,
    provenance: Provenance | None = None,
    row_group_size: int | None = None,
) -> Path:
    """A real parquet cache on disk; columns not in `schema` are dropped from `rows`."""
    table = pa.Table.from_pylist([{k: r.get(k) for k in schema.names} for r in rows], schema=schema)
    if provenance is not None:
        table = table.replace_schema_metadata({METADATA_KEY: provenance.to_json()})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def make_rows(n: int, seed: int = 0, rows_per_step: int = 4, max_tokens: int = 6, dyadic: bool = True) -> list[dict]:
    """Rows with short responses (some empty). Dyadic logprobs (multiples of 1/64) make every sum exact,
    so klpipe and the seed agree to the last bit whatever their summation order."""
    import random

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        length = rng.randint(0, max_tokens)
        if dyadic:
            policy = [-rng.randint(0, 256) / 64 for _ in range(length)]
            ref = [p - rng.randint(-32, 160) / 64 for p in policy]
        else:
            policy = [-rng.expovariate(1.0) for _ in range(length)]
            ref = [p - rng.gauss(0.5, 1.0) for p in policy]
        rows.append(
            {
                ID: f"r{i}",
                STEP: i // rows_per_step,
                POLICY_LOGPROBS: policy,
                REF_LOGPROBS: ref,
                REWARD: rng.randint(-64, 64) / 16,
            }
        )
    return rows


def provenance(**changes) -> Provenance:
    fields = dict(
        model="tiny", revision="abc", tokenizer="sha-1", dtype="float32", temperature=1.0, klpipe_version="0.1.0"
    )
    fields.update(changes)
    return Provenance(**fields)
