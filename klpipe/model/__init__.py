"""The reference model: the only package that imports torch and transformers.

loading.py    device, dtype, config, tokenizer and weights, loaded safely, and their fingerprints
architecture.py  where a model keeps its parts: text config, decoder body, a multimodal checkpoint's text part
head.py       the LM head on selected hidden states, fused over vocabulary blocks, fp32 online log-sum-exp
reference.py  ReferenceModel: rows in, response-token logprobs out
attention/    rows packed without pads, the prefix tree, exact attention over it (its own docstring)
probes.py     load-time checks: every substitute of klpipe's held against the model's own forward
checks.py     the checks in order, each deciding part of the Verdict (verdict.py), or a remembered one confirmed
lora.py       LoRA/DoRA adapters over the model's own weights, one active per side (the policy's, the reference's)
compiled.py   torch.compile of the decoder layers' norms and MLPs (--compile), held to the model's own forward
transfer.py   host ↔ device copies: pinned and non-blocking on CUDA
runtime.py    what the stage records and sizes from torch: the device's memory, the library versions
wide.py       fp64 all the way through (--dtype float64): every fp32 the model's code or klpipe's asks for made fp64
layer_major.py  a model larger than the memory budget: its decoder layers read one at a time, layer-major over passes
weight_store.py  the model built on meta, its layers' weights left in their safetensors files until asked for
table_rows.py / streamed_head.py  a streamed model's embedding tables and untied head read from their files by rows
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
