"""The frozen reference model: loading it safely and scoring response tokens without full-vocab logits.

This is the only module that imports torch and transformers. It never builds a (batch, seq, vocab)
tensor: the model body runs once per batch, the hidden states at response positions are gathered,
and the model's own LM head is applied to them in chunks of rows, with logsumexp in fp32.
"""

from __future__ import annotations

import hashlib
import inspect
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from klpipe.errors import ModelError, first_line

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Logit values in one block of the chunked LM head: 2^27 (512 MiB of fp32) on CUDA by default; on
# CPU 2^22 (16 MiB) where that still gives 256 rows, and never more than 2^24 (64 MiB).
CPU_LOGITS_CACHED = 1 << 22
CPU_LOGITS_MAX = 1 << 24


@dataclass
class ModelSpec:
    name: str  # hub id or local directory
    revision: str | None = None
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    trust_remote_code: bool = False


def is_local(name: str) -> bool:
    """A name that can only be a filesystem path: never sent to the hub."""
    return (
        os.path.exists(name)
        or name.startswith((".", "/", "~"))
        or os.sep in name.strip("/").replace("/", "", 1)  # hub ids have exactly one slash
        or "\\" in name
    )


def resolve_device(device: str) -> tuple[str, str | dict | None]:
    """(device for inputs, device_map for from_pretrained)."""
    if device == "auto":
        if not torch.cuda.is_available():
            return "cpu", None
        if torch.cuda.device_count() > 1:
            # Several GPUs and one process: spread the model (for models larger than one GPU).
            if importlib.util.find_spec("accelerate") is None:
                raise ModelError("--device auto over several GPUs needs the accelerate package (pip install accelerate)")
            return "cuda:0", "auto"
        return "cuda:0", None
    if device == "cpu":
        return "cpu", None
    if device == "cuda" or device.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ModelError(f"--device {device} asked for, but torch sees no CUDA device")
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise ModelError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) visible")
        return f"cuda:{index}", None
    raise ModelError(f"--device must be auto, cpu, cuda or cuda:N, not {device!r}")


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        if device.startswith("cuda") and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if dtype not in DTYPES:
        raise ModelError(f"--dtype must be auto, float32, bfloat16 or float16, not {dtype!r}")
    if dtype == "float16" and device == "cpu":
        # CPU float16 matmuls fall back to scalar code: orders of magnitude slower than bfloat16.
        raise ModelError("--dtype float16 on CPU is extremely slow; use bfloat16 or float32")
    return DTYPES[dtype]


def load_tokenizer(spec: ModelSpec):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(spec.name, **_source_kwargs(spec))
    except (OSError, ValueError) as exc:
        raise _load_error(spec, "the tokenizer", exc) from None


def load_config(spec: ModelSpec):
    """The model config alone: cheap, so inputs are validated before gigabytes of weights load."""
    from transformers import AutoConfig

    _check_exists(spec)
    try:
        return AutoConfig.from_pretrained(spec.name, **_source_kwargs(spec))
    except (OSError, ValueError) as exc:
        raise _load_error(spec, "the model config", exc) from None


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def vocab_and_context(config) -> tuple[int, int | None]:
    text = text_config(config)
    return int(text.vocab_size), getattr(text, "max_position_embeddings", None)


def tokenizer_fingerprint(tokenizer, chat_template: bool = False) -> str:
    """sha256 over everything that decides token ids: vocabulary, merges, normalisation, special tokens,
    and, with `chat_template` (conversational rollouts, which it renders), the chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        payload = backend.to_str()
    else:
        payload = json.dumps(sorted(tokenizer.get_vocab().items()))
    payload += json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str)
    if chat_template:
        payload += json.dumps(getattr(tokenizer, "chat_template", None), sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def weights_fingerprint(spec: ModelSpec, config) -> str | None:
    """The commit hash for hub models; for a local directory, a hash of its config and weight headers."""
    commit = getattr(config, "_commit_hash", None)
    if not is_local(spec.name):
        return commit or spec.revision
    root = Path(spec.name).expanduser()
    digest = hashlib.sha256()
    for path in sorted(root.glob("*.json")) + sorted(root.glob("*.safetensors")):
        digest.update(path.name.encode())
        digest.update(str(path.stat().st_size).encode())
        with open(path, "rb") as fh:
            # A safetensors file starts with its header (names, shapes, offsets); 1 MiB also
            # covers the first tensors' bytes, enough to tell retrained weights apart.
            digest.update(fh.read(1 << 20))
    return "local:" + digest.hexdigest()[:16]


class ReferenceModel:
    """A frozen causal LM that returns log p(response token | prefix) for batches of rows."""

    def __init__(self, model, device: str, dtype: torch.dtype, logits_budget: int | None = None):
        self.model = model
        self.device = device
        self.dtype = dtype
        self.body = model.base_model  # everything up to (and including) the final norm
        head = model.get_output_embeddings()
        if head is None or not hasattr(head, "weight"):
            raise ModelError(f"{type(model).__name__} has no linear LM head klpipe can apply in chunks")
        self.head_weight = head.weight  # (V, H)
        self.head_bias = getattr(head, "bias", None)
        config = text_config(model.config)
        # Everything the model does to its logits after the head, in the model's own order.
        self.logit_multiplier = float(getattr(config, "logit_scale", None) or 1.0)  # Cohere
        divisor = getattr(config, "logits_scaling", None)  # Granite
        if divisor:
            self.logit_multiplier /= float(divisor)
        self.softcap = getattr(config, "final_logit_softcapping", None)  # Gemma 2/3/4
        self.vocab_size = self.head_weight.shape[0]
        # Rows of the head applied at once: bounds the (rows, V) fp32 logits block.
        self.head_rows = max(1, (logits_budget or 1 << 27) // self.vocab_size)
        if logits_budget is None and not device.startswith("cuda"):
            # CPU: a 16 MiB block stays in a typical L3 cache, where the logsumexp runs ~25% faster
            # than over 64 MiB (vocabulary 8k, `make bench`); but under 256 rows a block re-reads
            # the head's weight for too few rows. Never over 64 MiB.
            self.head_rows = max(1, min(CPU_LOGITS_MAX // self.vocab_size,
                                        max(CPU_LOGITS_CACHED // self.vocab_size, 256)))
        # The load-time probes compare two computations of the same logprobs; bf16 rounding alone
        # moves them by a few hundredths, a wrong computation by nats.
        self.probe_tolerance = 1e-3 if dtype == torch.float32 else 0.25
        parameters = inspect.signature(self.body.forward).parameters
        # transformers 5 renamed past_key_values to cache (the old name warns, then goes).
        self._cache_argument = "cache" if "cache" in parameters else "past_key_values"
        self._accepts_logits_to_keep = "logits_to_keep" in parameters
        # Gemma 4's KV-shared layers read the keys and values of earlier layers and write none, so a
        # prefill that keeps only the last position runs them on that position alone: for E2B, 20 of
        # 35 layers and ~69% of the body's FLOPs skipped for every prompt token but the last.
        self.prefill_skips_layers = (self._accepts_logits_to_keep
                                     and (getattr(config, "num_kv_shared_layers", 0) or 0) > 0)

    @classmethod
    def load(cls, spec: ModelSpec) -> ReferenceModel:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        # Our own progress and summary lines are the log; transformers' bars would garble cron logs,
        # and its load report would repeat, in twenty lines, the one-line error we raise below.
        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()

        device, device_map = resolve_device(spec.device)
        dtype = resolve_dtype(spec.dtype, device)
        _check_exists(spec)
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                spec.name,
                dtype=dtype,
                device_map=device_map,
                use_safetensors=True,  # never unpickle .bin weights
                output_loading_info=True,
                **_source_kwargs(spec),
            )
        except (OSError, ValueError, KeyError) as exc:
            raise _load_error(spec, "the model", exc) from None
        _check_loading_info(spec.name, type(model).__name__, info)
        if device_map is None:
            model.to(device)
        model.eval()
        model.requires_grad_(False)
        reference = cls(model, device, dtype)
        reference.check_head()
        return reference

    @property
    def input_device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @torch.inference_mode()
    def check_head(self) -> None:
        """Compare the chunked head with the model's own forward once, on a short probe sequence.

        This catches architectures that transform logits in ways klpipe does not model, before
        they silently produce wrong logprobs (softcap bugs have produced KL 0.24 instead of 1e-5).
        """
        generator = torch.Generator().manual_seed(0)
        length = 12
        probe = torch.randint(0, self.vocab_size, (1, length), generator=generator).to(self.input_device)
        own = self.model(input_ids=probe, use_cache=False).logits.float()[0, :-1]  # (T-1, V)
        expected = torch.log_softmax(own, dim=-1).gather(-1, probe[0, 1:, None].to(own.device))[:, 0]
        ours = self.score_batch([(probe[0, :6].cpu().numpy(), probe[0, 6:].cpu().numpy())])[0]
        ours_full = self.score_batch([(probe[0, :1].cpu().numpy(), probe[0, 1:].cpu().numpy())])[0]
        gap = float(np.max(np.abs(ours_full - expected.cpu().numpy())))
        gap = max(gap, float(np.max(np.abs(ours - expected.cpu().numpy()[5:]))))
        if not gap <= self.probe_tolerance:
            raise ModelError(
                f"{type(self.model).__name__}: klpipe's chunked LM head disagrees with the model's own logits "
                f"(max |Δ logprob| = {gap:.3g}); this architecture transforms its logits in a way klpipe does not know"
            )

    @torch.inference_mode()
    def score_batch(self, rows: list[tuple[np.ndarray, np.ndarray]], temperature: float = 1.0) -> list[np.ndarray]:
        """log p(response[i] | prompt + response[:i]) for each (prompt_ids, response_ids) row, as float32."""
        # The last response token is only ever a target, never context: feed one token less.
        inputs = [np.concatenate([p, r])[:-1] if len(r) else p[:0] for p, r in rows]
        lengths = [len(x) for x in inputs]
        longest = max(lengths, default=0)
        if longest == 0:
            return [np.zeros(0, dtype=np.float32) for _ in rows]
        # Right padding: with causal attention no real token can see a pad, so no attention mask
        # is needed and position ids stay 0..n-1, exactly as in an unpadded single-row pass.
        batch = np.zeros((len(rows), longest), dtype=np.int64)
        for i, ids in enumerate(inputs):
            batch[i, : len(ids)] = ids
        input_ids = torch.from_numpy(batch).to(self.input_device)
        hidden = self.body(input_ids=input_ids, use_cache=False).last_hidden_state  # (B, T, H)

        # Position prompt_len - 1 + i predicts response token i.
        return self._targets_logprobs(hidden, [len(p) - 1 for p, _ in rows], [r for _, r in rows], temperature)

    @torch.inference_mode()
    def score_shared(self, prompts: list[np.ndarray], responses: list[np.ndarray], prompt_of: np.ndarray,
                     passes: list[np.ndarray], temperature: float = 1.0) -> list[np.ndarray]:
        """log p(response tokens) for rows that continue shared prompts, each prompt run once.

        `prompts` are prefilled together; row i continues prompts[prompt_of[i]] with responses[i].
        Each of `passes` (row indices, every row with two or more response tokens exactly once)
        is one forward of those rows' responses against the prompts' KV cache. This is transformers'
        own generation machinery (left-padded prefill, a cache, an attention mask and position ids),
        so any causal LM whose cache transformers implements works, sliding windows and KV-shared
        layers included; `check_prefix_sharing` verifies that at load time.
        """
        results = [np.zeros(0, dtype=np.float32) for _ in responses]
        cache, prompt_mask, last_hidden = self._prefill(prompts)  # last_hidden: (n, H)
        prompt_lengths = torch.tensor([len(p) for p in prompts], device=self.input_device)
        # Response token 0 is predicted by the prompt's last position: one hidden state per prompt.
        first = [i for i, r in enumerate(responses) if len(r)]
        if first:
            index = torch.as_tensor(prompt_of[first], device=last_hidden.device)
            targets = torch.tensor([int(responses[i][0]) for i in first])
            for i, value in zip(first, self._head_logprobs(last_hidden[index], targets, temperature).numpy()):
                results[i] = np.array([value], dtype=np.float32)
        for rows in passes:
            fed = [responses[i][:-1] for i in rows]  # (b,) lists of R_i - 1 tokens: the last is only a target
            groups = torch.as_tensor(prompt_of[rows], device=self.input_device)
            hidden = self._continue(cache, prompt_mask, prompt_lengths, groups, fed)  # (b, T, H)
            # Fed token j (response token j) predicts response token j + 1.
            rest = self._targets_logprobs(hidden, [0] * len(rows), [responses[i][1:] for i in rows], temperature)
            for i, values in zip(rows, rest):
                results[i] = np.concatenate([results[i], values])
        return results

    def _prefill(self, prompts: list[np.ndarray]):
        """Run prompts once, left-padded so that they all end at the same position.

        Left padding (as in batched generation) keeps each prompt's tokens contiguous and its end
        aligned, so a sliding window measured in cache positions is the window in real tokens; the
        attention mask hides the pads and position ids restart at 0 after them.
        """
        from transformers import DynamicCache

        longest = max(len(p) for p in prompts)
        ids = np.zeros((len(prompts), longest), dtype=np.int64)
        mask = np.zeros((len(prompts), longest), dtype=np.int64)
        for k, prompt in enumerate(prompts):
            ids[k, longest - len(prompt):] = prompt
            mask[k, longest - len(prompt):] = 1
        input_ids = torch.from_numpy(ids).to(self.input_device)
        mask_t = torch.from_numpy(mask).to(self.input_device)
        positions = (mask_t.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        extra = {}
        if self._accepts_logits_to_keep:
            # Only the last position's hidden state is needed: Gemma 4 then runs its KV-shared layers
            # (20 of E2B's 35) on that one position instead of the whole prompt.
            extra["logits_to_keep"] = 1
        out = self.body(input_ids=input_ids, attention_mask=mask_t, position_ids=positions, use_cache=True,
                        **{self._cache_argument: cache}, **extra)
        return cache, mask_t, out.last_hidden_state[:, -1]

    def _continue(self, cache, prompt_mask: torch.Tensor, prompt_lengths: torch.Tensor, groups: torch.Tensor,
                  fed: list[np.ndarray]) -> torch.Tensor:
        """Hidden states of `fed` token rows, each continuing prompt `groups[k]` from the prefill cache."""
        longest = max(len(f) for f in fed)
        ids = np.zeros((len(fed), longest), dtype=np.int64)
        for k, tokens in enumerate(fed):
            ids[k, : len(tokens)] = tokens  # right padding: no real token ever attends to a later pad
        input_ids = torch.from_numpy(ids).to(self.input_device)
        mask = torch.cat([prompt_mask[groups], torch.ones_like(input_ids)], dim=1)  # (b, P_max + T)
        positions = prompt_lengths[groups][:, None] + torch.arange(longest, device=input_ids.device)[None]
        out = self.body(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                        **{self._cache_argument: _continuing(cache, groups)})
        return out.last_hidden_state

    def check_prefix_sharing(self) -> str | None:
        """None if the shared-prompt path reproduces the per-row path on a probe; otherwise why not.

        The probe has two prompts of different lengths (left padding), one longer than a typical
        sliding window, responses of length 0, 1 and several, and two passes over one prefill (so a
        cache that a pass modified in place would show).
        """
        generator = torch.Generator().manual_seed(1)

        def tokens(n: int) -> np.ndarray:
            return torch.randint(0, self.vocab_size, (n,), generator=generator).numpy()

        prompts = [tokens(40), tokens(5)]
        responses = [tokens(7), tokens(1), tokens(0), tokens(4), tokens(6)]
        prompt_of = np.array([0, 0, 0, 1, 0])
        try:
            got = self.score_shared(prompts, responses, prompt_of, [np.array([0, 3]), np.array([4])])
        except Exception as exc:  # noqa: BLE001 - any failure means: do not share on this model
            return f"{type(exc).__name__}: {first_line(exc)}"
        expected = self.score_batch([(prompts[g], r) for g, r in zip(prompt_of, responses)])
        gap = max((float(np.max(np.abs(a - b))) for a, b in zip(got, expected) if len(b)), default=0.0)
        if any(a.shape != b.shape for a, b in zip(got, expected)) or not gap <= self.probe_tolerance:
            return f"continuing a prompt's KV cache changes the logprobs (max |Δ logprob| = {gap:.3g})"
        return None

    def _targets_logprobs(self, hidden: torch.Tensor, starts: list[int], targets: list[np.ndarray],
                          temperature: float) -> list[np.ndarray]:
        """Row k's logprobs of targets[k], predicted by hidden[k, starts[k] : starts[k] + len(targets[k])].

        Only those positions reach the LM head, all rows' at once: (tokens, H), never (B, T, V).
        """
        row_index = np.concatenate([np.full(len(t), k, dtype=np.int64) for k, t in enumerate(targets)])
        position = np.concatenate([np.arange(s, s + len(t)) for s, t in zip(starts, targets)])
        selected = hidden[torch.from_numpy(row_index).to(hidden.device), torch.from_numpy(position).to(hidden.device)]
        flat = torch.from_numpy(np.concatenate(targets).astype(np.int64))
        logprobs = self._head_logprobs(selected, flat, temperature).numpy()
        return np.split(logprobs, np.cumsum([len(t) for t in targets])[:-1])

    def _head_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        weight = self.head_weight
        hidden = hidden.to(weight.device)
        targets = targets.to(weight.device)
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=weight.device)
        for start in range(0, hidden.shape[0], self.head_rows):
            stop = start + self.head_rows
            logits = F.linear(hidden[start:stop], weight, self.head_bias).float()  # (n, V), fp32 from here
            # In place: a (n, V) block is the largest tensor klpipe makes; no need for four of them.
            if self.logit_multiplier != 1.0:
                logits.mul_(self.logit_multiplier)
            if self.softcap:
                logits.div_(self.softcap).tanh_().mul_(self.softcap)
            if temperature != 1.0:
                logits.div_(temperature)
            picked = logits.gather(1, targets[start:stop, None])[:, 0]
            out[start:stop] = picked - torch.logsumexp(logits, dim=-1)
        return out.cpu()


def _continuing(cache, rows: torch.Tensor):
    """A cache through which batch row k continues `cache`'s row rows[k], and that stores nothing.

    Each attention layer reads its prompt keys and values for the rows it needs and appends the
    response's own, per layer and only for that layer's attention: the prompt's cache stays as the
    prefill left it, for the next pass, and no pass holds copies of every layer at once. Everything
    the masks are built from (lengths, sliding windows, KV-shared layers) is the prefill's.
    """
    from transformers import Cache

    class Continuing(Cache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            layer = self.layers[layer_idx]
            keys = torch.cat([layer.keys.index_select(0, rows), key_states], dim=-2)
            values = torch.cat([layer.values.index_select(0, rows), value_states], dim=-2)
            return keys, values

    return Continuing(layers=cache.layers)


def _check_exists(spec: ModelSpec) -> None:
    if is_local(spec.name) and not Path(spec.name).expanduser().is_dir():
        raise ModelError(f"{spec.name}: model directory does not exist")


def _source_kwargs(spec: ModelSpec) -> dict:
    kwargs = {"trust_remote_code": spec.trust_remote_code}
    if is_local(spec.name):
        kwargs["local_files_only"] = True  # a local path never touches the network
    elif spec.revision:
        kwargs["revision"] = spec.revision
    return kwargs


def _check_loading_info(name: str, cls: str, info: dict) -> None:
    """Refuse weights that do not fit the class: transformers would fill the gaps with random values."""
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        keys = sorted(str(k) for k in info.get(kind) or [])
        if keys:
            shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
            label = kind.replace("_", " ")
            raise ModelError(
                f"{name}: {len(keys)} {label} loading it as {cls} ({shown}); "
                "the checkpoint does not match the model class, refusing to run with random weights"
            )


def _load_error(spec: ModelSpec, what: str, exc: BaseException) -> ModelError:
    text = str(exc)
    if "trust_remote_code" in text or "custom code" in text:
        return ModelError(f"{spec.name}: the checkpoint ships its own model code; "
                          "klpipe runs it only with --trust-remote-code")
    return ModelError(f"{spec.name}: cannot load {what} ({first_line(exc)})")

