"""The reference model: the only package that imports torch and transformers.

It loads a model safely, checks at load time every path klpipe computes logprobs by against the model's own forward,
and runs a chunk's plan into response-token logprobs: rows whole, packed, or along the prefix tree (attention/), with
its weights in memory or streamed from their files a decoder layer at a time. docs/development.md maps the modules.
"""

from klpipe.model.loading import (
    ModelSpec,
    load_config,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    stop_token_ids,
    tokenizer_fingerprint,
    vocab_and_context,
    weights_fingerprint,
)
from klpipe.model.reference import ReferenceModel

__all__ = [
    "ModelSpec",
    "ReferenceModel",
    "load_config",
    "load_tokenizer",
    "resolve_device",
    "resolve_dtype",
    "stop_token_ids",
    "tokenizer_fingerprint",
    "vocab_and_context",
    "weights_fingerprint",
]
