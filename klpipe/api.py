"""klpipe's Python API for KL estimates: the per-token estimators and their per-row aggregates, no torch.

    from klpipe.api import row_kl, sequence_kl

    sequence_kl(policy_logprobs, ref_logprobs)               # one response: the clamped mean k1, in nats
    row_kl(policy, ref, offsets, estimator="k3").kl          # every row of flat arrays at once (numpy)
    row_kl(policy, ref, offsets, estimator="full", exact=kl).kl  # the exact per-token KL, aggregated per row
    kl_divergence(policy_probs, reference_probs)             # two discrete distributions
    estimate_kl_from_samples(policy_texts, reference_texts, tokenizer)  # from samples' token counts

`klpipe score` computes its `kl` column with these (they live in klpipe/score/kl.py); docs/score.md says what each
estimator measures.
"""

from klpipe.score.kl import (
    AGGREGATES,
    ESTIMATORS,
    estimate_kl_from_samples,
    kl_divergence,
    row_kl,
    sequence_kl,
)

__all__ = ["AGGREGATES", "ESTIMATORS", "estimate_kl_from_samples", "kl_divergence", "row_kl", "sequence_kl"]
