"""klpipe's Python API, for a trainer's own loop: the adaptive KL controller `klpipe score` replays, and the per-token
KL estimators with their per-row aggregates. No torch.

    from klpipe.api import ControllerConfig, KLController, row_kl, sequence_kl

    controller = KLController(ControllerConfig(kl_coeff=0.1, kl_target=3.0))
    penalties, stats = controller.get_batch_penalty_from_logprobs(policy_batch, ref_batch)
    rewards = [r - p for r, p in zip(rewards, penalties)]
    state = controller.save_state()       # JSON: `klpipe score --state FILE` continues from it, and back

    sequence_kl(policy_logprobs, ref_logprobs)               # one response: the clamped mean k1, in nats
    row_kl(policy, ref, offsets, estimator="k3").kl          # every row of flat arrays at once (numpy)
    row_kl(policy, ref, offsets, estimator="full", exact=kl).kl  # the exact per-token KL, aggregated per row
    kl_divergence(policy_probs, reference_probs)             # two discrete distributions
    estimate_kl_from_samples(policy_texts, reference_texts, tokenizer)  # from samples' token counts

The same rules and numbers as `klpipe score`, which computes its `kl` column and coefficients with these (they live in
klpipe/score/kl.py and klpipe/score/controller.py); docs/score.md says what each estimator measures and describes the
window, proportional and fixed rules, docs/controller.md where they depart from elizaOS's `KLController`.
"""

from klpipe.score.controller import CONTROLLERS, ControllerConfig, KLController, KLStats
from klpipe.score.kl import (
    AGGREGATES,
    ESTIMATORS,
    estimate_kl_from_samples,
    kl_divergence,
    row_kl,
    sequence_kl,
)

__all__ = ["AGGREGATES", "CONTROLLERS", "ESTIMATORS", "ControllerConfig", "KLController", "KLStats",
           "estimate_kl_from_samples", "kl_divergence", "row_kl", "sequence_kl"]
