"""klpipe's Python API for the adaptive KL coefficient: the controller `klpipe score` replays, for a trainer's loop.

    from klpipe.controller import ControllerConfig, KLController

    controller = KLController(ControllerConfig(kl_coeff=0.1, kl_target=3.0))
    penalties, stats = controller.get_batch_penalty_from_logprobs(policy_batch, ref_batch)
    rewards = [r - p for r, p in zip(rewards, penalties)]
    state = controller.save_state()       # JSON: `klpipe score --state FILE` continues from it, and back

The same rules and numbers as `klpipe score` (they live in klpipe/score/controller.py); docs/score.md describes the
window, proportional and fixed rules, docs/controller.md where they depart from elizaOS's `KLController`.
"""

from klpipe.score.controller import CONTROLLERS, ControllerConfig, KLController, KLStats

__all__ = ["CONTROLLERS", "ControllerConfig", "KLController", "KLStats"]
