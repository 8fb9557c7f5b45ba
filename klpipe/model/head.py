"""The LM head applied to selected hidden states only, fused over vocabulary blocks, with an fp32 log-sum-exp.

Gemma 4's vocabulary is 262,144: full logits for one 8×2048 batch would be 17 GB of fp32, and
their log_softmax as much again. Only the positions that predict a response token reach the
head, and LMHead never makes their (n, V) logits: one pass over the vocabulary in blocks of
columns does, for each block, the matmul, the model's logit transforms (multiplier, softcap),
the temperature and an online log-sum-exp (a running max and a rescaled running sum per row, in
fp32), so the largest tensor is one (rows, vocabulary block) block. The target's logit is one dot
product per target, of its hidden state and its row of the weight, in fp32, transformed alike; no
gather reads a block. Liger's fused linear cross-entropy is the model (it takes a softcap too);
this one is pure torch and runs the same on CPU and CUDA. The matmul accumulates in fp32 and
hands back fp32 where it can (`_fp32_matmul`): bf16 logits would round a logit of 20 by 0.06.

The only host sync of a call is the final copy of the (M,) logprobs to the host (non-blocking
into pinned memory on CUDA): no `.item()`, `.tolist()` or shape that depends on values.

LMHead applies the head's weight and the logit transforms klpipe knows (scale, softcap) itself;
ModelHead runs the model's own forward after the body, for a model whose forward does more. The
load-time check (probes.py) keeps LMHead only where it reproduces the model's own logits.
`blocked_logprobs` is a row-blocked head (whole rows of logits, then logsumexp), for
ModelHead, which can only make whole rows, and measured against the fused head in
benchmarks/bench_head.py.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from klpipe.errors import ModelError
from klpipe.model.transfer import to_host

if TYPE_CHECKING:
    from klpipe.model.streamed_head import HeadRows

# Logit values in one block: 2^27 (512 MiB of fp32) on CUDA by default; on CPU 2^22 (16 MiB) where
# that still gives 256 rows, and never more than 2^24 (64 MiB). The row-blocked head's sizes.
GPU_LOGITS = 1 << 27
CPU_LOGITS_CACHED = 1 << 22
CPU_LOGITS_MAX = 1 << 24
# The fused head's block: (rows, vocabulary columns). On CUDA 2^23 fp32 values (32 MiB) stay in an H100/H200's
# 50-60 MB L2 between the matmul that writes them and the passes that read them; rows up to 4,096 read the
# weight once per 4,096 scored tokens, near where its re-reads and the hidden states' (once per vocabulary
# block) cost the same bytes. On CPU 2^22 (16 MiB, a typical L3), rows up to 1,024.
FUSED_GPU_BLOCK = 1 << 23
FUSED_GPU_ROWS = 4096
FUSED_CPU_BLOCK = 1 << 22
FUSED_CPU_ROWS = 1024
VOCAB_ALIGN = 256  # vocabulary blocks a multiple of this: whole tiles for the matmul


@dataclass(frozen=True)
class HeadBlocks:
    """How the fused head cuts an (n, V) problem: `rows` hidden states at a time, `vocab` columns at a time."""

    rows: int
    vocab: int

    @staticmethod
    def for_device(vocab_size: int, device: str, logits_budget: int | None = None) -> HeadBlocks:
        on_gpu = str(device).startswith("cuda")
        budget = logits_budget or (FUSED_GPU_BLOCK if on_gpu else FUSED_CPU_BLOCK)
        rows = min(FUSED_GPU_ROWS if on_gpu else FUSED_CPU_ROWS, max(1, budget // VOCAB_ALIGN))
        vocab = max(VOCAB_ALIGN, (budget // rows) // VOCAB_ALIGN * VOCAB_ALIGN)
        return HeadBlocks(rows, min(vocab, vocab_size))

    def bytes_per_token(self, n: int, vocab_size: int, hidden_size: int, weight_bytes: int = 2,
                        block_passes: int = 5) -> dict[str, float]:
        """Bytes the fused head reads and writes per scored token, for a call on `n` tokens, beside the minimum.

        `weight`: the head's weight, read once per row block; `hidden`: each row block's hidden states, read once
        per vocabulary block; `out`: one fp32 logprob; `block`: the fp32 (rows, vocab) block's passes (the matmul
        writes it, the transform rewrites it, the max reads it, exp rewrites it, the sum reads it: `block_passes`
        full reads or writes), which stay in the L2 (CUDA) or L3 (CPU) when the block fits it.
        `minimum`: the weight's share (read once for all n tokens) and one fp32 out."""
        row_blocks = -(-n // self.rows)
        vocab_blocks = -(-vocab_size // self.vocab)
        weight = vocab_size * hidden_size * weight_bytes * row_blocks / n
        hidden = hidden_size * weight_bytes * vocab_blocks
        target = 2 * hidden_size * weight_bytes  # the target's hidden state and row of the weight, once
        block = block_passes * 4.0 * vocab_size
        return {"weight": weight, "hidden": hidden + target, "out": 4.0, "block": block,
                "memory": weight + hidden + target + 4.0,
                "minimum": vocab_size * hidden_size * weight_bytes / n + 4.0}


@dataclass(frozen=True)
class HeadView:
    """One head's weight, bias and logit transforms, fixed: what a vocabulary block of its logits is made of. Held
    apart from LMHead so that two sides' heads (the reference's and an adapter policy's modules_to_save, one module)
    can be applied side by side (joint_head.py)."""

    weight: torch.Tensor  # (V, H)
    bias: torch.Tensor | None  # (V,)
    multiplier: float  # Cohere's logit_scale, over Granite's logits_scaling
    softcap: float | None  # Gemma 2/3/4's final_logit_softcapping

    def transform(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """The model's logit transforms and the temperature, in place on fp32 `logits` (any shape)."""
        scale = self.multiplier
        if self.softcap:
            # c · tanh(m·z / c) / T: the multiplier and 1/c in one pass, c/T in another.
            logits.mul_(scale / self.softcap).tanh_().mul_(self.softcap / temperature)
        elif scale / temperature != 1.0:
            logits.mul_(scale / temperature)
        return logits

    def block(self, hidden: torch.Tensor, start: int, stop: int, temperature: float,
              weight: torch.Tensor | None = None) -> torch.Tensor:
        """(n, stop - start) fp32 transformed logits of vocabulary block [start, stop), accumulated in fp32; `weight`:
        those rows of the weight where they were read from elsewhere (a streamed head's block)."""
        bias = None if self.bias is None else self.bias[start:stop]
        rows = self.weight[start:stop] if weight is None else weight
        return self.transform(_fp32_matmul(hidden, rows, bias), temperature)

    def targets(self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                weight_rows: torch.Tensor | None = None) -> torch.Tensor:
        """(M,) fp32 transformed logits of each (hidden state, target) pair: one fp32 dot product each; `weight_rows`:
        the targets' rows of the weight where they were read from elsewhere."""
        rows = (self.weight[targets] if weight_rows is None else weight_rows).float()  # (M, H)
        logits = torch.einsum("mh,mh->m", hidden.float(), rows)
        if self.bias is not None:
            logits += self.bias[targets].float()
        return self.transform(logits, temperature)


class LMHead:
    """A causal LM's own output layer and logit transforms, as logprobs of chosen targets."""

    def __init__(self, model, text_config, device: str, logits_budget: int | None = None,
                 fused: bool | None = None):
        head = model.get_output_embeddings()
        if head is None or not hasattr(head, "weight"):
            raise ModelError(f"{type(model).__name__} has no linear LM head klpipe can apply in chunks")
        self.module = head  # its weight read at each call: an adapter's modules_to_save swaps it per side (lora.py)
        # Parameters of a head whose forward does more than its weight and bias (Dory's learned per-token logit
        # scale): this head does not apply them, so the load-time check gives such a model its own (probes.py).
        self.unapplied = sorted({name for name, _ in head.named_parameters()} - {"weight", "bias"})
        # Everything the model does to its logits after the head, in the model's own order.
        self.logit_multiplier = float(getattr(text_config, "logit_scale", None) or 1.0)  # Cohere
        divisor = getattr(text_config, "logits_scaling", None)  # Granite
        if divisor:
            self.logit_multiplier /= float(divisor)
        self.softcap = getattr(text_config, "final_logit_softcapping", None)  # Gemma 2/3/4
        self.vocab_size = self.weight.shape[0]
        self.logits_budget = logits_budget
        self.rows = self.rows_for(self.vocab_size, device, logits_budget)
        self.blocks = HeadBlocks.for_device(self.vocab_size, device, logits_budget)
        # The fused head everywhere by default: on CPU it measured no slower than the row-blocked one
        # (benchmarks/bench_head.py, docs/benchmarks.md); `fused=False` keeps the row-blocked head.
        self.fused = True if fused is None else fused
        self.streamed: HeadRows | None = None  # a streamed model's head left in its file, as loaded

    @property
    def weight(self) -> torch.Tensor:
        return self.module.weight  # (V, H)

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self.module, "bias", None)

    @staticmethod
    def rows_for(vocab_size: int, device: str, logits_budget: int | None) -> int:
        """Rows of the row-blocked head applied at once: bounds the (rows, V) fp32 logits block."""
        if logits_budget is None and not device.startswith("cuda"):
            # CPU: a 16 MiB block stays in a typical L3 cache, where the logsumexp runs ~25% faster
            # than over 64 MiB (vocabulary 8k, `make bench`); but under 256 rows a block re-reads
            # the head's weight for too few rows. Never over 64 MiB.
            return max(1, min(CPU_LOGITS_MAX // vocab_size, max(CPU_LOGITS_CACHED // vocab_size, 256)))
        return max(1, (logits_budget or GPU_LOGITS) // vocab_size)

    @torch.inference_mode()
    def logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                 rows: torch.Tensor | None = None) -> torch.Tensor:
        """log p(targets[i] | hidden[rows[i]]) as float32 on the CPU: (N, H), (M,), rows (M,) → (M,).

        `rows` defaults to 0..N-1 (one target per hidden state). Several targets may read one hidden
        state: where rows of a chunk part ways, one position predicts a different token for each, and
        its log-sum-exp is computed once. The naive equivalent, which this never materialises:

            logits = model.lm_head(hidden).float()              # (N, V)
            logits = softcap · tanh(logits / softcap) / temperature
            torch.log_softmax(logits, -1)[rows, targets]
        """
        if self.streamed is not None and self.module.weight is self.streamed.meta:  # not an adapter's head, active
            return streamed_logprobs(self, hidden, targets, temperature, rows)
        if not self.fused:
            return blocked_logprobs(self._logits, self.rows, self.weight.device, hidden, targets, temperature, rows)
        return fused_logprobs(self, hidden, targets, temperature, rows)

    def view(self) -> HeadView:
        """The head as it stands now: the weight in place (an adapter's where its side is active) and its transforms."""
        return HeadView(self.weight, self.bias, self.logit_multiplier, self.softcap)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, V) fp32 logits of (n, H) hidden states, transformed as the model does (the row-blocked head)."""
        logits = F.linear(hidden, self.weight, self.bias).float()  # (n, V), fp32 from here
        # In place: a (n, V) block is the largest tensor klpipe makes; no need for four of them.
        if self.logit_multiplier != 1.0:
            logits.mul_(self.logit_multiplier)
        if self.softcap:
            logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits


_OUT_DTYPE: dict[str, bool] = {}  # device type -> whether torch.mm takes out_dtype=float32 for bf16/fp16 there


def _fp32_matmul(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """hidden (n, H) @ weight (v, H)ᵀ + bias as fp32, accumulated in fp32: (n, v).

    bf16 and fp16 products are exact in fp32 and the sum accumulates in fp32; on CUDA torch.mm's out_dtype hands
    the fp32 accumulator back unrounded at bf16 tensor-core speed. Where torch has no such kernel (CPU), the
    block of the weight is widened to fp32 first: the same values and the same fp32 sum."""
    if hidden.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.linear(hidden, weight, bias)
    kind = hidden.device.type
    if kind == "cuda" and _OUT_DTYPE.get(kind, True) and hidden.dtype == weight.dtype:
        try:
            out = torch.mm(hidden, weight.t(), out_dtype=torch.float32)
            _OUT_DTYPE[kind] = True
            return out if bias is None else out.add_(bias.float())
        except (TypeError, RuntimeError):
            _OUT_DTYPE[kind] = False
    return F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())


def fused_logprobs(head: LMHead, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                   rows: torch.Tensor | None) -> torch.Tensor:
    """LMHead.logprobs, fused over vocabulary blocks: log-sum-exp online, the target's logit by a dot product."""
    device = head.weight.device
    hidden = hidden.to(device, non_blocking=True)  # (N, H)
    targets = targets.to(device, non_blocking=True)  # (M,)
    n = hidden.shape[0]
    lse = torch.empty(n, dtype=torch.float32, device=device)  # (N,) each hidden state's log-sum-exp
    if hidden.dtype != head.weight.dtype and hidden.dtype.is_floating_point:
        hidden = hidden.to(head.weight.dtype)
    if not hidden.is_cuda and hidden.dtype != torch.float32:
        hidden = hidden.float()  # CPU: widened once for every vocabulary block (_fp32_matmul would each time)
    blocks, vocab, view = head.blocks, head.vocab_size, head.view()
    for start in range(0, n, blocks.rows):
        part = hidden[start:start + blocks.rows]  # (r, H)
        best = torch.full((part.shape[0],), -torch.inf, dtype=torch.float32, device=device)  # (r,) running max
        total = torch.zeros(part.shape[0], dtype=torch.float32, device=device)  # (r,) Σ exp(z - best)
        for low in range(0, vocab, blocks.vocab):
            logits = view.block(part, low, min(low + blocks.vocab, vocab), temperature)  # (r, v) fp32
            new_best = torch.maximum(best, logits.amax(dim=1))
            total.mul_(torch.exp(best - new_best))  # rescale what was summed under the old max (0 at first)
            total.add_(logits.sub_(new_best[:, None]).exp_().sum(dim=1))
            best = new_best
        lse[start:start + part.shape[0]] = best + torch.log(total)
    index: slice | torch.Tensor
    if rows is None:
        picked, index = hidden, slice(None)
    else:
        index = rows.to(device, non_blocking=True)
        picked = hidden[index]  # (M, H)
    out = view.targets(picked, targets, temperature) - lse[index]  # (M,)
    return to_host(out)


def streamed_logprobs(head: LMHead, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                      rows: torch.Tensor | None) -> torch.Tensor:
    """fused_logprobs with the head's weight read from its file a block of rows at a time (streamed_head.py): each block
    once, its columns in the fused head's vocabulary blocks, so that every row's online log-sum-exp takes the same
    steps in the same order as in memory; each target's logit off the block that holds its row."""
    if hidden.dtype != head.weight.dtype and hidden.dtype.is_floating_point:  # as fused_logprobs rounds it
        hidden = hidden.to(head.weight.dtype)
    hidden = hidden.float() if hidden.dtype != torch.float32 else hidden  # CPU only (layer_major.py), as fused widens
    n, blocks, width = hidden.shape[0], head.blocks, head.blocks.vocab
    rows = torch.arange(n) if rows is None else rows.cpu()
    targets = targets.cpu()
    if len(targets) and not 0 <= int(targets.min()) <= int(targets.max()) < head.vocab_size:
        # In memory the weight's indexing refuses it; here no block would hold its row.
        raise IndexError(f"a target token outside the vocabulary of {head.vocab_size}")
    best = torch.full((n,), -torch.inf, dtype=torch.float32)  # (N,) running max
    total = torch.zeros(n, dtype=torch.float32)  # (N,) Σ exp(z - best)
    target_logits = torch.full((targets.shape[0],), torch.nan, dtype=torch.float32)  # (M,) each set by its block
    view = head.view()
    assert head.streamed is not None, "LMHead.logprobs streams only a head left in its file"
    for low, block in head.streamed.blocks(hidden.device, multiple=width):  # (r, H) rows low .. low + r - 1
        for sub in range(0, block.shape[0], width):
            part_weight = block[sub:sub + width]
            start_col = low + sub
            for start in range(0, n, blocks.rows):
                part = hidden[start:start + blocks.rows]  # (r, H)
                logits = view.block(part, start_col, start_col + part_weight.shape[0], temperature,
                                    part_weight)  # (r, v) fp32
                end = start + part.shape[0]
                new_best = torch.maximum(best[start:end], logits.amax(dim=1))
                total[start:end].mul_(torch.exp(best[start:end] - new_best))
                total[start:end].add_(logits.sub_(new_best[:, None]).exp_().sum(dim=1))
                best[start:end] = new_best
        inside = torch.nonzero((targets >= low) & (targets < low + block.shape[0])).flatten()  # (m,)
        if len(inside):  # the targets' rows of the weight, off this block
            target_logits[inside] = view.targets(hidden[rows[inside]], targets[inside], temperature,
                                                 block[targets[inside] - low])
    return target_logits - (best + torch.log(total))[rows]


class ModelHead:
    """The model's own head and final transformation, run by its own forward on hidden states klpipe computed.

    For a model whose forward does to its logits what LMHead does not know (RecurrentGemma caps them through
    `logits_soft_cap`): the causal LM's forward runs with its decoder body standing in as the block's hidden
    states (`_GivenHidden`), so its `lm_head`, its `logits_to_keep` slice and whatever follows are the model's
    own code. Slower than LMHead (the logits come back whole for the block, in the model's dtype), and as
    bounded: one (rows, V) block at a time.
    """

    def __init__(self, model, body, device: str, logits_budget: int | None = None):
        from klpipe.model.architecture import module_path

        self.model = model
        self.parent, _, self.attribute = module_path(model, body).rpartition(".")
        self.parent = model.get_submodule(self.parent) if self.parent else model
        self.body = body
        weight = model.get_output_embeddings().weight
        self.device = weight.device
        self.vocab_size = int(weight.shape[0])
        self.rows = LMHead.rows_for(self.vocab_size, device, logits_budget)
        self.lock = threading.Lock()  # the body is swapped out while the forward runs

    def logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                 rows: torch.Tensor | None = None) -> torch.Tensor:
        """As LMHead.logprobs, with the model's own forward after the body."""
        return blocked_logprobs(self._logits, self.rows, self.device, hidden, targets, temperature, rows)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[0]
        ids = torch.zeros((1, n), dtype=torch.long, device=self.device)  # read by nobody: the body stands aside
        with self.lock:
            setattr(self.parent, self.attribute, _GivenHidden(hidden[None]))
            try:
                logits = self.model(input_ids=ids, use_cache=False, logits_to_keep=0).logits  # (1, n, V)
            finally:
                setattr(self.parent, self.attribute, self.body)
        return logits[0].float()


class _GivenHidden(torch.nn.Module):
    """A decoder body that returns the hidden states it was given: (1, n, H)."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden

    def forward(self, *args, **kwargs):
        from transformers.modeling_outputs import BaseModelOutputWithPast

        return BaseModelOutputWithPast(last_hidden_state=self.hidden)


def blocked_logprobs(logits_of, block_rows: int, device, hidden: torch.Tensor, targets: torch.Tensor,
                     temperature: float, rows: torch.Tensor | None) -> torch.Tensor:
    """log p(targets[i] | hidden[rows[i]]), `logits_of` (n, H) → (n, V) fp32 applied `block_rows` at a time."""
    # Which targets read which block is planned on the host, from host indices: no sync on the device.
    rows = torch.arange(hidden.shape[0]) if rows is None else rows.cpu()
    order = torch.argsort(rows, stable=True)  # targets grouped by the block of hidden states they read
    bounds = torch.searchsorted(rows[order], torch.arange(0, hidden.shape[0] + block_rows, block_rows)).tolist()
    hidden = hidden.to(device, non_blocking=True)
    targets = targets.to(device, non_blocking=True)
    rows, order = rows.to(device, non_blocking=True), order.to(device, non_blocking=True)
    out = torch.empty(targets.shape[0], dtype=torch.float32, device=device)
    for block, start in enumerate(range(0, hidden.shape[0], block_rows)):
        logits = logits_of(hidden[start:start + block_rows])  # (n, V) fp32
        if temperature != 1.0:
            logits.div_(temperature)
        wanted = order[bounds[block]:bounds[block + 1]]  # (m,) the targets that read this block
        local = rows[wanted] - start
        out[wanted] = logits[local, targets[wanted]] - torch.logsumexp(logits, dim=-1)[local]
    return to_host(out)
