"""bench_gpu.py's copy-stream row: what a copy stream would add to klpipe's layer-major GPU path, measured alone.

klpipe streams a reference larger than the device's memory (klpipe/model/layer_major.py) by copying each layer from
pinned host buffers on the compute's own stream: correct by the stream's order, but the copy does not overlap the
compute. A copy stream would overlap it, and a slip in its synchronisation is a silent wrong number. This row
measures that mechanism on its own, on a lent device, so the step starts from figures: a stack of Llama 3.1 70B's
decoder layers (hidden 8,192, MLP 28,672, 64 query and 8 key/value heads of 128: 1.71 GB each in bf16) whose weights
stay in pinned host memory, run layer-major over a group of passes:

    layer k      every pass through it, on the compute stream
    layer k + 1  copied host -> device meanwhile, on a copy stream, into the other of two device slots

The copy of layer k + 1 waits for the event recorded after the last pass of layer k - 1 (its slot's previous
user); the compute of layer k waits for the event recorded after its copy. Against the same stack resident on the
device, over the same group: the streamed group's seconds over the resident one's, the copy's bandwidth alone, and
the tokens a group needs to hide the copy (the issue's estimate: about 14,000 on an H200 over PCIe 5). Both runs
must give the same hidden states bit for bit: the same kernels on the same weights, so any difference is a
synchronisation slip, and the row says so.

`--dry-run` (CI, CPU): 8 layers of hidden 64, no streams, no pinning; the same code path and the same equality.
"""

from __future__ import annotations

import time

LAYERS = 4  # enough for two slots to take turns; the stack's weights are LAYERS x 1.71 GB of pinned host memory
GROUPS = (8_192, 32_768, 65_536)  # fed tokens a group holds
PASS = 8_192  # tokens a pass holds (one row of PASS tokens each: causal attention over it)


def config(dry: bool):
    from transformers import LlamaConfig

    if dry:
        return LlamaConfig(hidden_size=64, intermediate_size=224, num_attention_heads=8, num_key_value_heads=2,
                           head_dim=8, num_hidden_layers=8, vocab_size=256)
    return LlamaConfig(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                       head_dim=128, num_hidden_layers=LAYERS, vocab_size=128_256, rope_theta=500_000.0)


class Stack:
    """The layers resident on `device` (`resident`), and their weights in pinned host memory (`host`, a list of
    tensors per layer) with two device slots to copy them into (`slots`)."""

    def __init__(self, cfg, device: str):
        import torch
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        cfg._attn_implementation = "sdpa"
        self.device = device
        self.cuda = device.startswith("cuda")
        torch.manual_seed(0)
        self.resident = [self.layer(LlamaDecoderLayer, cfg, k, init=True) for k in range(cfg.num_hidden_layers)]
        self.host = [[p.detach().to("cpu").pin_memory() if self.cuda else p.detach().clone()
                      for p in layer.parameters()] for layer in self.resident]
        self.slots = [self.layer(LlamaDecoderLayer, cfg, 0, init=False) for _ in range(2)]
        self.rope = LlamaRotaryEmbedding(cfg).to(device)
        self.bytes = sum(t.numel() * t.element_size() for t in self.host[0])

    def layer(self, cls, cfg, k: int, init: bool):
        """Decoder layer `k` built on meta and allocated on the device in bf16 (a 70B layer never exists in fp32 or
        on the host twice); `init`: random weights at a trained layer's scale (outputs of a sane size), norms 1."""
        import torch

        with torch.device("meta"):
            layer = cls(cfg, k).to(torch.bfloat16)
        layer = layer.to_empty(device=self.device).requires_grad_(False)
        if init:
            with torch.no_grad():
                for p in layer.parameters():
                    p.normal_(0.0, p.shape[1] ** -0.5) if p.ndim == 2 else p.fill_(1.0)
        return layer

    def positions(self, tokens: int, hidden: int):
        import torch

        ids = torch.arange(tokens, device=self.device)[None]
        return self.rope(torch.zeros(1, tokens, hidden, device=self.device, dtype=torch.bfloat16), ids)


def _group(stack: Stack, tokens: int, hidden: int, seed: int = 1):
    import torch

    generator = torch.Generator(device="cpu").manual_seed(seed)
    passes = max(1, tokens // PASS)
    length = min(tokens, PASS)
    return [torch.randn(1, length, hidden, generator=generator).to(stack.device, torch.bfloat16)
            for _ in range(passes)]


def run_resident(stack: Stack, group: list):
    import torch

    position = stack.positions(group[0].shape[1], group[0].shape[2])
    with torch.inference_mode():
        for layer in stack.resident:
            group = [layer(h, position_embeddings=position) for h in group]
    return group


def run_streamed(stack: Stack, group: list):
    """Layer-major over `group`, each layer's weights copied into a slot on a copy stream while the one before
    computes (see the docstring); on CPU the copies are plain and in order."""
    import torch

    position = stack.positions(group[0].shape[1], group[0].shape[2])
    count = len(stack.host)
    if not stack.cuda:
        with torch.inference_mode():
            for k in range(count):
                slot = stack.slots[k % 2]
                for target, source in zip(slot.parameters(), stack.host[k], strict=True):
                    target.copy_(source)
                group = [slot(h, position_embeddings=position) for h in group]
        return group
    compute = torch.cuda.current_stream()
    copy = torch.cuda.Stream()
    copied = [torch.cuda.Event() for _ in range(count)]
    used = [torch.cuda.Event() for _ in range(count)]  # after layer k's last pass: its slot is free again

    def fetch(k: int) -> None:
        with torch.cuda.stream(copy):
            if k >= 2:
                copy.wait_event(used[k - 2])  # the slot's previous layer is done computing
            for target, source in zip(stack.slots[k % 2].parameters(), stack.host[k], strict=True):
                target.copy_(source, non_blocking=True)
            copied[k].record(copy)

    with torch.inference_mode():
        fetch(0)
        for k in range(count):
            if k + 1 < count:
                fetch(k + 1)
            compute.wait_event(copied[k])
            group = [stack.slots[k % 2](h, position_embeddings=position) for h in group]
            used[k].record(compute)
    return group


def copy_seconds(stack: Stack) -> float:
    """One layer host -> device alone (the best case of the streamed row's copies)."""
    started = time.perf_counter()
    for target, source in zip(stack.slots[0].parameters(), stack.host[0], strict=True):
        target.copy_(source, non_blocking=stack.cuda)
    _sync(stack)
    return time.perf_counter() - started


def _sync(stack: Stack) -> None:
    import torch

    if stack.cuda:
        torch.cuda.synchronize()


def timed(stack: Stack, runner, group: list) -> tuple[float, list]:
    _sync(stack)
    started = time.perf_counter()
    out = runner(stack, group)
    _sync(stack)
    return time.perf_counter() - started, out


def main(dry: bool, device: str) -> None:
    import torch

    cfg = config(dry)
    started = time.perf_counter()
    stack = Stack(cfg, device)
    how = ("host memory -> two slots, copied in order (dry run: hidden 64)" if dry else
           "pinned host memory -> two device slots on a copy stream")
    print(f"\nstreamed row: {len(stack.host)} decoder layers of Llama 3.1 70B's shape, {stack.bytes / 1e9:.2f} GB each "
          f"in bf16, {how} (built in {time.perf_counter() - started:.0f}s)", flush=True)
    copy_one = min(copy_seconds(stack) for _ in range(3))
    print(f"one layer host -> device alone: {copy_one * 1e3:.1f} ms, {stack.bytes / copy_one / 1e9:.1f} GB/s",
          flush=True)
    print(f"{'group tokens':>12}{'resident s':>12}{'streamed s':>12}{'streamed/resident':>19}{'copy/compute':>14}"
          f"{'same bits':>11}")
    for tokens in (GROUPS if not dry else (64, 256)):
        group = _group(stack, tokens, cfg.hidden_size)
        timed(stack, run_resident, group)  # warm: kernels chosen, allocator grown
        timed(stack, run_streamed, group)
        resident, expected = min((timed(stack, run_resident, group) for _ in range(2)), key=lambda r: r[0])
        streamed, got = min((timed(stack, run_streamed, group) for _ in range(2)), key=lambda r: r[0])
        same = all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        per_layer = resident / len(stack.host)
        print(f"{tokens:>12,}{resident:>12.3f}{streamed:>12.3f}{streamed / resident:>19.2f}"
              f"{copy_one / per_layer:>14.2f}{'yes' if same else 'NO':>11}", flush=True)
        if not same:
            print("streamed row: the streamed hidden states differ from the resident ones: a synchronisation slip")
        del group, expected, got
    tokens_to_hide = None
    if stack.cuda:
        group = _group(stack, GROUPS[-1], cfg.hidden_size)
        resident, _ = timed(stack, run_resident, group)
        tokens_to_hide = int(GROUPS[-1] * copy_one / (resident / len(stack.host))) + 1
        print(f"a group hides the copy from about {tokens_to_hide:,} tokens (one layer's copy over its compute, "
              f"scaled from {GROUPS[-1]:,})", flush=True)
