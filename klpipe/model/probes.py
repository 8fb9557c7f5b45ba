"""The load-time check: every path klpipe computes logprobs by, held against the model's own forward.

Before any row, and before klpipe installs anything in the model, a probe sequence runs through the
model as transformers loaded it (its own attention implementation, its own head and whatever follows
it): that forward is the oracle (`take_oracle`). Each substitute klpipe would use is then compared with
it on the same probe, and one that disagrees is dropped for the model's own code, with one log line:

    the chunked head (head.LMHead)        dropped for head.ModelHead: the model's own head, by its forward
    the cascade attention (cascade.py)    dropped for the model's own attention implementation

The prefix tree's probe (precompute/logprobs.check_tree) holds the tree against the same forward.
Two computations of klpipe's that agree with each other prove nothing; the model's own forward does.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import numpy as np
import torch

from klpipe.errors import ModelError, first_line

PROBE_LENGTH = 24


@dataclass(frozen=True)
class Oracle:
    """The probe and its logprobs by the model's own untouched forward."""

    ids: np.ndarray  # (T,) int64 the probe's tokens
    logprobs: np.ndarray  # (T - 1,) float32: log p(ids[t] | ids[:t]) for t = 1 .. T - 1


@torch.inference_mode()
def own_logprobs(model, rows: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
    """log p(response | prompt) of each row by `model`'s own forward, one row at a time, as float32: only the
    positions that predict a response token reach its head (`logits_to_keep`)."""
    device = model.get_input_embeddings().weight.device
    keeps = "logits_to_keep" in inspect.signature(model.forward).parameters  # a model's own code may not take it
    results = []
    for prompt, response in rows:
        if not len(response):
            results.append(np.zeros(0, dtype=np.float32))
            continue
        ids = torch.from_numpy(np.concatenate([prompt, response[:-1]]).astype(np.int64))[None].to(device)
        keep = torch.arange(len(prompt) - 1, ids.shape[1], device=device)  # (R,) positions predicting the response
        if keeps:
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits[0].float()  # (R, V)
        else:
            logits = model(input_ids=ids, use_cache=False).logits[0, keep].float()
        targets = torch.from_numpy(np.asarray(response, dtype=np.int64)).to(logits.device)
        results.append(torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0].cpu().numpy())
    return results


def take_oracle(reference) -> Oracle:
    """The probe's logprobs by the model as transformers loaded it: call before anything of klpipe's is installed."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, reference.vocab_size, (PROBE_LENGTH,), generator=generator).numpy()
    try:
        return Oracle(ids, own_logprobs(reference.model, [(ids[:1], ids[1:])])[0])
    except Exception as exc:  # noqa: BLE001 - the model's own code fails: nothing klpipe computes could be right
        raise ModelError(f"{type(reference.model).__name__}: its own forward fails on a probe sequence "
                         f"({type(exc).__name__}: {first_line(exc)})") from None


def gap(reference, oracle: Oracle) -> float:
    """The largest |Δ logprob| between klpipe's rows run whole (the probe split at two places) and the oracle."""
    ids, half = oracle.ids, len(oracle.ids) // 2
    whole, split = reference.score_batch([(ids[:1], ids[1:]), (ids[:half], ids[half:])])
    return max(float(np.max(np.abs(whole - oracle.logprobs))),
               float(np.max(np.abs(split - oracle.logprobs[half - 1:]))))


def check_head(reference, oracle: Oracle) -> None:
    """Keep the chunked head where it reproduces the oracle; else the model's own head (head.ModelHead), noted.

    Raises ModelError only where even the model's own head, run by its own forward, disagrees."""
    from klpipe.model.head import ModelHead

    name = type(reference.model).__name__
    chunked = gap(reference, oracle)
    if chunked <= reference.probe_tolerance:
        return
    reference.head = ModelHead(reference.model, reference.body, reference.device, reference.head.logits_budget)
    try:
        own = gap(reference, oracle)
    except Exception as exc:  # noqa: BLE001 - a forward that cannot take given hidden states: say which
        raise ModelError(f"{name}: its forward cannot apply its own head to given hidden states "
                         f"({type(exc).__name__}: {first_line(exc)})") from None
    if not own <= reference.probe_tolerance:
        raise ModelError(f"{name}: even the model's own head, by its own forward, disagrees with that forward "
                         f"(max |Δ logprob| = {own:.3g})")
    reference.notes.append(f"{name}: klpipe's chunked LM head disagrees with the model's own logits "
                           f"(max |Δ logprob| = {chunked:.3g}); logprobs come from the model's own head, in blocks")


def check_padding(reference, oracle: Oracle) -> None:
    """Run rows one at a time where a row's logprobs change beside a longer row's pads, noted.

    Right pads come after every real token, so a causal model's rows cannot see them, but a model may still
    read the batch's length: DeepSeek-V3.2's sparse attention picks its top-k keys with `topk` over every key
    slot, and how it breaks ties moves with the slots' count."""
    ids = oracle.ids
    longer = np.concatenate([ids, ids[::-1], ids])  # the probe's row gets twice its length in pads
    beside = reference.score_batch([(ids[:1], ids[1:]), (longer[:1], longer[1:])])[0]  # (T - 1,)
    found = float(np.max(np.abs(beside - oracle.logprobs)))
    if found <= reference.probe_tolerance:
        return
    reference.rows_alone = True
    reference.notes.append(f"{type(reference.model).__name__}: a row's logprobs change beside a longer row's pads "
                           f"(max |Δ logprob| = {found:.3g}); rows run whole one at a time")


def check_attention(reference, oracle: Oracle) -> str | None:
    """None if klpipe's attention, now installed, reproduces the oracle; else the line to log (the caller drops it)."""
    found = gap(reference, oracle)
    if found <= reference.probe_tolerance:
        return None
    return (f"{type(reference.model).__name__}: klpipe's cascade attention disagrees with the model's own "
            f"{reference.own_attention} attention (max |Δ logprob| = {found:.3g}); the model's own runs instead")
