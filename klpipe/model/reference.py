"""The frozen reference model: log p(response token | prefix) for batches of rows, never full-vocab logits.

The model body runs once per batch, the hidden states at response positions are gathered, and
the model's own LM head (head.py) is applied to them in blocks. Rows run whole here, one per
batch row (`score_batch`); rows that share prefixes run through a prefix tree (tree.py).
"""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from klpipe import plan
from klpipe.contract import LoadOptions
from klpipe.model import architecture, checks, compiled, loading, lora, probes, wide
from klpipe.model.attention import cascade, packing
from klpipe.model.head import LMHead, ModelHead
from klpipe.model.loading import ModelSpec
from klpipe.model.transfer import to_device
from klpipe.model.verdict import OWN, Verdict

if TYPE_CHECKING:
    from klpipe.model.attention.context_cache import CacheCost
    from klpipe.model.attention.continuation import LayerKind
    from klpipe.model.layer_major import LayerMajor


class ReferenceModel:
    """A frozen causal LM that returns log p(response token | prefix) for batches of rows."""

    def __init__(self, model, device: str, dtype: torch.dtype, logits_budget: int | None = None,
                 options: LoadOptions | None = None):
        options = options if options is not None else LoadOptions()  # the loader's: a streamed share, a cache cap
        self.model = model
        self.device, self.dtype = device, dtype
        self.body = architecture.decoder_body(model)  # everything up to (and including) the final norm
        config = architecture.text_config(model.config)
        self.chunked_head = LMHead(model, config, device, logits_budget)
        self.head = self.chunked_head
        self.vocab_size = self.head.vocab_size
        # The load-time probes compare two computations of the same logprobs; bf16 rounding alone
        # moves them by a few hundredths, a wrong computation by nats.
        self.probe_tolerance = 1e-3 if dtype == torch.float32 else 1e-6 if dtype == torch.float64 else 0.25
        # The logprobs handed back: fp64 from an fp64 model (tests hold it to an fp64 forward within 1e-9), else fp32.
        self.result_dtype = np.float64 if dtype == torch.float64 else np.float32
        parameters = inspect.signature(self.body.forward).parameters
        # transformers 5 renamed past_key_values to cache (the old name warns, then goes).
        self.cache_argument = "cache" if "cache" in parameters else "past_key_values"
        self.accepts_logits_to_keep = "logits_to_keep" in parameters
        # Gemma 4's KV-shared layers read the keys and values of earlier layers and write none, so a
        # prefill that keeps only the last position runs them on that position alone: for E2B, 20 of
        # 35 layers and ~69% of the body's FLOPs skipped for every prompt token but the last.
        self.prefill_skips_layers = (self.accepts_logits_to_keep
                                     and (getattr(config, "num_kv_shared_layers", 0) or 0) > 0)
        self.rope_length_limit = architecture.rope_length_limit(config)
        self.attention_cost = architecture.attention_cost(self.body)
        self.own_attention: str = config._attn_implementation  # as transformers loaded the model (it names one)
        # Whether the tree's full-attention layers attend over each row's context where it lies (cascade.py):
        # installed by use_cascade, only for a tree, and only where the load-time probe agrees.
        self.cascade = False
        self.oracle: probes.Oracle | None = None  # the probe by the model's own forward, taken before any change
        self.notes: list[str] = []  # the substitutes the load-time check dropped, one log line each
        self.rows_alone = False  # whether rows run whole one per batch: pads change the model's rows (probes.py)
        # Whether rows run whole go packed, end to end without pads (packing.py), and if not, why (the check's words).
        self.packed = False
        self.padded_why: str | None = "not checked"
        # Whether the tree's passes run packed (tree.py) and a streamed tree's levels layer-major in one group
        # (layered.py), until a call says otherwise (unpack_tree_passes, unlayer_tree); the verdict keeps its probe's.
        self.tree_passes_packed, self.tree_layered = True, True
        # Why each row runs alone, whole, by the model's own forward (probes.NOT_CAUSAL: every shortcut klpipe takes
        # assumes a causal forward; probes.NO_HEAD), or None: klpipe's body + head path, held to it at load.
        self.own_forward: str | None = None
        self._layer_kinds: list[LayerKind] | None = None
        self._cache_cost: CacheCost | None = None
        self.slow_kernels: tuple[str, ...] = ()  # packages transformers fell back without (see `load`)
        # The layers' norms and MLPs compiled (compiled.py, --compile), where the load-time probe agrees; None: eager.
        self.compiled: compiled.Compiled | None = None
        self.compile_seconds = 0.0  # the compile and its probe, at load
        if dtype == torch.float64:  # fp64 all the way through, not only the weights (the head: its setter)
            wide.install(self.model)
            wide.install(self.body)
        # LoRA adapters over these weights (lora.py), one active per side; None: the weights alone.
        self.adapters: lora.Adapters | None = None
        self.own_memo: dict = {}  # load-time probes' own-forward logprobs run ahead (probes.prefetch), until used
        self.probe_memo: dict = {}  # and klpipe's rows run whole ahead, up to the head (probe_group.Hidden)
        self.verdict = Verdict()  # what the load-time checks decided (verdict.py), as `apply` installed it
        self.verdict_reused = False  # whether it was remembered from an earlier run (checks.check) rather than checked
        self.recheck_why: str | None = None  # why a remembered verdict was not taken
        self.check_seconds = 0.0  # the load-time checks' time
        self.streamer: LayerMajor | None = None  # where the decoder layers stream from their files; None: in memory
        self.stream_tokens = options.streaming.tokens  # fed tokens a streamed layer-major group holds (None: a chunk)
        self.stream_cache_mib = options.cache_mib  # the tree cache the budget leaves; None: the option's

    @property
    def head(self):
        return self._head

    @head.setter
    def head(self, head) -> None:
        """The head, fp64 all the way through on an fp64 model: the one built here and any the checks put instead."""
        self._head = head
        if self.dtype == torch.float64:
            wide.install(head, "logprobs")

    @classmethod
    def load(cls, spec: ModelSpec, options: LoadOptions | None = None, **fields: Any) -> ReferenceModel:
        """Load `spec` safely (loading.py) and run the load-time checks (checks.py): the chunked head, padding,
        packing, each adapter's side against the model's own forward, and the layers' norms and MLPs compiled where
        --compile asks and the probe agrees; or the remembered verdict applied and held to a short probe.

        `options`: contract.LoadOptions (the adapters, streaming and its share of the budget, the verdict remembered),
        or its `fields` by name. Streamed, the decoder layers' weights stay in their files (layer_major.py)."""
        options = options if options is not None else LoadOptions(**fields)
        if options.streamed:
            from klpipe.model import streamed_load

            return streamed_load.reference(cls, spec, options)
        model, device, dtype, text_only = loading.load_model(spec)
        reference = cls(model, device, dtype, options=options)
        reference.adapters = (lora.attach(model, options.adapters, options.default, text_only=text_only)
                              if options.adapters else None)
        reference.run_checks(options.compile, options.remembered)
        return reference

    def run_checks(self, compile: str = "off", remembered=None) -> None:
        """The load-time checks (checks.py), or a remembered verdict confirmed; the packages transformers fell back
        without noted (see `kernel_note`)."""
        with loading.kernel_fallbacks() as missing:  # the first forward is where transformers says so
            checks.check(self, compile, remembered(self) if remembered is not None else None)
        self.slow_kernels = tuple(missing)

    def apply(self, verdict: Verdict) -> None:
        """Install what `verdict` says, the one place the load-time checks' decisions reach the model: its head, rows
        by the model's own forward or one a batch, packed or padded, the compiled modules kept, how the tree's passes
        ran on its probe, and the notes. The cascade is installed where a tree may run (use_cascade)."""
        self.own_forward, self.rows_alone = verdict.own_forward, verdict.rows_alone
        if (verdict.head == OWN) != isinstance(self.head, ModelHead):
            self.head = (ModelHead(self.model, self.body, self.device, self.chunked_head.logits_budget)
                         if verdict.head == OWN else self.chunked_head)
        self.packed, self.padded_why = verdict.packed, verdict.padded_why
        if architecture.text_config(self.model.config)._attn_implementation != self.attention_name:
            self.model.set_attn_implementation(self.attention_name)
        self.tree_passes_packed, self.tree_layered = verdict.tree_passes_packed, verdict.tree_layered
        if not verdict.compiled:
            self.drop_compile()
        else:
            if self.compiled is None:
                self.compiled = compiled.Compiled(checks.compile_targets(self))
            self.compiled.dropped |= {type(m).__name__ for _, m in self.compiled.modules} - set(verdict.compiled)
        self.notes = [*(self.adapters.notes if self.adapters is not None else ()), *verdict.notes]  # towers, checks
        self.verdict = verdict

    def side(self, name: str | None):
        """Within: forwards run with adapter `name` active (None: the weights alone); outside, the default side."""
        return self.adapters.use(name) if self.adapters is not None else nullcontext()

    def use_compile(self, mode: str, compiler=None) -> None:
        """Compile the decoder layers' norms and MLPs where `mode` asks and the probe agrees (checks.compiled_verdict);
        `compiler`: compiled.Compiled's (torch.compile with klpipe's options unless a test gives one)."""
        self.apply(checks.compiled_verdict(self, mode, self.verdict, compiler))

    def compile_modules(self, targets: list, compiler=None) -> None:
        """Compile `targets` (checks.compile_targets) for the probe to hold to the model's own forward."""
        self.compiled = compiled.Compiled(targets, compiler)

    def drop_compile(self) -> None:
        """Every compiled module eager again, for good."""
        if self.compiled is not None:
            self.compiled.remove()
            self.compiled = None

    @property
    def compile_note(self) -> str | None:
        """The log's line about what runs compiled, or None where nothing does."""
        if self.compiled is None or not self.compiled.classes:
            return None
        return (f"{type(self.model).__name__}: {', '.join(self.compiled.classes)} compiled (torch.compile) in "
                f"{self.compile_seconds:.1f}s, held to its own forward")

    @property
    def input_device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    def use_cascade(self) -> str | None:
        """Install the cascade attention for the prefix tree where it is known exact (cascade.enable) and the
        probe agrees with the model's own forward; None, or the line to log where the probe dropped it. The tree's
        attention layers (full and sliding) then attend over each row's context where it lies: on CPU under sdpa, in
        either layout, KV-shared layers through the keys of the layer they share."""
        if self.cascade or self.oracle is None:
            return None
        if self.verdict_reused and self.verdict.cascade is not None:  # the remembered verdict's
            if self.verdict.cascade and cascade.enable(self.model, architecture.text_config(self.model.config)):
                self.cascade = True
            return None
        if not cascade.enable(self.model, architecture.text_config(self.model.config)):
            return None
        self.cascade = True
        note = probes.check_attention(self, self.oracle)
        if note is not None:
            self.drop_cascade()
        self.verdict = self.verdict.but(cascade=self.cascade, notes=self.verdict.notes + ((note,) if note else ()))
        return note

    def settle_tree(self, probe) -> str | None:
        """Run the prefix tree's probe (`probe()`: None where the tree reproduces the model's own forward, else why
        not), or take what the remembered verdict says it found. Its finding joins the verdict, with what the probe
        changed (the cascade dropped, the tree's passes unpacked, rows padded): the checks' decisions, not the run's."""
        if self.verdict_reused and self.verdict.tree_probed:
            return self.verdict.tree
        noted, before = len(self.notes), (self.packed, self.padded_why)
        problem = probe()
        changed = ({"packed": self.packed, "padded_why": self.padded_why} if (self.packed, self.padded_why) != before
                   else {})
        self.verdict = self.verdict.but(
            tree_probed=True, tree=problem, cascade=self.cascade if self.verdict.cascade is not None else None,
            tree_passes_packed=self.tree_passes_packed, tree_layered=self.tree_layered,
            notes=self.verdict.notes + tuple(self.notes[noted:]), **changed)
        return problem

    def drop_cascade(self) -> None:
        """Give the model back its own attention implementation (packed rows' where they run)."""
        if self.cascade:
            self.cascade = False
            cascade.disable(self.model, self.attention_name)

    def drop_packing(self, why: str) -> None:
        """Rows run whole go padded from now on (an attention call packed rows cannot compute exactly), noted."""
        self.packed = False
        self.padded_why = why
        if not self.cascade:
            packing.disable(self.model, self.own_attention)
        self.notes.append(f"{type(self.model).__name__}: rows run whole go padded ({why})")

    def unpack_tree_passes(self) -> None:
        """The tree's passes run as batches from now on: a call the cascade cannot take packed (tree.py)."""
        self.tree_passes_packed = False

    def unlayer_tree(self) -> None:
        """A streamed tree runs in waves from now on: a layer reused keys layered.py had freed (cascade.FreedKeys)."""
        self.tree_layered = False

    @property
    def attention_name(self) -> str:
        """The attention implementation klpipe has installed: the cascade's, packed rows', or the model's own."""
        return cascade.NAME if self.cascade else packing.NAME if self.packed else self.own_attention

    def own_logprobs(self, rows: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
        """log p(response | prompt) by the model's own forward, as transformers loaded it: the oracle's path."""
        installed = self.attention_name
        if installed != self.own_attention:
            self.model.set_attn_implementation(self.own_attention)
        try:
            with self.eager():  # each row once (a streamed model's in one layer-major group: probes.own_rows)
                unique = {probes.row_key(row): row for row in rows}
                found = dict(zip(unique, probes.own_rows(self, list(unique.values())), strict=True))
                return [found[probes.row_key(row)] for row in rows]
        finally:
            if installed != self.own_attention:
                self.model.set_attn_implementation(installed)

    def eager(self):
        """Within: the compiled modules, if any, run their eager forward (the model's own, as loaded)."""
        return self.compiled.eager() if self.compiled is not None else nullcontext()

    @property
    def kernel_note(self) -> str | None:
        """One line for the log where a GPU runs hybrid layers in transformers' slow reference code."""
        if not self.slow_kernels or not str(self.device).startswith("cuda"):
            return None
        names = " and ".join(self.slow_kernels)
        return (f"{type(self.model).__name__}'s linear-attention, SSM or convolution layers run transformers' slow "
                f"reference code on this GPU: pip install {names} for its kernels")

    @property
    def layer_kinds(self):
        """How each decoder layer continues a prefix (continuation.layer_kinds); raises for a layout the tree does not
        know. Only the prefix tree asks: rows run whole need none of it."""
        if self._layer_kinds is None:
            from klpipe.model.attention.continuation import layer_kinds

            self._layer_kinds = layer_kinds(self.model)
        return self._layer_kinds

    @property
    def keeps_state(self) -> bool:
        """Some layer continues a prefix from a recurrent or convolution state, taken only at a pass's end."""
        return any(kind.continuation.state for kind in self.layer_kinds)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values a token holds across the layers that store them (measured once; at least 1)."""
        return max(self.measured_cost().kv_bytes_per_token, 1)

    @property
    def kv_layer_bytes_per_token(self) -> int:
        """The most bytes of keys and values a token holds in one layer (a layer-major tree pass holds a few)."""
        return max(self.measured_cost().kv_layer_bytes_per_token, 1)

    @property
    def state_tokens_per_node(self) -> int:
        """A node's recurrent and convolution states, in tokens' worth of keys and values (the cache budget's unit)."""
        cost = self.measured_cost()
        return -(-cost.state_bytes_per_node // self.kv_bytes_per_token)

    def measured_cost(self):
        if self._cache_cost is None:
            from klpipe.model.attention.context_cache import cache_cost

            self._cache_cost = cache_cost(self)
        return self._cache_cost

    @torch.inference_mode()
    def score_batch(self, rows: list[tuple[np.ndarray, np.ndarray]], temperature: float = 1.0,
                    needed: list[np.ndarray] | None = None, head=None, packed: bool | None = None) -> list[np.ndarray]:
        """log p(response[i] | prompt + response[:i]) for each (prompt_ids, response_ids) row, as float32.

        With `needed` (a bool per response token, per row), only the marked tokens' logprobs are
        computed, the others NaN: the body still reads every token up to the last marked one, but
        only the marked positions reach the LM head. `head` in place of the model's (a streamed check's, which keeps
        the hidden states: probe_group.py); `packed` the layout in place of the model's (a NotPacked then raised).
        """
        if needed is None:
            needed = [np.ones(len(r), dtype=bool) for _, r in rows]
        if self.own_forward is not None:
            return probes.own_logprobs(self.model, rows, temperature, needed, self.head.rows)
        if self.rows_alone and len(rows) > 1:
            return [self.score_batch([row], temperature, [need])[0] for row, need in zip(rows, needed, strict=True)]
        wanted = [np.flatnonzero(n) for n in needed]  # response indices to score
        # A response token is only ever a target after the last one scored: feed up to it, less it (plan.fed: a long
        # RoPE's row longer than its limit is fed whole, as its own forward's frequencies are the whole row's).
        inputs = [plan.fed(p, r, w, self.rope_length_limit) for (p, r), w in zip(rows, wanted, strict=True)]
        lengths = [len(x) for x in inputs]
        longest = max(lengths, default=0)
        results = [np.full(len(r), np.nan, dtype=self.result_dtype) for _, r in rows]
        if longest == 0:
            return results
        head = head or self.head
        if self.packed if packed is None else packed:
            try:
                return self.score_packed(rows, inputs, wanted, temperature, results, head)
            except packing.NotPacked as exc:
                if packed is not None or self.padded_why == packing.CHECKING or self.streamer is not None:
                    raise  # the load-time check decides, and says why; a streamed chunk's passes switch together
                self.drop_packing(str(exc))
        # Right padding: with causal attention no real token can see a pad, so no attention mask
        # is needed and position ids stay 0..n-1, exactly as in an unpadded single-row pass.
        batch = np.zeros((len(rows), longest), dtype=np.int64)
        for i, ids in enumerate(inputs):
            batch[i, : len(ids)] = ids
        input_ids = to_device(batch, self.input_device)
        hidden = self.body(input_ids=input_ids, use_cache=False).last_hidden_state  # (B, T, H)

        # Position prompt_len - 1 + j predicts response token j.
        positions = [len(p) - 1 + w for (p, _), w in zip(rows, wanted, strict=True)]
        targets = [r[w] for (_, r), w in zip(rows, wanted, strict=True)]
        scored = self.targets_logprobs(hidden, positions, targets, temperature, head=head)
        for values, w, out in zip(scored, wanted, results, strict=True):
            out[w] = values
        return results

    def score_packed(self, rows, inputs: list[np.ndarray], wanted: list[np.ndarray], temperature: float,
                     results: list[np.ndarray], head=None) -> list[np.ndarray]:
        """score_batch's rows end to end, one sequence with no pads (packing.py): raises packing.NotPacked where an
        attention call cannot take them exactly."""
        segments = packing.Rows([len(x) for x in inputs])
        device = self.input_device
        input_ids = torch.from_numpy(np.concatenate(inputs).astype(np.int64))[None].to(device)  # (1, N)
        position_ids = torch.from_numpy(segments.position_ids())[None].to(device)  # (1, N), restarting per row
        # A model whose masks are klpipe's builds none (packing.mask); transformers need not look for packed rows.
        maskless = getattr(architecture.text_config(self.model.config), "_attn_implementation", None) in (packing.NAME,
                                                                                                     cascade.NAME)
        with packing.packed(segments, maskless):
            hidden = self.body(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        # Row k's position prompt_len - 1 + j predicts its response token j: packed slot start_k + that.
        positions = [start + len(p) - 1 + w for start, (p, _), w in zip(segments.starts, rows, wanted, strict=True)]
        targets = [r[w] for (_, r), w in zip(rows, wanted, strict=True)]
        scored = self.targets_logprobs(hidden, positions, targets, temperature, packed=True, head=head)
        for values, w, out in zip(scored, wanted, results, strict=True):
            out[w] = values
        return results

    def targets_logprobs(self, hidden: torch.Tensor, positions: list[np.ndarray], targets: list[np.ndarray],
                         temperature: float, packed: bool = False, head=None) -> list[np.ndarray]:
        """Row k's logprobs of targets[k], predicted by hidden[k, positions[k]] (hidden[0, positions[k]] where
        `packed`: the rows lie end to end in one sequence).

        Only those positions reach the LM head, all rows' at once: (tokens, H), never (B, T, V).
        """
        row_index = np.concatenate([np.full(len(t), 0 if packed else k, dtype=np.int64)
                                    for k, t in enumerate(targets)])
        position = np.concatenate(positions).astype(np.int64)
        selected = hidden[to_device(row_index, hidden.device), to_device(position, hidden.device)]
        flat = torch.from_numpy(np.concatenate(targets).astype(np.int64))
        logprobs = (head or self.head).logprobs(selected, flat, temperature).numpy()
        return np.split(logprobs, np.cumsum([len(t) for t in targets])[:-1])

