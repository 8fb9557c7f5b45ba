"""What a model's remembered verdict (model/verdict.py, storage/verdicts.py) is keyed by: everything that could change
what the load-time checks decide, so that a later run reuses a verdict only where they would decide the same.

    klpipe           its version and a digest of its own code (an edited checkout is another klpipe)
    weights          the weights' fingerprint (config, weights and code files; a hub model's commit), the adapters'
                     over them (every byte) and which side is whose
    options          the dtype and device asked for, --compile, --prefix-sharing (which checks run: the tree's are
                     only where a tree may run), --trust-remote-code, and whether the weights stream
    the model        as loaded (model/runtime.verdict_parts): torch's and transformers' versions, the device's
                     name and capability and the machine's name, the dtype, the attention implementation, its class
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import klpipe
from klpipe.contract import ScoringModel
from klpipe.precompute.config import PrecomputeConfig
from klpipe.storage.verdicts import VerdictCache

if TYPE_CHECKING:
    from klpipe.model.verdict import Verdict


@cache
def klpipe_identity() -> str:
    """klpipe's version and a sha256 of its own Python files: a checkout edited since gives another."""
    root = Path(klpipe.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(f"{path.relative_to(root)}\0".encode() + path.read_bytes())
    return f"{klpipe.__version__} {digest.hexdigest()[:16]}"


def run_key(config: PrecomputeConfig, models, weights: str | None, streamed: bool, policy: bool = False) -> dict:
    """The parts of the key the run's options and files give, for the reference (or, `policy`, a policy with weights of
    its own): `weights` is the fingerprint the cache records for them (provenance's revision or policy_revision)."""
    spec = models.policy_spec if policy else models.spec
    return {
        "klpipe": klpipe_identity(),
        "model": str(Path(spec.name).expanduser().resolve()) if Path(spec.name).expanduser().exists() else spec.name,
        "weights": weights,
        "adapters": [] if policy else [[side, adapter_digest(path)] for side, path, _ in models.adapters],
        "default_side": None if policy else models.reference_side,
        "dtype_asked": spec.dtype,
        "device_asked": spec.device,
        "compile": config.compile,
        "prefix_sharing": config.prefix_sharing,
        "trust_remote_code": config.trust_remote_code,
        "streamed": streamed,
    }


def adapter_digest(path: str) -> str:
    """sha256 over an adapter folder's files, every byte (the digests remembered per file: storage/fingerprint.py)."""
    from klpipe.storage.fingerprint import fingerprint

    return fingerprint(Path(path).expanduser())["sha256"]


class Remembering:
    """The `remembered` a ReferenceModel.load takes: the verdict remembered for the model as loaded, under `key` and
    the model's own parts (None where none is, where --recheck asks for the checks, or without a cache); and, once
    the checks have decided, `keep` writes what they decided back whenever it changed."""

    def __init__(self, cache: VerdictCache | None, key: dict, recheck: bool = False):
        self.cache, self.key, self.recheck = cache, key, recheck
        self.full: dict | None = None  # the key with the model's parts, once loaded
        self.kept: Verdict | None = None  # the verdict last read or written

    def __call__(self, model: Any) -> Verdict | None:
        from klpipe.model.runtime import verdict_parts
        from klpipe.model.verdict import Verdict

        self.full = {**self.key, **verdict_parts(model)}
        if self.cache is None or self.recheck:
            return None
        kept = self.cache.read(self.full, Verdict.from_json)
        self.kept = kept if isinstance(kept, Verdict) else None  # from_json's, or None: none remembered
        return self.kept

    def keep(self, model: ScoringModel) -> None:
        """Write `model`'s verdict under the key where it differs from what was read or last written."""
        if self.cache is None or self.full is None or model.verdict == self.kept:
            return
        self.cache.write(self.full, model.verdict.to_json())
        self.kept = model.verdict
