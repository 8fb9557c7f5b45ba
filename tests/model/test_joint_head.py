"""The joint head (klpipe/model/joint_head.py, capture.py): the exact KL both ways, both entropies, both logprobs and
the reference's top-k, held to a full-softmax oracle written here: both models' full logits in fp64, by their own
forwards (fp64 all the way through: wide.py), then log_softmax over the whole vocabulary.

fp32 runs are held within the fp32 oracle's own error (the same formulas over the fp32 forwards' logits) + 1e-5, as
random tiny models are chaotic; fp64 runs within 1e-9. Each run goes through precompute's own chunk scorer (the
plan, the prefix tree or rows whole, the capture, the joint head)."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from klpipe import cache
from klpipe.model import ModelSpec, ReferenceModel, wide
from klpipe.model.head import ModelHead
from klpipe.precompute.logprobs import ForwardStats
from klpipe.precompute.scorer import ChunkScorer, Joint
from klpipe.precompute.sharing import Sharing
from tests import helpers, matrix
from tests.architectures import ARCHITECTURES, save_tiny
from tests.helpers import TINY_GEMMA, TINY_GEMMA_MM, TINY_LLAMA

TOLERANCE = 1e-5  # beyond the fp32 oracle's own error against fp64
EXACT = 1e-9  # fp64 all the way through
POLICY_GEMMA = helpers.SAMPLE / "tiny-gemma4-policy"
QUANTITIES = (cache.REF_LOGPROBS, cache.POLICY_LOGPROBS, *cache.FULL_KL_COLUMNS)


def perturbed(source: Path, directory: Path, seed: int = 1, spread: float = 0.3) -> Path:
    """A copy of checkpoint `source` with every weight matrix moved by `spread` of its own scale: a policy of the
    same architecture (the multimodal layout kept as it is)."""
    import shutil

    shutil.copytree(source, directory)
    generator = torch.Generator().manual_seed(seed)
    tensors = load_file(directory / "model.safetensors")
    for name, tensor in sorted(tensors.items()):
        if tensor.ndim >= 2 and tensor.is_floating_point():
            tensors[name] = tensor + torch.randn(tensor.shape, generator=generator) * tensor.float().std() * spread
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def full_oracle(ref, policy, rows, temperature: float) -> dict[str, list[np.ndarray]]:
    """Per row, each quantity from both models' full logits (the models as given: fp64 under wide.fp64, or fp32)."""
    out = {name: [] for name in (*QUANTITIES, "logq")}
    for prompt, response in rows:
        ids = torch.tensor([list(prompt) + list(response)])
        n = len(response)
        with torch.no_grad():
            a = policy(input_ids=ids).logits[0, len(prompt) - 1:len(prompt) - 1 + n].double() / temperature
            b = ref(input_ids=ids).logits[0, len(prompt) - 1:len(prompt) - 1 + n].double() / temperature
        logp, logq = a.log_softmax(-1), b.log_softmax(-1)
        p, q = logp.exp(), logq.exp()
        at = torch.arange(n), torch.as_tensor(np.asarray(response, dtype=np.int64))
        found = {cache.REF_LOGPROBS: logq[at], cache.POLICY_LOGPROBS: logp[at],
                 cache.KL_POLICY_REF: (p * (logp - logq)).sum(-1), cache.KL_REF_POLICY: (q * (logq - logp)).sum(-1),
                 cache.POLICY_ENTROPY: -(p * logp).sum(-1), cache.REF_ENTROPY: -(q * logq).sum(-1), "logq": logq}
        for name, values in found.items():
            out[name].append(values.numpy())
    return out


class Oracle:
    """The fp64 oracle of a (reference, policy) pair of transformers models, and the fp32 one's own error."""

    def __init__(self, ref, policy):
        self.fp32 = copy.deepcopy(ref), copy.deepcopy(policy)
        self.fp64 = tuple(_fp64(m) for m in self.fp32)

    def expected(self, rows, temperature: float):
        with wide.fp64():
            exact = full_oracle(*self.fp64, rows, temperature)
        naive = full_oracle(*self.fp32, rows, temperature)
        own = {name: _worst(naive[name], exact[name]) for name in QUANTITIES}
        return exact, own


def _fp64(model):
    model = copy.deepcopy(model).to(torch.float64)
    if model._can_set_experts_implementation():
        model.set_experts_implementation("eager")  # the grouped-matmul kernels take no fp64
    return model


def _worst(got: list[np.ndarray], expected: list[np.ndarray]) -> float:
    return max((float(np.max(np.abs(np.asarray(a, np.float64) - b))) for a, b in zip(got, expected, strict=True)
                if len(b)), default=0.0)


def run(ref: ReferenceModel, policy: ReferenceModel, rows, temperature: float, sharing: str, topk: int = 0,
        side: str | None = None, exact: bool = True):
    """precompute's chunk scorer over `rows` (one chunk): its Scored."""
    own = policy if policy is not ref else None
    kept = Sharing(ref, sharing, 64, print, sides=(side,) if policy is ref else ())
    policy_kept = Sharing(own, sharing, 64, print) if own is not None else None
    scorer = ChunkScorer(ref, policy, side, kept, policy_kept, temperature, 48, Joint(exact, topk))
    return scorer.score(rows, None, scorer.plan_ahead(rows, None), ForwardStats())


def assert_at_oracle(scored, exact, own, bound: float = TOLERANCE) -> dict[str, float]:
    columns = {cache.REF_LOGPROBS: scored.ref_logprobs, cache.POLICY_LOGPROBS: scored.policy_logprobs,
               **{name: scored.extra[name] for name in cache.FULL_KL_COLUMNS}}
    gaps = {}
    for name, got in columns.items():
        gaps[name] = _worst(got, exact[name])
        assert gaps[name] <= own[name] + bound, (name, gaps[name], own[name])
    for name in (cache.KL_POLICY_REF, cache.KL_REF_POLICY):  # never negative: the joint head clamps rounding at 0
        assert min(float(np.min(v)) for v in scored.extra[name] if len(v)) >= -1e-6
    return gaps


def load(directory: Path, dtype: str = "float32", **kwargs) -> ReferenceModel:
    return ReferenceModel.load(ModelSpec(str(directory), dtype=dtype, device="cpu"), **kwargs)


@pytest.fixture(scope="module")
def gemma():
    ref, policy = load(TINY_GEMMA), load(POLICY_GEMMA)
    return ref, policy, Oracle(ref.model, policy.model)


@pytest.mark.parametrize("sharing", ["on", "off"])
@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_gemma4_at_the_full_softmax_oracle(gemma, sharing, temperature):
    ref, policy, oracle = gemma
    rows = helpers.agent_rows(ref.vocab_size, seed=3)[:12]
    exact, own = oracle.expected(rows, temperature)
    assert_at_oracle(run(ref, policy, rows, temperature, sharing), exact, own)
    mean_kl = np.mean(np.concatenate(exact[cache.KL_POLICY_REF]))
    assert mean_kl > 0.01  # the policy is another model: a KL of 0 everywhere would prove nothing


def test_the_joint_heads_logprobs_are_the_heads_own(gemma):
    # With and without the exact KL, the reference's and the policy's logprobs are the same numbers (the joint head
    # makes them from the same blocks, in the same order, as each model's own head).
    ref, policy, _ = gemma
    rows = helpers.agent_rows(ref.vocab_size, seed=4)[:10]
    joint, plain = run(ref, policy, rows, 1.0, "on"), run(ref, policy, rows, 1.0, "on", exact=False)
    assert _worst(joint.ref_logprobs, plain.ref_logprobs) <= 1e-6
    assert _worst(joint.policy_logprobs, plain.policy_logprobs) <= 1e-6
    assert not plain.extra


def test_the_hubs_multimodal_gemma4_at_the_oracle(tmp_path):
    ref, policy = load(TINY_GEMMA_MM), load(perturbed(TINY_GEMMA_MM, tmp_path / "policy"))
    rows = helpers.agent_rows(ref.vocab_size, seed=5)[:10]
    exact, own = Oracle(ref.model, policy.model).expected(rows, 1.0)
    assert_at_oracle(run(ref, policy, rows, 1.0, "auto"), exact, own)


# The rest of the architecture matrix (tests/architectures.py), in make test-arch.
REST = [pytest.param(name, marks=pytest.mark.arch) for name in sorted(ARCHITECTURES)
        if name not in ("llama", "qwen3_5", "llama4", "nemotron_h")]


@pytest.mark.parametrize("name", ["llama", "qwen3_5", "llama4", "nemotron_h", *REST])
def test_families_at_the_oracle(tmp_path, name):
    # Llama, a Gated DeltaNet hybrid, a MoE (Llama 4: chunked attention, NoPE), a Mamba-2 hybrid: each a policy of
    # its own beside a reference of the same family.
    ref, policy = load(save_tiny(name, tmp_path / "ref")), load(save_tiny(name, tmp_path / "policy", seed=1))
    rows = helpers.agent_rows(ref.vocab_size, seed=6, window=16, system=37, low=3)[:10]
    oracle = Oracle(ref.model, policy.model)
    for sharing in ("on", "off"):
        exact, own = oracle.expected(rows, 1.0)
        assert_at_oracle(run(ref, policy, rows, 1.0, sharing), exact, own)


def test_a_models_own_head_dorys_logit_scale(tmp_path):
    # Dory's learned per-token logit scale: klpipe's head does not apply it, so the model's own head runs (ModelHead),
    # on both sides, whole rows of logits a block at a time.
    ref, policy = load(matrix.save_tiny("dory", tmp_path / "ref")), load(matrix.save_tiny("dory", tmp_path / "p", 1))
    assert isinstance(ref.head, ModelHead) and isinstance(policy.head, ModelHead)
    rows = matrix.agent_rows(ref.vocab_size)[:8]
    exact, own = Oracle(ref.model, policy.model).expected(rows, 0.7)
    assert_at_oracle(run(ref, policy, rows, 0.7, "off"), exact, own)


def test_the_reference_top_k(gemma):
    ref, policy, oracle = gemma
    rows = helpers.agent_rows(ref.vocab_size, seed=7)[:8]
    k = 16
    scored = run(ref, policy, rows, 0.7, "on", topk=k)
    exact, own = oracle.expected(rows, 0.7)
    compared = 0
    for ids, logprobs, logq in zip(scored.extra[cache.REF_TOPK_IDS], scored.extra[cache.REF_TOPK_LOGPROBS],
                                   exact["logq"], strict=True):
        values, order = torch.from_numpy(logq).topk(k + 1, dim=-1)
        for j in range(len(logq)):
            assert np.all(np.diff(logprobs[j]) <= 0)  # most likely first
            assert np.max(np.abs(logprobs[j] - logq[j][ids[j]])) <= own[cache.REF_LOGPROBS] + TOLERANCE
            gaps = (values[j, :-1] - values[j, 1:]).numpy()
            if gaps.min() > 1e-5:  # no near tie anywhere in the top k + 1: the order itself is determined
                assert ids[j].tolist() == order[j, :k].tolist()
                compared += 1
    assert compared > 20


def test_the_top_k_alone_needs_no_policy(gemma):
    ref, _, oracle = gemma
    rows = helpers.agent_rows(ref.vocab_size, seed=8)[:6]
    kept = Sharing(ref, "on", 64, print)
    scorer = ChunkScorer(ref, None, None, kept, None, 1.0, 48, Joint(False, 4))
    scored = scorer.score(rows, None, scorer.plan_ahead(rows, None), ForwardStats())
    exact, own = oracle.expected(rows, 1.0)
    assert scored.policy_logprobs is None and set(scored.extra) == {cache.REF_TOPK_IDS, cache.REF_TOPK_LOGPROBS}
    assert _worst(scored.ref_logprobs, exact[cache.REF_LOGPROBS]) <= own[cache.REF_LOGPROBS] + TOLERANCE


def test_the_exact_kl_is_the_mean_of_k1_over_tokens_sampled_from_the_policy(gemma):
    # At one position (one prompt), tokens drawn from π: the mean of k1 = log π(x) − log π_ref(x) over them estimates
    # KL(π‖π_ref), which every row reports exactly; they agree within the mean's standard error.
    ref, policy, oracle = gemma
    prompt = np.random.default_rng(0).integers(3, ref.vocab_size, 20)
    with torch.no_grad(), wide.fp64():
        logits = oracle.fp64[1](input_ids=torch.tensor([prompt.tolist()])).logits[0, -1]
    p = torch.softmax(logits, -1).numpy()
    draws = np.random.default_rng(1).choice(len(p), size=1000, p=p / p.sum())
    rows = [(prompt, np.array([x])) for x in draws]
    scored = run(ref, policy, rows, 1.0, "on")
    k1 = np.concatenate(scored.policy_logprobs) - np.concatenate(scored.ref_logprobs)
    kl = np.concatenate(scored.extra[cache.KL_POLICY_REF])
    assert np.ptp(kl) < 1e-5  # one position: one exact KL
    error = k1.std(ddof=1) / np.sqrt(len(k1))
    assert abs(k1.mean() - kl[0]) < 4 * error
    reverse = np.concatenate(scored.extra[cache.KL_REF_POLICY])[0]
    assert abs(k1.mean() - reverse) > 4 * error  # the test tells the two directions apart


@pytest.mark.parametrize("name", ["llama", "gemma4"])
def test_fp64_within_1e9(tmp_path, name):
    source = TINY_LLAMA if name == "llama" else TINY_GEMMA
    policy_source = perturbed(TINY_LLAMA, tmp_path / "policy") if name == "llama" else POLICY_GEMMA
    ref, policy = load(source, "float64"), load(policy_source, "float64")
    rows = helpers.agent_rows(ref.vocab_size, seed=9)[:8]
    with wide.fp64():
        exact = full_oracle(ref.model, policy.model, rows, 0.7)
    for sharing in ("on", "off"):
        scored = run(ref, policy, rows, 0.7, sharing, topk=4)
        assert_at_oracle(scored, exact, dict.fromkeys(QUANTITIES, 0.0), EXACT)
