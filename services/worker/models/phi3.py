"""Phi-3: Llama's layers with q|k|v and gate|up fused in the checkpoint itself (``qkv_proj``, ``gate_up_proj``).
A partial rotary (``partial_rotary_factor`` below 1, Phi-4-mini's) is not served natively."""

from __future__ import annotations

from functools import partial

from torch import nn
from transformers import PretrainedConfig

from services.worker.models import llama
from services.worker.models.family import Family


def _modules(layer: nn.Module) -> llama.Modules:
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.qkv_proj], [attn.o_proj], [mlp.gate_up_proj], [mlp.down_proj]


def _unsupported(config: PretrainedConfig, max_model_len: int) -> str | None:
    factor = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
    if factor != 1.0:
        return f"partial rotary (partial_rotary_factor {factor})"
    return None


FAMILY = Family(model_types=("phi3",), build=partial(llama.build, modules=_modules), unsupported=_unsupported)
