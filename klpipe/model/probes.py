"""Load-time probe of the chunked LM head against the model's own logits, before any real row.

An architecture that transforms its logits in a way klpipe does not know then fails loudly instead
of producing wrong numbers. (The prefix tree's probe, precompute/logprobs.check_tree, checks that
the model's keys and values can be continued exactly.)
"""

from __future__ import annotations

import numpy as np
import torch

from klpipe.errors import ModelError


@torch.inference_mode()
def check_head(reference) -> None:
    """Compare the chunked head with the model's own forward once, on a short probe sequence.

    This catches architectures that transform logits in ways klpipe does not model, before
    they silently produce wrong logprobs (softcap bugs have produced KL 0.24 instead of 1e-5).
    """
    generator = torch.Generator().manual_seed(0)
    length = 12
    probe = torch.randint(0, reference.vocab_size, (1, length), generator=generator).to(reference.input_device)
    own = reference.model(input_ids=probe, use_cache=False).logits.float()[0, :-1]  # (T-1, V)
    expected = torch.log_softmax(own, dim=-1).gather(-1, probe[0, 1:, None].to(own.device))[:, 0]
    ours = reference.score_batch([(probe[0, :6].cpu().numpy(), probe[0, 6:].cpu().numpy())])[0]
    ours_full = reference.score_batch([(probe[0, :1].cpu().numpy(), probe[0, 1:].cpu().numpy())])[0]
    gap = float(np.max(np.abs(ours_full - expected.cpu().numpy())))
    gap = max(gap, float(np.max(np.abs(ours - expected.cpu().numpy()[5:]))))
    if not gap <= reference.probe_tolerance:
        raise ModelError(
            f"{type(reference.model).__name__}: klpipe's chunked LM head disagrees with the model's own logits "
            f"(max |Δ logprob| = {gap:.3g}); this architecture transforms its logits in a way klpipe does not know"
        )
