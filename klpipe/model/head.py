"""The LM head applied to selected hidden states only, in blocks, with an fp32 logsumexp.

Gemma 4's vocabulary is 262,144: full logits for one 8×2048 batch would be 17 GB of fp32, and
their log_softmax as much again. Only the positions that predict a response token reach the
head, a block of rows at a time, so the largest tensor is one (rows, V) block whatever the batch.
"""

from __future__ import annotations

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
        # Rows of the head applied at once: bounds the (rows, V) fp32 logits block.
        self.rows = max(1, (logits_budget or GPU_LOGITS) // self.vocab_size)
        if logits_budget is None and not device.startswith("cuda"):
            # CPU: a 16 MiB block stays in a typical L3 cache, where the logsumexp runs ~25% faster
            # than over 64 MiB (vocabulary 8k, `make bench`); but under 256 rows a block re-reads
            # the head's weight for too few rows. Never over 64 MiB.
            self.rows = max(1, min(CPU_LOGITS_MAX // self.vocab_size,
                                   max(CPU_LOGITS_CACHED // self.vocab_size, 256)))

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
        weight = self.weight
        hidden = hidden.to(weight.device)
        targets = targets.to(weight.device)
        rows = torch.arange(hidden.shape[0], device=weight.device) if rows is None else rows.to(weight.device)
        out = torch.empty(targets.shape[0], dtype=torch.float32, device=weight.device)
        order = torch.argsort(rows, stable=True)  # targets grouped by the block of hidden states they read
        bounds = torch.searchsorted(rows[order], torch.arange(0, hidden.shape[0] + self.rows, self.rows,
                                                              device=weight.device)).tolist()
        for block, start in enumerate(range(0, hidden.shape[0], self.rows)):
            logits = F.linear(hidden[start:start + self.rows], weight, self.bias).float()  # (n, V), fp32 from here
            # In place: a (n, V) block is the largest tensor klpipe makes; no need for four of them.
            if self.logit_multiplier != 1.0:
                logits.mul_(self.logit_multiplier)
            if self.softcap:
                logits.div_(self.softcap).tanh_().mul_(self.softcap)
            if temperature != 1.0:
                logits.div_(temperature)
            wanted = order[bounds[block]:bounds[block + 1]]  # (m,) the targets that read this block
            local = rows[wanted] - start
            out[wanted] = logits[local, targets[wanted]] - torch.logsumexp(logits, dim=-1)[local]
        return out.cpu()
