"""Load-time probes: klpipe's fast paths checked against the model's own computation before any real row.

An architecture that transforms its logits in a way klpipe does not know, or whose cache cannot
be continued exactly, then fails loudly (or falls back) instead of producing wrong numbers.
"""

from __future__ import annotations

import numpy as np
import torch

from klpipe.errors import ModelError, first_line


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


def check_prefix_sharing(reference) -> str | None:
    """None if the shared-prompt path reproduces the per-row path on a probe; otherwise why not.

    The probe has two prompts of different lengths (left padding), one longer than a typical
    sliding window, responses of length 0, 1 and several, and two passes over one prefill (so a
    cache that a pass modified in place would show).
    """
    generator = torch.Generator().manual_seed(1)

    def tokens(n: int) -> np.ndarray:
        return torch.randint(0, reference.vocab_size, (n,), generator=generator).numpy()

    prompts = [tokens(40), tokens(5)]
    responses = [tokens(7), tokens(1), tokens(0), tokens(4), tokens(6)]
    prompt_of = np.array([0, 0, 0, 1, 0])
    try:
        got = reference.score_shared(prompts, responses, prompt_of, [np.array([0, 3]), np.array([4])])
    except Exception as exc:  # noqa: BLE001 - any failure means: do not share on this model
        return f"{type(exc).__name__}: {first_line(exc)}"
    expected = reference.score_batch([(prompts[g], r) for g, r in zip(prompt_of, responses)])
    gap = max((float(np.max(np.abs(a - b))) for a, b in zip(got, expected) if len(b)), default=0.0)
    if any(a.shape != b.shape for a, b in zip(got, expected)) or not gap <= reference.probe_tolerance:
        return f"continuing a prompt's KV cache changes the logprobs (max |Δ logprob| = {gap:.3g})"
    return None
