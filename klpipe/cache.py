"""The cache contract: the one place where both stages agree on columns, types and provenance.

`klpipe precompute` writes caches that satisfy this contract and `klpipe score` reads them.
Pure pyarrow: importing this module must never pull in torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa

from klpipe.errors import InputError, ProvenanceError, first_line
from klpipe.storage.parquet import read_schema
from klpipe.storage.store import Location, store_failure

# Rollout columns (input to precompute).
ID = "id"
STEP = "step"
PROMPT = "prompt"  # text: the exact prompt text the policy saw; or TRL conversational messages
RESPONSE = "response"
COMPLETION = "completion"  # TRL's name for the response: used when there is no `response` column
PROMPT_IDS = "prompt_ids"  # token-id mode (preferred: exact)
RESPONSE_IDS = "response_ids"
POLICY_LOGPROBS = "policy_logprobs"  # one per response token, from the sampling policy (or, with --policy, the trainer)
# The sampler's own logprobs, kept beside the trainer's: precompute --policy moves the rollouts' policy_logprobs here
# (or reads a column mapped to this role), and score measures the sampler against the trainer (score/mismatch.py).
SAMPLER_LOGPROBS = "sampler_logprobs"
REWARD = "reward"
# 1 where the policy sampled the response token, 0 where it did not (a tool's result inside the
# completion): KL is taken over the 1s only, and precompute runs no LM head on the 0s (klpipe/mask.py).
MASK = "mask"
TRL_MASKS = ("tool_mask", "env_mask")  # the names TRL's GRPOTrainer gives the mask (tools=, rollout_func)
TOOLS = "tools"  # conversational rows: the tool schemas the chat template rendered (a list, or JSON text)

# Added by precompute: log p_ref(response_ids[i] | prompt_ids + response_ids[:i]), one per response token;
# null where the mask is 0 (no logprob is computed for a token the policy did not sample).
REF_LOGPROBS = "ref_logprobs"
REF_LOGPROBS_TYPE = pa.list_(pa.float32())

# Added by precompute --policy with --full-kl (the exact KL): per response token, over the whole vocabulary of the
# temperature-scaled distributions the rollouts were sampled from (π the policy, π_ref the reference), in nats;
# null where the mask is 0, as ref_logprobs. Each is list<float32>, as REF_LOGPROBS_TYPE.
KL_POLICY_REF = "kl_policy_ref"  # KL(π ‖ π_ref) = Σ_v π(v) (log π(v) − log π_ref(v)): the penalty's divergence
KL_REF_POLICY = "kl_ref_policy"  # KL(π_ref ‖ π), the other direction
POLICY_ENTROPY = "policy_entropy"  # H(π) = −Σ_v π(v) log π(v)
REF_ENTROPY = "ref_entropy"  # H(π_ref)
FULL_KL_COLUMNS = (KL_POLICY_REF, KL_REF_POLICY, POLICY_ENTROPY, REF_ENTROPY)
# Added by precompute --ref-topk K: per response token the reference's K most likely token ids and their
# (temperature-scaled) logprobs, most likely first; null where the mask is 0.
REF_TOPK_IDS = "ref_topk_ids"
REF_TOPK_LOGPROBS = "ref_topk_logprobs"
REF_TOPK_IDS_TYPE = pa.list_(pa.list_(pa.int32()))
REF_TOPK_LOGPROBS_TYPE = pa.list_(pa.list_(pa.float32()))

# Parquet schema-metadata key holding the JSON provenance record of a cache (klpipe precompute).
METADATA_KEY = b"klpipe"
# And the key holding the settings of a scored file (klpipe score); a scored file keeps its cache's too.
SCORED_METADATA_KEY = b"klpipe_score"


@dataclass
class Provenance:
    """How a cache was made: the model, every setting that moves its numbers, and the inputs.

    Caches scored together must agree on `IDENTITY_FIELDS`, which decide what the numbers mean. A
    rerun skips or resumes a run only when every field agrees, since the settings also decide
    which rows share a batch and the kernels used, and with them the last bits of the values.
    """

    model: str  # hub id or local path, as given
    revision: str | None  # hub commit hash; for a local directory `local:` + a hash of every weight byte
    tokenizer: str  # sha256 of the tokenizer's serialised vocabulary and settings
    dtype: str
    temperature: float
    klpipe_version: str
    inputs: list[dict] = field(default_factory=list)  # [{name, size, sha256}] per input file
    shard: dict | None = None  # {"index": i, "count": n, "rows": [start, stop]} for sharded runs
    columns: dict = field(default_factory=dict)  # {role: column} from --column (klpipe/columns.py)
    device: str | None = None  # "cpu" or "cuda": kernels differ in their last bits
    prefix_sharing: str | None = None  # the --prefix-sharing mode asked for
    max_tokens_per_batch: int | None = None  # the token budget in force: it decides which rows share a pass
    max_cache_mib: int | None = None  # the prefix tree's cache budget in force: it decides its waves
    chunk_rows: int | None = None  # rows per chunk: the window in which rows are batched and shared
    versions: dict = field(default_factory=dict)  # {"torch": ..., "transformers": ...}
    # Conversational rows: what else the chat template was given (both are in the tokenizer fingerprint too).
    tools: str | None = None  # sha256 of the --tools list, as canonical JSON
    chat_template_kwargs: dict = field(default_factory=dict)  # --chat-template-kwargs
    chat_template: str | None = None  # sha256 of the --chat-template file; None: the tokenizer's own template
    rollout_format: str = "trl"  # --rollout-format: whose tool loop built the conversational tool rows
    # --policy: the model whose logprobs precompute wrote into policy_logprobs (None: the rollouts' own).
    policy_model: str | None = None
    policy_revision: str | None = None  # as `revision`, for the policy's weights
    policy_dtype: str | None = None
    # With --policy on rollouts that carry the sampler's logprobs: the rollouts' column they came from, kept in the
    # cache under the sampler_logprobs role (None: the rollouts had none, or --overwrite-policy-logprobs dropped them).
    sampler_source: str | None = None
    # --policy with --full-kl: the cache holds FULL_KL_COLUMNS (False: not computed, or a cache from before them).
    full_kl: bool = False
    ref_topk: int | None = None  # --ref-topk: the K of REF_TOPK_IDS and REF_TOPK_LOGPROBS (None: none written)

    # The fields that decide what the numbers in ref_logprobs (and, with --policy, policy_logprobs) are
    # (the column mapping decides which ids are scored). The others change them at most in float rounding.
    IDENTITY_FIELDS = ("model", "revision", "tokenizer", "dtype", "temperature", "columns", "policy_model",
                       "policy_revision", "policy_dtype")

    def identity(self) -> dict:
        return {name: getattr(self, name) for name in self.IDENTITY_FIELDS}

    def differences(self, other: Provenance, names: tuple[str, ...] | None = None) -> list[str]:
        """Each field (of `names`, default all) where `other` differs from this one, said for a person."""
        found = []
        for name in names or tuple(f for f in self.__dataclass_fields__):
            before, after = getattr(self, name), getattr(other, name)
            if before == after:
                continue
            if name == "inputs":
                changed = _changed_inputs(before, after)
                found.append(f"input files changed ({changed})")
            elif name == "revision" and str(after).startswith("local:"):
                found.append(f"the weights of {other.model} changed ({before} → {after})")
            elif name == "policy_model":
                found.append(f"the policy model {before!r} → {after!r}")
            elif name == "policy_revision" and str(after).startswith("local:"):
                found.append(f"the weights of the policy {other.policy_model} changed ({before} → {after})")
            elif name == "tokenizer":
                found.append("the tokenizer changed (its vocabulary or settings; for conversational rows its chat "
                             "template, the tools or the template's options)")
            elif name == "tools":
                found.append("the --tools list changed")
            elif name == "chat_template":
                found.append("the --chat-template changed")
            else:
                found.append(f"{name} {before!r} → {after!r}")
        return found

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Provenance:
        data = json.loads(raw)
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def _changed_inputs(before: list[dict], after: list[dict]) -> str:
    old = {f.get("name"): f for f in before or []}
    new = {f.get("name"): f for f in after or []}
    names = [n for n in new if old.get(n) != new[n]] + [n for n in old if n not in new]
    return ", ".join(str(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def schema_with_provenance(schema: pa.Schema, provenance: Provenance) -> pa.Schema:
    metadata = dict(schema.metadata or {})
    metadata[METADATA_KEY] = provenance.to_json()
    return schema.with_metadata(metadata)


def read_provenance(path: str | Path | Location) -> Provenance | None:
    """The provenance of a cache file, or None when klpipe did not write it."""
    try:
        metadata = read_schema(path).metadata or {}
    except (OSError, pa.ArrowException) as exc:
        unreadable = InputError(f"{path}: not a readable parquet file ({first_line(exc)})")
        raise store_failure(path, exc) or unreadable from None
    raw = metadata.get(METADATA_KEY)
    if raw is None:
        return None
    try:
        return Provenance.from_json(raw)
    except (ValueError, TypeError) as exc:
        raise InputError(f"{path}: corrupt klpipe provenance metadata ({exc})") from None


def written_by_klpipe(path: str | Path | Location) -> str | None:
    """"scored" for a file klpipe score wrote, "cache" for one klpipe precompute wrote, else None."""
    try:
        metadata = read_schema(path).metadata or {}
    except (OSError, pa.ArrowException):
        return None  # not readable as parquet: reading it as an input says what is wrong
    if SCORED_METADATA_KEY in metadata:
        return "scored"
    return "cache" if METADATA_KEY in metadata else None


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
