"""The LM head applied to selected hidden states only, in blocks, with an fp32 logsumexp.

Gemma 4's vocabulary is 262,144: full logits for one 8×2048 batch would be 17 GB of fp32, and
their log_softmax as much again. Only the positions that predict a response token reach the
head, a block of rows at a time, so the largest tensor is one (rows, V) block whatever the batch.

LMHead applies the head's weight and the logit transforms klpipe knows (scale, softcap) itself;
ModelHead runs the model's own forward after the body, for a model whose forward does more. The
load-time check (probes.py) keeps LMHead only where it reproduces the model's own logits.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from klpipe.errors import ModelError

# Logit values in one block: 2^27 (512 MiB of fp32) on CUDA by default; on CPU 2^22 (16 MiB) where
# that still gives 256 rows, and never more than 2^24 (64 MiB).
GPU_LOGITS = 1 << 27
CPU_LOGITS_CACHED = 1 << 22
CPU_LOGITS_MAX = 1 << 24


class LMHead:
    """A causal LM's own output layer and logit transforms, as logprobs of chosen targets."""

    def __init__(self, model, text_config, device: str, logits_budget: int | None = None):
        head = model.get_output_embeddings()
        if head is None or not hasattr(head, "weight"):
            raise ModelError(f"{type(model).__name__} has no linear LM head klpipe can apply in chunks")
        self.weight = head.weight  # (V, H)
        self.bias = getattr(head, "bias", None)
        # Everything the model does to its logits after the head, in the model's own order.
        self.logit_multiplier = float(getattr(text_config, "logit_scale", None) or 1.0)  # Cohere
        divisor = getattr(text_config, "logits_scaling", None)  # Granite
        if divisor:
            self.logit_multiplier /= float(divisor)
        self.softcap = getattr(text_config, "final_logit_softcapping", None)  # Gemma 2/3/4
        self.vocab_size = self.weight.shape[0]
        self.logits_budget = logits_budget
        self.rows = self.rows_for(self.vocab_size, device, logits_budget)

    @staticmethod
    def rows_for(vocab_size: int, device: str, logits_budget: int | None) -> int:
        """Rows of the head applied at once: bounds the (rows, V) fp32 logits block."""
        if logits_budget is None and not device.startswith("cuda"):
            # CPU: a 16 MiB block stays in a typical L3 cache, where the logsumexp runs ~25% faster
            # than over 64 MiB (vocabulary 8k, `make bench`); but under 256 rows a block re-reads
            # the head's weight for too few rows. Never over 64 MiB.
            return max(1, min(CPU_LOGITS_MAX // vocab_size, max(CPU_LOGITS_CACHED // vocab_size, 256)))
        return max(1, (logits_budget or GPU_LOGITS) // vocab_size)

    def logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                 rows: torch.Tensor | None = None) -> torch.Tensor:
        """log p(targets[i] | hidden[rows[i]]) as float32 on the CPU: (N, H), (M,), rows (M,) → (M,).

        `rows` defaults to 0..N-1 (one target per hidden state). Several targets may read one hidden
        state: where rows of a chunk part ways, one position predicts a different token for each, and
        its logsumexp is computed once. The naive equivalent, which this never materialises for all
        rows at once:

            logits = model.lm_head(hidden).float()              # (N, V)
            logits = softcap · tanh(logits / softcap) / temperature
            torch.log_softmax(logits, -1)[rows, targets]
        """
        return blocked_logprobs(self._logits, self.rows, self.weight.device, hidden, targets, temperature, rows)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, V) fp32 logits of (n, H) hidden states, transformed as the model does."""
        logits = F.linear(hidden, self.weight, self.bias).float()  # (n, V), fp32 from here
        # In place: a (n, V) block is the largest tensor klpipe makes; no need for four of them.
        if self.logit_multiplier != 1.0:
            logits.mul_(self.logit_multiplier)
        if self.softcap:
            logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits


class ModelHead:
    """The model's own head and final transformation, run by its own forward on hidden states klpipe computed.

    For a model whose forward does to its logits what LMHead does not know (RecurrentGemma caps them through
    `logits_soft_cap`): the causal LM's forward runs with its decoder body standing in as the block's hidden
    states (`_GivenHidden`), so its `lm_head`, its `logits_to_keep` slice and whatever follows are the model's
    own code. Slower than LMHead (the logits come back whole for the block, in the model's dtype), and as
    bounded: one (rows, V) block at a time.
    """

    def __init__(self, model, body, device: str, logits_budget: int | None = None):
        from klpipe.model.loading import module_path

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
    hidden = hidden.to(device)
    targets = targets.to(device)
    rows = torch.arange(hidden.shape[0], device=device) if rows is None else rows.to(device)
    out = torch.empty(targets.shape[0], dtype=torch.float32, device=device)
    order = torch.argsort(rows, stable=True)  # targets grouped by the block of hidden states they read
    bounds = torch.searchsorted(rows[order], torch.arange(0, hidden.shape[0] + block_rows, block_rows,
                                                          device=device)).tolist()
    for block, start in enumerate(range(0, hidden.shape[0], block_rows)):
        logits = logits_of(hidden[start:start + block_rows])  # (n, V) fp32
        if temperature != 1.0:
            logits.div_(temperature)
        wanted = order[bounds[block]:bounds[block + 1]]  # (m,) the targets that read this block
        local = rows[wanted] - start
        out[wanted] = logits[local, targets[wanted]] - torch.logsumexp(logits, dim=-1)[local]
    return out.cpu()
