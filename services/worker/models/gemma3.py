"""Gemma 3 (text, ``Gemma3ForCausalLM``): Llama-shaped layers with Gemma's twists, all options of
:func:`services.worker.models.llama.build`: every norm scales by ``1 + w`` (in float32), each layer has four
(the attention's and the MLP's outputs are normed too before their residual adds), the queries and keys are
normed per head, the attention logits scaled by ``query_pre_attn_scalar ** -0.5``, the sliding layers
(``layer_types``) attend within the window and rotate with the local base, the full ones with the global
base (and its scaling), the embeddings are scaled by ``sqrt(hidden_size)`` (rounded to the embedding's
dtype, as transformers does) and the logits soft-capped where ``final_logit_softcapping`` is set (and the
attention logits where ``attn_logit_softcapping`` is). The MLP's activation (GELU) keeps it on torch's ops.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig, PreTrainedModel

from services.worker.kv_cache import PagedKVCache
from services.worker.layers.kernels import KernelChoice
from services.worker.layers.parallel import Shard
from services.worker.models import llama
from services.worker.models.family import Family
from services.worker.models.paged import PagedModel
from services.worker.quantized import LinearFactory


def build(model: PreTrainedModel, cache: PagedKVCache, max_positions: int, linears: LinearFactory | None = None,
          kernels: KernelChoice = "torch", shard: Shard | None = None, *, qk_norms: bool = True,
          rope_by_layer_type: bool = True) -> PagedModel:
    """Gemma's runner; ``qk_norms`` and ``rope_by_layer_type`` (a rotary base per layer type) are Gemma 3's."""
    config = model.config
    embed = model.model.embed_tokens.weight
    return llama.build(model, cache, max_positions, linears, kernels, shard, qk_norms=qk_norms, norm_offset=1.0,
                       sandwich_norms=True, attention_scale=config.query_pre_attn_scalar**-0.5,
                       attention_softcap=config.attn_logit_softcapping,
                       rope_keys=config.layer_types if rope_by_layer_type else None,
                       embed_scale=torch.tensor(config.hidden_size**0.5, dtype=embed.dtype).item(),
                       logit_softcap=config.final_logit_softcapping)


def unsupported(config: PretrainedConfig, max_model_len: int) -> str | None:
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention (use_bidirectional_attention: an embedding model's)"
    return None


FAMILY = Family(model_types=("gemma3_text",), build=build, unsupported=unsupported)
