"""The cache contract: the one place where both stages agree on columns, types and provenance.

`klpipe precompute` writes caches that satisfy this contract and `klpipe score` reads them.
Pure pyarrow: importing this module must never pull in torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from klpipe.errors import InputError, ProvenanceError, first_line

# Rollout columns (input to precompute).
ID = "id"
STEP = "step"
PROMPT = "prompt"  # text: the exact prompt text the policy saw; or TRL conversational messages
RESPONSE = "response"
COMPLETION = "completion"  # TRL's name for the response: used when there is no `response` column
PROMPT_IDS = "prompt_ids"  # token-id mode (preferred: exact)
RESPONSE_IDS = "response_ids"
POLICY_LOGPROBS = "policy_logprobs"  # one per response token, from the sampling policy
REWARD = "reward"

# Added by precompute: log p_ref(response_ids[i] | prompt_ids + response_ids[:i]), one per response token.
REF_LOGPROBS = "ref_logprobs"
REF_LOGPROBS_TYPE = pa.list_(pa.float32())

# Parquet schema-metadata key holding the JSON provenance record.
METADATA_KEY = b"klpipe"


@dataclass
class Provenance:
    """How a cache was made. Caches scored together must agree on `identity()`."""

    model: str  # hub id or local path, as given
    revision: str | None  # commit hash when known, else the requested revision
    tokenizer: str  # sha256 of the tokenizer's serialised vocabulary and settings
    dtype: str
    temperature: float
    klpipe_version: str
    inputs: list[dict] = field(default_factory=list)  # [{name, size, sha256}] per input file
    shard: dict | None = None  # {"index": i, "count": n} for sharded runs
    columns: dict = field(default_factory=dict)  # {role: column} from --column (klpipe/columns.py)

    # The fields that change the numbers in ref_logprobs (the column mapping decides which ids
    # are scored); the rest is bookkeeping.
    IDENTITY_FIELDS = ("model", "revision", "tokenizer", "dtype", "temperature", "columns")

    def identity(self) -> dict:
        return {name: getattr(self, name) for name in self.IDENTITY_FIELDS}

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Provenance:
        data = json.loads(raw)
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def schema_with_provenance(schema: pa.Schema, provenance: Provenance) -> pa.Schema:
    metadata = dict(schema.metadata or {})
    metadata[METADATA_KEY] = provenance.to_json()
    return schema.with_metadata(metadata)


def read_provenance(path: str | Path) -> Provenance | None:
    """The provenance of a cache file, or None when klpipe did not write it."""
    try:
        metadata = pq.read_schema(path).metadata or {}
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"{path}: not a readable parquet file ({first_line(exc)})") from None
    raw = metadata.get(METADATA_KEY)
    if raw is None:
        return None
    try:
        return Provenance.from_json(raw)
    except (ValueError, TypeError) as exc:
        raise InputError(f"{path}: corrupt klpipe provenance metadata ({exc})") from None


def check_compatible(provenances: list[tuple[str, Provenance | None]]) -> None:
    """Refuse to mix caches whose reference logprobs were made differently."""
    known = [(name, p) for name, p in provenances if p is not None]
    if not known:
        return
    first_name, first = known[0]
    for name, other in known[1:]:
        for key in Provenance.IDENTITY_FIELDS:
            a, b = getattr(first, key), getattr(other, key)
            if a != b:
                raise ProvenanceError(
                    f"caches disagree on {key}: {first_name} has {a!r}, {name} has {b!r}; "
                    "score caches made with one reference model and settings at a time"
                )
