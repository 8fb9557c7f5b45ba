"""Two models' heads over the same vocabulary blocks at once: the exact KL both ways, both entropies, both
logprobs of the sampled token, and the reference's top-k, without a (tokens × vocabulary) tensor.

Each side's run hands over the final hidden states of the chunk's needed positions (capture.py); `joint` applies
both heads to them, vocabulary block by vocabulary block, with online sums per row in fp32 (fp64 under --dtype float64):

    a, b   the policy's and the reference's transformed logits (softcap, logit scale, temperature) of one block
    m      each side's running max;  S = Σ e^(z−m);  C = Σ e^(z−m) (z−m);  X_a = Σ e^(a−m_a) (a−b), X_b likewise
    lse = m + log S,  H = log S − C/S,  KL(π‖π_ref) = X_a/S_a − lse_a + lse_b,  KL(π_ref‖π) = X_b/S_b − lse_b + lse_a

each rescaled by e^(m−m') where a block raises a row's max, as head.py's log-sum-exp is. The naive equivalent:

    logp, logq = log_softmax(policy_logits / T), log_softmax(reference_logits / T)    # (N, V) each, fp64
    kl_policy_ref = (logp.exp() * (logp - logq)).sum(-1)
    ref_topk = logq.topk(K)

The matmuls are the two that the runs' own heads would have made (the runs make none), so the extra work is the
elementwise sums over logits the heads already hold.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from klpipe.model.head import HeadBlocks, HeadView, LMHead, ModelHead

if TYPE_CHECKING:
    from klpipe.model.streamed_head import HeadRows


@dataclass(frozen=True)
class Side:
    """One model's head as `joint` applies it: a view of klpipe's fused head (its weight in memory, or read from its
    file by `streamed`), or the model's own head (`own`, a ModelHead) run with `active` entered."""

    view: HeadView | None = None
    streamed: HeadRows | None = None  # where the weight stays in its file
    own: ModelHead | None = None
    active: object = nullcontext  # () -> a context manager: the side's adapter on, for `own`'s forward

    @staticmethod
    def of(model, active=nullcontext) -> Side:
        """`model`'s head with `active()` entered (an adapter's side: its modules_to_save head where it has one)."""
        with active():
            head = model.head
            if isinstance(head, LMHead):
                view = head.view()
                stream = head.streamed if head.streamed is not None and view.weight is head.streamed.meta else None
                return Side(view=view, streamed=stream)
            return Side(own=head, active=active)

    @property
    def device(self) -> torch.device:
        return self.own.device if self.own is not None else self.fused.weight.device

    @property
    def fused(self) -> HeadView:
        """The view of klpipe's fused head, for a side that has no head of the model's own."""
        if self.view is None:
            raise RuntimeError("klpipe bug: the joint head reads the fused head of a side that runs the model's own")
        return self.view

    def prepared(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states as the fused head rounds them: the weight's dtype, then fp32 on the CPU."""
        hidden = hidden.to(self.device)
        if self.view is None:
            return hidden
        if hidden.dtype != self.view.weight.dtype and hidden.dtype.is_floating_point:
            hidden = hidden.to(self.view.weight.dtype)
        return hidden.float() if not hidden.is_cuda and hidden.dtype != torch.float32 else hidden


@dataclass(frozen=True)
class Settings:
    """What `joint` applies both heads with: `temperature`, the vocabulary of `vocab` tokens cut into `blocks`, and the
    reference's top `topk` (0: none)."""

    temperature: float
    blocks: HeadBlocks
    vocab: int
    topk: int = 0


@dataclass
class Exact:
    """Per target, on the host: both logprobs of the token, both KLs, both entropies (None without a policy), and the
    reference's top-k (None without)."""

    ref_logprobs: np.ndarray
    policy_logprobs: np.ndarray | None = None
    kl_policy_ref: np.ndarray | None = None
    kl_ref_policy: np.ndarray | None = None
    policy_entropy: np.ndarray | None = None
    ref_entropy: np.ndarray | None = None
    topk_ids: np.ndarray | None = None  # (N, K) int32, most likely first
    topk_logprobs: np.ndarray | None = None  # (N, K)


class _Running:
    """One side's online sums over vocabulary blocks for n rows (see the module's docstring)."""

    def __init__(self, n: int, device, cross: bool):
        self.best = torch.full((n,), -torch.inf, dtype=torch.float32, device=device)  # m
        self.total = torch.zeros(n, dtype=torch.float32, device=device)  # S
        self.centred = torch.zeros(n, dtype=torch.float32, device=device)  # C
        self.cross = torch.zeros(n, dtype=torch.float32, device=device) if cross else None  # X
        self.target = torch.full((n,), torch.nan, dtype=torch.float32, device=device)  # each target's logit

    def add(self, rows: slice, z: torch.Tensor, diff: torch.Tensor | None, sign: float, scratch: torch.Tensor
            ) -> None:
        """Block `z` (r, v) of rows `rows` in; `diff` = a − b over the block, counted with `sign`. Rewrites `z` and
        `scratch` (a block's worth, reused: a fresh tensor per block costs CPU page faults as much as the work)."""
        best = self.best[rows]
        new = torch.maximum(best, z.amax(dim=1))
        scale = torch.exp(best - new)  # 0 at the first block
        shift = torch.where(torch.isfinite(best), best - new, torch.zeros_like(best))
        centred = z.sub_(new[:, None])  # (r, v) z − m
        weights = torch.exp(centred, out=scratch)  # (r, v) e^(z − m)
        # Row-wise dot products by vecdot: einsum's "rv,rv->r" runs several times slower on the CPU.
        self.centred[rows] = scale * (self.centred[rows] + shift * self.total[rows]) + torch.linalg.vecdot(
            weights, centred, dim=1)
        self.total[rows] = self.total[rows] * scale + weights.sum(dim=1)
        if diff is not None:
            cross = self._cross()
            cross[rows] = cross[rows] * scale + sign * torch.linalg.vecdot(weights, diff, dim=1)
        self.best[rows] = new

    def _cross(self) -> torch.Tensor:
        if self.cross is None:
            raise RuntimeError("klpipe bug: the joint head's cross sums read on a side that keeps none")
        return self.cross

    @property
    def cross_mean(self) -> torch.Tensor:
        """X/S: the mean of a − b (the reference's: b − a) under this side's softmax."""
        return self._cross() / self.total

    @property
    def lse(self) -> torch.Tensor:
        return self.best + torch.log(self.total)

    @property
    def entropy(self) -> torch.Tensor:
        return torch.log(self.total) - self.centred / self.total


class _TopK:
    """The k largest logits of each row seen so far, and their token ids."""

    def __init__(self, n: int, k: int, device):
        self.values = torch.full((n, k), -torch.inf, dtype=torch.float32, device=device)
        self.ids = torch.full((n, k), -1, dtype=torch.long, device=device)
        self.k = k

    def add(self, rows: slice, z: torch.Tensor, low: int) -> None:
        values, ids = z.topk(min(self.k, z.shape[1]), dim=1)  # (r, k') of the block, before it is rewritten
        merged = torch.cat([self.values[rows], values], dim=1)
        merged_ids = torch.cat([self.ids[rows], ids + low], dim=1)
        best, where = merged.topk(self.k, dim=1)
        self.values[rows] = best
        self.ids[rows] = merged_ids.gather(1, where)


def joint(ref: Side, policy: Side | None, ref_hidden: torch.Tensor, policy_hidden: torch.Tensor | None,
          targets: torch.Tensor, settings: Settings) -> Exact:
    """Both heads over the same n positions, predicting `targets` (n,) (see the module docstring)."""
    device = ref.device
    n = int(targets.shape[0])
    targets = targets.to(device)
    sides = [(ref, ref.prepared(ref_hidden), _Running(n, device, policy is not None))]
    if policy is not None:
        if policy_hidden is None:
            raise RuntimeError("klpipe bug: the joint head was given a policy without its hidden states")
        sides.append((policy, policy.prepared(policy_hidden), _Running(n, device, True)))
    best = _TopK(n, settings.topk, device) if settings.topk else None
    if any(side.streamed is not None for side, _, _ in sides):
        _vocab_major(sides, best, targets, settings)
    else:
        _rows_major(sides, best, targets, settings)
    ref_run = sides[0][2]
    ref_lse = ref_run.lse
    out = Exact(ref_logprobs=_host(ref_run.target - ref_lse))
    if policy is not None:
        run = sides[1][2]
        lse = run.lse
        out.policy_logprobs = _host(run.target - lse)
        out.kl_policy_ref = _host(run.cross_mean - lse + ref_lse)
        out.kl_ref_policy = _host(ref_run.cross_mean - ref_lse + lse)
        out.policy_entropy = _host(run.entropy)
        out.ref_entropy = _host(ref_run.entropy)
    if best is not None:
        out.topk_logprobs = _host(best.values - ref_lse[:, None])
        out.topk_ids = _host(best.ids).astype(np.int32)
    return out


def _rows_major(sides, best: _TopK | None, targets: torch.Tensor, settings: Settings) -> None:
    """Rows a block at a time, each through the whole vocabulary (heads in memory, as head.fused_logprobs runs)."""
    temperature, blocks, vocab = settings.temperature, settings.blocks, settings.vocab
    n = int(targets.shape[0])
    step = min([blocks.rows] + [side.own.rows for side, _, _ in sides if side.own is not None])
    scratch = _Scratch()
    for start in range(0, n, step):
        rows = slice(start, min(start + step, n))
        whole = {}  # a model's own head: its (r, V) logits of these rows, made once
        for k, (side, hidden, run) in enumerate(sides):
            if side.own is not None:
                with side.active():
                    whole[k] = side.own._logits(hidden[rows]).div_(temperature)  # (r, V) fp32
                run.target[rows] = whole[k].gather(1, targets[rows, None].to(side.device))[:, 0].to(run.target.device)
            else:
                run.target[rows] = side.fused.targets(hidden[rows], targets[rows].to(side.device),
                                                      temperature).to(run.target.device)
        for low in range(0, vocab, blocks.vocab):
            high = min(low + blocks.vocab, vocab)
            logits = [whole[k][:, low:high].clone() if k in whole else side.fused.block(hidden[rows], low, high,
                                                                                        temperature)
                      for k, (side, hidden, _) in enumerate(sides)]  # (r, v) fp32 each
            _add(sides, logits, rows, best, low, scratch)


def _vocab_major(sides, best: _TopK | None, targets: torch.Tensor, settings: Settings) -> None:
    """Vocabulary blocks outermost, every row through each (a head read from its file, once: streamed_head.py)."""
    temperature, blocks, vocab = settings.temperature, settings.blocks, settings.vocab
    if any(side.own is not None for side, _, _ in sides):
        raise RuntimeError("klpipe bug: a streamed head beside a model's own head in the joint head")
    n, width = int(targets.shape[0]), blocks.vocab
    cursors = [_Cursor(side, width, targets, temperature, hidden, run) for side, hidden, run in sides]
    scratch = _Scratch()
    for low in range(0, vocab, width):
        high = min(low + width, vocab)
        weights = [cursor.rows(low, high) for cursor in cursors]
        for start in range(0, n, blocks.rows):
            rows = slice(start, min(start + blocks.rows, n))
            logits = [side.fused.block(hidden[rows], low, high, temperature, weight)
                      for (side, hidden, _), weight in zip(sides, weights, strict=True)]
            _add(sides, logits, rows, best, low, scratch)


class _Cursor:
    """A side's head weight, rows [low, high) at a time in vocabulary order: slices of it in memory, or of the block
    read last from its file, each target's logit taken off the block that holds its row as the block is read."""

    def __init__(self, side: Side, width: int, targets, temperature: float, hidden, run: _Running):
        targets = targets.to(side.device)
        self.side, self.targets, self.temperature, self.hidden, self.run = side, targets, temperature, hidden, run
        self.blocks = side.streamed.blocks(side.device, multiple=width) if side.streamed is not None else None
        self.low = 0
        self.block: torch.Tensor | None = None  # the block read last from the file
        if self.blocks is None:
            run.target[:] = side.fused.targets(hidden, targets, temperature).to(run.target.device)

    def rows(self, low: int, high: int) -> torch.Tensor | None:
        if self.blocks is None:
            return None  # view.block slices its own weight
        block = self.block
        while block is None or high > self.low + block.shape[0]:
            self.low, block = next(self.blocks)
            self.block = block
            inside = torch.nonzero((self.targets >= self.low) & (self.targets < self.low + block.shape[0]))[:, 0]
            if len(inside):
                found = self.side.fused.targets(self.hidden[inside], self.targets[inside], self.temperature,
                                                block[self.targets[inside] - self.low])
                self.run.target[inside.to(self.run.target.device)] = found.to(self.run.target.device)
        return block[low - self.low:high - self.low]


def _add(sides, logits: list[torch.Tensor], rows: slice, best: _TopK | None, low: int, scratch: _Scratch) -> None:
    """One block of each side's logits (the reference's first) into the sums and the top-k."""
    logits = [logits[0], *(z.to(logits[0].device) for z in logits[1:])]  # a policy on a device of its own
    diff = None
    if len(logits) > 1:  # (r, v) a − b: the policy's less the reference's
        diff = torch.sub(logits[1], logits[0], out=scratch.get("diff", logits[0]))
    if best is not None:
        best.add(rows, logits[0], low)
    sides[0][2].add(rows, logits[0], diff, -1.0, scratch.get("weights", logits[0]))
    if diff is not None:
        sides[1][2].add(rows, logits[1], diff, 1.0, scratch.get("weights", logits[0]))


class _Scratch:
    """Buffers of a block's shape, made once and reused for every block of that shape or smaller."""

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, like: torch.Tensor) -> torch.Tensor:
        held = self.buffers.get(name)
        if held is None or held.shape[0] < like.shape[0] or held.shape[1] < like.shape[1] or held.dtype != like.dtype:
            held = self.buffers[name] = torch.empty(like.shape, dtype=like.dtype, device=like.device)
        return held[:like.shape[0], :like.shape[1]]


def _host(values: torch.Tensor) -> np.ndarray:
    return values.cpu().numpy()

