"""The load-time checks in order (probes.py, attention/packing_check.py, compiled.py's probe): each decides part of
the model's Verdict (verdict.py), and the model is given each decision (ReferenceModel.apply) before the next check
runs. Or, where an earlier run's verdict for the same key is remembered (storage/verdicts.py), that verdict applied
and held to the model's own forward on a short probe (probes.confirm): the checks all run again where it disagrees.

    the oracle        the probe by the model's own forward, nothing of klpipe's installed
    causal            a forward that reads later tokens runs every row by itself
    head              klpipe's chunked head, else the model's own on hidden states, else its whole forward
    padding           rows one a batch where pads move a row's logprobs
    packing           rows run whole end to end, without pads, where that reproduces the oracle
    adapters' sides   each adapter's forward held to the model's own with it on: a disagreement is refused
    compiled          --compile's norms and MLPs kept where they reproduce the oracle

A streamed model's probes, the model's own forwards and klpipe's alike, run ahead as passes of one layer-major group
(probes.prefetch, probe_group.py): each layer read once for all of them. The tree's probes (the cascade, the prefix
tree) run when a run first needs a tree (precompute/sharing.py); their decisions join the same verdict.
"""

from __future__ import annotations

import time

import numpy as np

from klpipe.errors import ModelError
from klpipe.model import compiled, failures, probes
from klpipe.model.attention import packing, packing_check
from klpipe.model.verdict import CHUNKED, OWN, Verdict


def check(reference, compile: str = "off", remembered: Verdict | None = None, compiler=None) -> None:
    """Decide `reference`'s verdict by the checks, or take `remembered` where the short probe agrees with it;
    `reference.verdict_reused` says which, `reference.recheck_why` why a remembered one was not taken (None: it was,
    or none was given), `reference.check_seconds` how long it all took."""
    started = time.perf_counter()
    reference.verdict_reused, reference.recheck_why = False, None
    try:
        if remembered is not None:
            found = _reuse(reference, remembered)
            if found is not None and found <= reference.probe_tolerance:
                reference.recheck_why = _head_given_up(reference, remembered)
                if reference.recheck_why is None:
                    reference.verdict_reused = True
                    return
            else:
                reference.recheck_why = ("its own forward fails on the short probe" if found is None else
                                         f"they disagree with its own forward on the short probe (max |Δ logprob| = "
                                         f"{found:.3g})")
            reference.apply(Verdict())
        _all(reference, compile, compiler)
    finally:
        reference.check_seconds = time.perf_counter() - started


def _reuse(reference, remembered: Verdict) -> float | None:
    """`remembered` applied, and the largest |Δ logprob| between klpipe's rows run whole and the model's own forward on
    the short probe (probes.confirm), or None where the model's own forward fails on it."""
    started = time.perf_counter()
    reference.apply(remembered)
    try:
        found = probes.confirm(reference)
    except Exception:  # noqa: BLE001 - the checks run again, and say what fails in their own words
        return None
    if reference.compiled is not None:
        reference.compile_seconds = time.perf_counter() - started  # the compiles happened in that probe
    return found


def _head_given_up(reference, remembered: Verdict) -> str | None:
    """Where `remembered` gave up klpipe's chunked head (for the model's own, or its whole forward) and the chunked
    head agrees with the model's own forward on the short probe after all, why the checks run again: a verdict
    reached once on a probe that went wrong would otherwise stay, every run slower (or refused under `on`) for it."""
    if remembered.head != OWN and remembered.own_forward != probes.NO_HEAD:
        return None
    reference.apply(remembered.but(head=CHUNKED, own_forward=None))
    try:
        found = probes.gap(reference, reference.oracle)
    except Exception:  # noqa: BLE001 - the chunked head cannot run here: the verdict stands
        found = None
    reference.apply(remembered)
    if found is None or found > reference.probe_tolerance or getattr(reference.head, "unapplied", []):
        return None
    return (f"they dropped klpipe's chunked head, which agrees with its own forward on the short probe "
            f"(max |Δ logprob| = {found:.3g})")


def _all(reference, compile: str, compiler=None) -> None:
    """Every load-time check, in order; the model left as the verdict they reach says."""
    verdict = Verdict()
    reference.apply(verdict)
    _prefetch(reference)
    try:
        reference.oracle = probes.take_oracle(reference)
        verdict = probes.check_causal(reference, verdict)
        if verdict.own_forward is not None:
            # Its own forward computes every row (score_batch): no substitute of klpipe's runs.
            verdict = verdict.but(padded_why=packing.NOT_CAUSAL)
        else:
            for step in (probes.check_head, probes.check_padding):
                verdict = step(reference, reference.oracle, verdict)
                reference.apply(verdict)
            verdict = packing_check.check(reference, verdict)
        reference.apply(verdict)
    finally:
        reference.own_memo, reference.probe_memo = {}, {}  # valid only while the checks run
    check_sides(reference)
    reference.apply(compiled_verdict(reference, compile, verdict, compiler))


def _prefetch(reference) -> None:
    """A streamed model's probes, as many as can be known before any has run, in one layer-major group: the model's
    own forwards and klpipe's rows run whole for the head, padding and packing checks (those with the default
    head: the checks apply whichever head they settle on to the hidden states kept)."""
    if reference.streamer is None:
        return
    ids = np.concatenate(probes.oracle_row(reference))
    own = reference.own_attention
    klpipe = [(probes.gap_rows(ids), None, False, own),
              (probes.padding_rows(ids, reference.rope_length_limit), None, False, own)]
    more = []
    if packing.refusal(reference) is None:
        more.append((packing.probe_row(reference), reference.head.rows))
        klpipe.append((packing_check.packed_rows(reference), None, True, packing.NAME))
    probes.prefetch(reference, more, tuple(klpipe))


def check_sides(reference) -> None:
    """Each adapter's side, held to the model's own forward with it active: klpipe's rows run whole (its chunked
    head, its packing) must give that forward's logprobs, as the default side's did."""
    if reference.adapters is None or reference.own_forward is not None:
        return
    ids = reference.oracle.ids
    for name, adapter in reference.adapters.adapters.items():
        if name == reference.adapters.default:
            continue
        with reference.side(name):  # the oracle's forward with klpipe's attention taken out, as the default side's was
            with failures.failing_in_one_line(reference.model):  # a klpipe bug (lora.py's hook) said as one
                own = reference.own_logprobs([(ids[:1], ids[1:])])[0]
            found = probes.gap(reference, probes.Oracle(ids, own))
        if found > reference.probe_tolerance:
            raise ModelError(f"{adapter.path}: klpipe's logprobs with the adapter on differ from the model's own "
                             f"forward by {found:.3g}")


def compiled_verdict(reference, mode: str, verdict: Verdict, compiler=None) -> Verdict:
    """`verdict` with what --compile `mode` keeps compiled (compiled.py): the decoder layers' norms and MLPs, where
    `mode` asks on this device and the probe (probes.check_compile) agrees with the model's own forward; noted if
    not. `compiler`: compiled.Compiled's (torch.compile with klpipe's options unless a test gives one)."""
    if reference.compiled is not None or reference.oracle is None or not compiled.wanted(mode, reference.device):
        return verdict
    name = type(reference.model).__name__
    targets = compile_targets(reference)
    devices = set(map(str, (getattr(reference.model, "hf_device_map", None) or {}).values()))
    why_not = (f"its rows run by its own forward ({reference.own_forward})" if reference.own_forward is not None
               else "it is spread over several devices" if len(devices) > 1  # accelerate's hooks move tensors
               else "no norm or MLP klpipe compiles" if not targets else None)
    if why_not is not None:
        return verdict.noted(f"{name}: runs eager, not compiled ({why_not})")
    started = time.perf_counter()
    reference.compile_modules(targets, compiler)
    verdict = probes.check_compile(reference, reference.oracle, verdict)
    reference.compile_seconds = time.perf_counter() - started
    return verdict


def compile_targets(reference) -> list:
    """What --compile compiles of `reference` (compiled.targets), less the modules an adapter hooks (they run per
    side: a hook, swapped tensors)."""
    targets = compiled.targets(reference.body)
    if reference.adapters is not None:
        adapted = {reference.model.get_submodule(path) for path in reference.adapters.module_paths}
        targets = [(n, m) for n, m in targets if not any(sub in adapted for sub in m.modules())]
    return targets
