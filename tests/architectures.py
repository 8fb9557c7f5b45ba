"""The architecture matrix: tiny random models of the families GRPO users train, built at test time from
transformers' own config classes (no weights committed, nothing downloaded).

Each entry is a config class and the few fields that make the model tiny while keeping what makes the
family itself: its layer kinds (sliding, chunked, KV-less, Gated DeltaNet, short convolutions, Mamba-2),
its RoPE, its MoE. `WINDOW` is every sliding window and attention chunk, so the agent rows' system
prompt (tests/model/test_architectures.py) is longer than all of them.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers import TINY_LLAMA

VOCAB = 512  # the sample tokenizer's
WINDOW = 16  # sliding windows, attention chunks
LONG_ROPE_LIMIT = 96  # Phi-3's original_max_position_embeddings: rows past it run whole, with each other
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0, bos_token_id=2,
              eos_token_id=1)
LINEAR_ATTENTION = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                        linear_value_head_dim=16, linear_conv_kernel_dim=4)


@dataclass(frozen=True)
class Architecture:
    config_class: str  # a transformers config class; AutoModelForCausalLM picks the model class
    fields: dict = field(default_factory=dict)  # beyond COMMON (None removes a COMMON field)
    what: str = ""  # what the family brings to the matrix
    slow: bool = True  # in `make test-arch` only; the fast ones run in `make test` too

    def config(self):
        import transformers

        fields = {k: v for k, v in {**COMMON, **self.fields}.items() if v is not None}
        return getattr(transformers, self.config_class)(**fields)


ARCHITECTURES = {
    "llama": Architecture("LlamaConfig", dict(num_hidden_layers=2, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}), "llama3 RoPE scaling", slow=False),
    "qwen3": Architecture("Qwen3Config", dict(num_hidden_layers=2), "QK norm"),
    "qwen3_moe": Architecture("Qwen3MoeConfig", dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=32), "MoE"),
    "qwen3_5": Architecture("Qwen3_5TextConfig", dict(
        num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"], **LINEAR_ATTENTION),
        "Gated DeltaNet + attention (3:1)", slow=False),
    "qwen3_next": Architecture("Qwen3NextConfig", dict(
        num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, **LINEAR_ATTENTION),
        "Gated DeltaNet + attention, MoE"),
    "lfm2": Architecture("Lfm2Config", dict(num_hidden_layers=4, layer_types=["conv", "full_attention"] * 2,
                                            conv_L_cache=3), "short convolutions + attention", slow=False),
    "nemotron_h": Architecture("NemotronHConfig", dict(
        num_hidden_layers=4, layers_block_type=["mamba", "attention", "mamba", "mlp"], mamba_num_heads=4,
        mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=16), "Mamba-2 + attention + MLP",
        slow=False),
    "falcon_h1": Architecture("FalconH1Config", dict(
        num_hidden_layers=2, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2,
        mamba_d_conv=4, mamba_chunk_size=16), "Mamba-2 and attention side by side in every layer"),
    "llama4": Architecture("Llama4TextConfig", dict(
        num_hidden_layers=4, intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=2, attention_chunk_size=WINDOW, no_rope_layers=[1, 1, 1, 0]),
        "chunked attention, NoPE layers, MoE", slow=False),
    "mistral": Architecture("MistralConfig", dict(num_hidden_layers=2, sliding_window=WINDOW), "sliding window"),
    "gemma3": Architecture("Gemma3TextConfig", dict(
        num_hidden_layers=3, sliding_window=WINDOW, layer_types=["sliding_attention"] * 2 + ["full_attention"],
        final_logit_softcapping=30.0, query_pre_attn_scalar=16), "sliding + full attention, softcap"),
    "gpt_oss": Architecture("GptOssConfig", dict(
        num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"]), "attention sinks, sliding window, MoE"),
    "phi3": Architecture("Phi3Config", dict(num_hidden_layers=2, max_position_embeddings=512, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
        "original_max_position_embeddings": LONG_ROPE_LIMIT}, original_max_position_embeddings=LONG_ROPE_LIMIT),
        "LongRoPE"),
    "deepseek_v3": Architecture("DeepseekV3Config", dict(
        num_hidden_layers=2, num_key_value_heads=4, head_dim=None, first_k_dense_replace=1, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32, kv_lora_rank=16, q_lora_rank=32,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16), "MLA (keys 24 wide, values 16), MoE"),
}
FAST = sorted(name for name, a in ARCHITECTURES.items() if not a.slow)
SLOW = sorted(name for name, a in ARCHITECTURES.items() if a.slow)


def save_tiny(name: str, directory: Path, seed: int = 0, scale: float = 4.0, head_scale: float = 4.0) -> Path:
    """A random tiny `name` model in `directory` as safetensors, with the sample tokenizer beside it.

    Its weights are `scale` times transformers' initialisation (norms stay 1; the LM head `head_scale`
    times more), so that logprobs spread over nats instead of sitting at log(1/V), where any computation
    would look right.
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return save_spread(AutoModelForCausalLM.from_config(ARCHITECTURES[name].config()), directory, scale, head_scale)


def save_spread(model, directory: Path, scale: float = 4.0, head_scale: float = 4.0) -> Path:
    """`model`'s weights times `scale` (norms stay 1; the LM head `head_scale` times more), saved in `directory`
    as safetensors with the sample tokenizer beside it."""
    import torch

    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if parameter.ndim >= 2 and "norm" not in parameter_name:
                parameter.mul_(scale)
        model.get_output_embeddings().weight.mul_(head_scale)
    model.save_pretrained(directory)
    for file in TOKENIZER_FILES:
        shutil.copy(TINY_LLAMA / file, directory / file)
    return directory
