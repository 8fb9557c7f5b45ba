"""Where a transformers model keeps its parts: the text config, the decoder body, a multimodal checkpoint's text
decoder and head, a module's dotted name, the position past which its RoPE changes.

Read off the model (or a copy on the meta device), never off a list of architectures, so a new family is found as
transformers itself finds it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from klpipe.errors import ModelError


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def rope_length_limit(config) -> int | None:
    """The position count past which the model's RoPE changes its frequencies, or None.

    transformers' dynamic and long RoPE pick their frequencies from the largest position id in the
    whole batch: a row past the limit changes every other row's logprobs, and a row below it
    computed beside one past it gets frequencies its own forward would not. Dynamic RoPE grows past
    max_position_embeddings (no valid row goes there; only a pad's position could), long RoPE past
    original_max_position_embeddings.
    """
    config = text_config(config)
    parameters = getattr(config, "rope_parameters", None) or {}
    per_layer_type = bool(parameters) and all(isinstance(v, dict) for v in parameters.values())
    limits = []
    for entry in (parameters.values() if per_layer_type else [parameters]):
        kind = str(entry.get("rope_type", "default"))
        if kind == "longrope":
            limits.append(int(entry.get("original_max_position_embeddings") or config.max_position_embeddings))
        elif "dynamic" in kind:
            limits.append(int(config.max_position_embeddings))
    return min(limits) if limits else None


def decoder_body(model):
    """The causal LM's decoder body (embeddings, layers, final norm), found as transformers finds it.

    `get_decoder()` first. Some causal LMs (Llama 4's) name a base-model prefix they do not have, so
    that both `get_decoder()` and `base_model` return the whole model, head included, and ModernBERT's
    names its LM head `decoder`; their body is then the one child model that holds the input embeddings.
    """
    from transformers import PreTrainedModel

    body = model.get_decoder()
    embeddings = model.get_input_embeddings()
    # ModernBERT's decoder LM names its head `decoder`, which get_decoder() then returns: a body holds the input
    # embeddings.
    if body is not model and any(m is embeddings for m in body.modules()):
        return body
    holders = [child for _, child in model.named_children()
               if isinstance(child, PreTrainedModel) and any(m is embeddings for m in child.modules())]
    if len(holders) != 1:
        raise ModelError(f"{type(model).__name__}: cannot tell its decoder body from its LM head")
    return holders[0]


@dataclass
class TextOnly:
    """How to load the text decoder and head of a multimodal checkpoint as a causal LM of its own."""

    causal_class: type  # the causal LM class of the text config (Gemma4ForCausalLM)
    text_config: object  # a copy of the checkpoint's text config, tied as the full model ties its head
    key_mapping: dict  # checkpoint key prefix -> the causal LM's (`model.language_model.` -> `model.`)
    skipped: set  # the checkpoint's keys outside the decoder and head: towers and their projectors
    towers: frozenset  # the full model's modules that hold them (`model.vision_tower`, `model.embed_audio`, ...)

    def outside(self, path: str) -> bool:
        """Whether `path` (a module, parameter or key of the full model) lies in a tower or projector: no part of
        the text model, and never run for text rows (the full model's forward runs them on images and audio)."""
        return any(path == tower or path.startswith(tower + ".") for tower in self.towers)

    def text_key(self, key: str) -> str:
        """`key` of the full model as the causal LM names it, renamed by `key_mapping` as transformers renames the
        checkpoint's keys (a key already in the causal LM's names, matching no prefix, unchanged)."""
        for pattern, target in self.key_mapping.items():
            key = re.sub(pattern, target, key, count=1)
        return key


def text_only(config) -> TextOnly | None:
    """The plan to load a `...ForConditionalGeneration` checkpoint's text part alone; None for any other.

    Where the full model keeps its decoder and head is read off an instance on the meta device (no
    memory), as is where the causal class keeps them; `key_mapping` renames the one to the other,
    and transformers reads a checkpoint tensor only once its renamed key is a parameter, so the
    towers' tensors are never read.
    """
    import copy

    import transformers
    from transformers import AutoModelForCausalLM

    text = text_config(config)
    architecture = (getattr(config, "architectures", None) or [""])[0]
    if text is config or not architecture.endswith("ForConditionalGeneration"):
        return None
    full_class = getattr(transformers, architecture, None)
    # One model class: transformers types the auto mappings' values as (slow, fast) pairs, as a tokenizer's are.
    causal_class: Any = AutoModelForCausalLM._model_mapping.get(type(text), None)
    if full_class is None or causal_class is None:
        return None
    text = copy.deepcopy(text)
    with torch.device("meta"):
        full = full_class._from_config(config)
    full_decoder, full_head = module_path(full, full.get_decoder()), module_path(full, full.get_output_embeddings())
    text.tie_word_embeddings = full.get_output_embeddings().weight is full.get_input_embeddings().weight
    kept = (full_decoder + ".", full_head + ".")
    skipped = {key for key in full.state_dict() if not key.startswith(kept)}
    # A tower: the outermost module of a skipped key off the way to the decoder and head (model.language_model).
    on_the_way = {prefix for path in (full_decoder, full_head) for prefix in _prefixes(path)}
    towers = frozenset(next(p for p in _prefixes(key) if p not in on_the_way) for key in skipped)
    del full
    with torch.device("meta"):
        causal = causal_class._from_config(text)
    causal_decoder = module_path(causal, causal.get_decoder())
    causal_head = module_path(causal, causal.get_output_embeddings())
    del causal
    mapping = {}
    for source, target in ((full_decoder, causal_decoder), (full_head, causal_head)):
        if source != target:
            mapping["^" + re.escape(source) + r"\."] = target + "."
    return TextOnly(causal_class, text, mapping, skipped, towers)


def _prefixes(path: str) -> list[str]:
    """`a.b.c` -> `a`, `a.b`, `a.b.c`: the modules on the way to `path`, outermost first."""
    parts = path.split(".")
    return [".".join(parts[:n]) for n in range(1, len(parts) + 1)]


def module_path(root, module) -> str:
    """The dotted name of `module` within `root`."""
    return next(name for name, sub in root.named_modules() if sub is module)


def attention_cost(body) -> float:
    """What attending to one more position costs a token, in fed tokens: the attention FLOPs per position
    over the linear FLOPs per token. About 5e-4 for the benchmarks' Llama (8 × 256), 1e-4 for Gemma 4 E2B.

    Scores and weighted values cost 4 × (query heads × head size) FLOPs per position and attention
    layer; a token's linear layers 2 × their weights. Queries are told apart by their projections:
    every attention layer has one named `q_proj`; a model with none is priced at 0 (length only).
    """
    linear = sum(m.weight.numel() for m in body.modules() if isinstance(m, torch.nn.Linear))
    queries = sum(m.out_features for name, m in body.named_modules()
                  if name.endswith("q_proj") and isinstance(m, torch.nn.Linear))
    return 4.0 * queries / (2.0 * linear) if linear else 0.0
