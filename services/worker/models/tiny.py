"""Small configs of every native family (and the variants worth checking), for random-weight tests and
benchmarks: nothing downloaded. Not a family file (it defines no ``FAMILY``)."""

from __future__ import annotations

from transformers import (Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, PretrainedConfig,
                          Qwen2Config, Qwen3Config, Qwen3MoeConfig, SmolLM3Config)

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 10000.0}
# soft caps of a Gemma's logits and attention logits small enough to bend those of random weights
GEMMA_LOGIT_CAP, GEMMA_ATTENTION_CAP = 1.0, 0.25
# Gemma 3's local and global bases, the global one scaled (as its 4B and larger checkpoints are)
GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}}


def tiny_configs(hidden: int = 64, layers: int = 3, heads: int = 4, kv_heads: int = 2, vocab: int = 512,
                 window: int = 8) -> dict[str, PretrainedConfig]:
    """By name, a config of each family (and of Llama 3's rope scaling and of sliding windows) at these
    sizes; the MLP is twice ``hidden`` wide, a Qwen3-MoE's experts half of it."""
    head_dim = hidden // heads
    gemma_layers = ["full_attention" if i % 3 == 2 else "sliding_attention" for i in range(layers)]
    small = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                 num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256)
    return {
        "llama": LlamaConfig(**small),
        "llama3-rope": LlamaConfig(**small, rope_parameters=LLAMA3_ROPE),  # positions past 32 see the scaled bands
        "mistral": MistralConfig(**small, sliding_window=None),
        "mistral-window": MistralConfig(**small, sliding_window=window),  # every layer within the window
        "qwen2": Qwen2Config(**small),  # q/k/v biases
        "qwen2-window": Qwen2Config(**small, use_sliding_window=True, sliding_window=window, max_window_layers=1),
        "qwen3": Qwen3Config(**small, head_dim=head_dim),  # per-head q/k norms
        "smollm3": SmolLM3Config(**small, no_rope_layers=[int(i % 2 == 0) for i in range(layers)], pad_token_id=0),
        "phi3": Phi3Config(**small, pad_token_id=0, bos_token_id=1, eos_token_id=2),  # q|k|v, gate|up fused
        # 8 experts, 2 a token, and its first layer a dense MLP
        "qwen3-moe": Qwen3MoeConfig(**small, head_dim=head_dim, num_experts=8, num_experts_per_tok=2,
                                    moe_intermediate_size=hidden // 2, norm_topk_prob=True, mlp_only_layers=[0]),
        # sliding layers then a full one (Gemma's pattern, shortened), an attention scale other than head_dim's
        "gemma3": Gemma3TextConfig(**small, head_dim=head_dim, layer_types=gemma_layers, sliding_window=window,
                                   rope_parameters=GEMMA3_ROPE, query_pre_attn_scalar=head_dim + 8,
                                   final_logit_softcapping=GEMMA_LOGIT_CAP),
        "gemma2": Gemma2Config(**small, head_dim=head_dim, layer_types=gemma_layers, sliding_window=window,
                               query_pre_attn_scalar=head_dim + 8, attn_logit_softcapping=GEMMA_ATTENTION_CAP,
                               final_logit_softcapping=GEMMA_LOGIT_CAP),
    }
