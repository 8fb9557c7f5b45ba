"""The fused head (klpipe/model/head.py): matmul, logit transforms, temperature, an online log-sum-exp and the
target's logit over vocabulary blocks, held to a naive fp64 log_softmax written here; and the bytes it moves."""

import numpy as np
import pytest
import torch

from klpipe.model.head import HeadBlocks, LMHead


class _Config:
    def __init__(self, **fields):
        self.__dict__.update(fields)


class _Model(torch.nn.Module):
    def __init__(self, vocab, hidden, dtype, bias):
        super().__init__()
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=bias, dtype=dtype)
        with torch.no_grad():
            self.lm_head.weight.normal_(0, 1.5)

    def get_output_embeddings(self):
        return self.lm_head


def naive(weight, bias, hidden, targets, rows, multiplier, softcap, temperature) -> np.ndarray:
    """log_softmax of the whole (N, V) logits in fp64, numpy: the oracle."""
    w, h = weight.double().numpy(), hidden.double().numpy()
    logits = h @ w.T + (0.0 if bias is None else bias.double().numpy())
    logits = logits * multiplier
    if softcap:
        logits = softcap * np.tanh(logits / softcap)
    logits = logits / temperature
    top = logits.max(axis=1, keepdims=True)
    lse = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
    return logits[rows, targets] - lse[rows]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap, multiplier, temperature, bias", [
    (None, 1.0, 1.0, False), (30.0, 1.0, 0.7, False), (None, 0.0625, 1.3, True), (5.0, 2.0, 1.0, True)])
def test_the_fused_head_is_log_softmax_of_the_whole_logits(dtype, softcap, multiplier, temperature, bias):
    torch.manual_seed(0)
    vocab, width, n = 1000, 24, 37
    model = _Model(vocab, width, dtype, bias)
    config = _Config(final_logit_softcapping=softcap, logit_scale=multiplier)
    head = LMHead(model, config, "cpu")
    head.blocks = HeadBlocks(rows=8, vocab=256)  # 5 row blocks, 4 vocabulary blocks, the last ones short
    hidden = torch.randn(n, width).to(dtype)
    rows = torch.tensor([0, 3, 3, 3, 36, 17, 8, 9, 0])  # several targets read one hidden state; unordered
    targets = torch.tensor([0, 999, 5, 255, 256, 511, 512, 768, 998])  # both ends of every block
    got = head.logprobs(hidden, targets, temperature, rows=rows)
    assert got.dtype == torch.float32 and got.device.type == "cpu"
    expected = naive(model.lm_head.weight.detach(), None if not bias else model.lm_head.bias.detach(), hidden,
                     targets.numpy(), rows.numpy(), multiplier, softcap, temperature)
    assert np.abs(expected).max() > 1.0  # logprobs spread over nats: a wrong lse or target would show
    # bf16 weights and hidden states are exact in fp32 and the head accumulates in fp32: fp32 rounding only.
    assert np.max(np.abs(got.numpy() - expected)) <= 1e-4
    # One target per hidden state (rows=None), against the row-blocked head.
    everyone = torch.randint(0, vocab, (n,))
    fused = head.logprobs(hidden, everyone, temperature)
    expected = naive(model.lm_head.weight.detach(), None if not bias else model.lm_head.bias.detach(), hidden,
                     everyone.numpy(), np.arange(n), multiplier, softcap, temperature)
    assert np.max(np.abs(fused.numpy() - expected)) <= 1e-4
    head.fused = False
    if dtype == torch.float32:
        assert np.max(np.abs(head.logprobs(hidden, everyone, temperature).numpy() - expected)) <= 1e-4


def test_the_fused_head_never_makes_a_block_wider_than_its_vocabulary_block(monkeypatch):
    from klpipe.model import head as module

    shapes = []
    right = module._fp32_matmul
    monkeypatch.setattr(module, "_fp32_matmul",
                        lambda h, w, b: shapes.append((h.shape[0], w.shape[0])) or right(h, w, b))
    model = _Model(1000, 16, torch.float32, False)
    head = LMHead(model, _Config(), "cpu")
    head.blocks = HeadBlocks(rows=10, vocab=256)
    head.logprobs(torch.randn(25, 16), torch.randint(0, 1000, (25,)))
    assert shapes == [(r, v) for r in (10, 10, 5) for v in (256, 256, 256, 232)]


def test_head_blocks_for_e2b_and_the_bytes_per_scored_token():
    blocks = HeadBlocks.for_device(262_144, "cuda")
    assert blocks.rows * blocks.vocab * 4 <= 32 << 20 and blocks.vocab % 256 == 0
    figures = blocks.bytes_per_token(8192, 262_144, 1536)
    # Written out: the minimum reads the weight once for 8,192 tokens; the head once per 4,096-row block; hidden
    # states once per vocabulary block, and the target's hidden state and weight row once.
    assert figures["minimum"] == 262_144 * 1536 * 2 / 8192 + 4
    assert figures["weight"] == 262_144 * 1536 * 2 / 4096
    assert figures["hidden"] == 1536 * 2 * (262_144 // blocks.vocab) + 2 * 1536 * 2
    assert blocks == HeadBlocks(4096, 2048)
    cpu = HeadBlocks.for_device(262_144, "cpu")
    assert cpu == HeadBlocks(1024, 4096)
