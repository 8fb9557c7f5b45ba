"""Tiny random models of the families issue-class bugs were found on, beyond the matrix (tests/architectures.py):
sparse attention that branches on the attention implementation's name (DeepSeek-V3.2), a head klpipe's chunked
head cannot reproduce (RecurrentGemma's `logits_soft_cap`), hybrids whose recurrent layers the tree cannot continue
(Jamba, Falcon-Mamba: Mamba-1; MiniMax: lightning attention), MLA with fewer key heads asked than query heads
(DeepSeek-V3). Built at test time from transformers' own config classes, nothing downloaded.
"""

from __future__ import annotations

from pathlib import Path

VOCAB = 512  # the sample tokenizer's
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0, bos_token_id=2, eos_token_id=1)
MLA = dict(kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=1,
           topk_group=1, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
           num_key_value_heads=4)  # MLA expands its latents to every query head

FAMILIES = {
    # index_topk 4: every query past its fourth key attends sparsely, so dense attention is far off. 32 indexer
    # heads, as the real model has 64: with few, ReLU leaves exact ties among key scores, and torch.topk breaks
    # them by the row's length, so that even the model's own logprobs of a row would move with its last token.
    "deepseek_v32": ("DeepseekV32Config", dict(num_hidden_layers=2, index_topk=4, index_n_heads=32, index_head_dim=16,
                                               **MLA)),
    "recurrent_gemma": ("RecurrentGemmaConfig", dict(
        num_hidden_layers=3, block_types=["recurrent", "recurrent", "attention"], lru_width=64,
        attention_window_size=16, num_key_value_heads=1, logits_soft_cap=8.0, head_dim=None)),
    "jamba": ("JambaConfig", dict(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                                  expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=8,
                                  mamba_d_conv=4, mamba_expand=2, use_mamba_kernels=False)),
    "falcon_mamba": ("FalconMambaConfig", dict(num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4,
                                               intermediate_size=None, num_attention_heads=None,
                                               num_key_value_heads=None, max_position_embeddings=None,
                                               use_mambapy=False)),
    "minimax": ("MiniMaxConfig", dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                                      num_local_experts=4, num_experts_per_tok=2, head_dim=16, block_size=16)),
    "deepseek_v3": ("DeepseekV3Config", dict(num_hidden_layers=2, **MLA)),
}


def config(name: str):
    import transformers

    class_name, fields = FAMILIES[name]
    return getattr(transformers, class_name)(**{k: v for k, v in {**COMMON, **fields}.items() if v is not None})


def save_family(name: str, directory: Path, seed: int = 0, scale: float = 4.0, head_scale: float = 4.0) -> Path:
    """A random tiny `name` model in `directory` as safetensors, with the sample tokenizer beside it; weights
    `scale` times transformers' initialisation (norms stay 1, the head `head_scale` times more), so that logprobs
    spread over nats."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.architectures import save_spread

    torch.manual_seed(seed)
    return save_spread(AutoModelForCausalLM.from_config(config(name)), directory, scale, head_scale)
