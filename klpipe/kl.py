"""Kept so that `from klpipe.kl import kl_divergence, estimate_kl_from_samples` works: the KL estimators
live in klpipe/score/kl.py."""

from klpipe.score.kl import (
    AGGREGATES,
    ESTIMATORS,
    estimate_kl_from_samples,
    kl_divergence,
    row_kl,
    sequence_kl,
)

__all__ = ["AGGREGATES", "ESTIMATORS", "estimate_kl_from_samples", "kl_divergence", "row_kl", "sequence_kl"]
