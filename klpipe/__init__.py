"""klpipe: offline reference logprobs and adaptive KL penalties for RL fine-tuning.

Stage 1 (`klpipe precompute`) streams rollouts through a frozen reference model and caches the
per-token reference logprobs. Stage 2 (`klpipe score`) replays cached policy and reference
logprobs through an adaptive KL controller. Only stage 1 needs torch.
"""

__version__ = "0.1.0"
