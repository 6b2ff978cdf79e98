"""Qwen3-MoE: Qwen3's attention (per-head q/k norms), and in most layers a mixture of experts
(:class:`services.worker.layers.moe.ExpertsMLP`) where Qwen3 has its gated MLP; the layers its config
lists in ``mlp_only_layers`` or skips by ``decoder_sparse_step`` keep a dense one. The experts stay dense
torch matmuls whatever ``TILLER_WEIGHTS`` says (the kernel packs linear modules only)."""

from __future__ import annotations

from functools import partial

import torch.nn.functional as F
from torch import nn

from services.worker.layers.moe import ExpertsMLP
from services.worker.layers.parallel import Shard
from services.worker.models import llama
from services.worker.models.family import Family


def _experts(layer: nn.Module, shard: Shard) -> ExpertsMLP | None:
    mlp = layer.mlp
    if not hasattr(mlp, "experts"):
        return None
    experts, router = mlp.experts, mlp.gate
    act = F.silu if layer.self_attn.config.hidden_act == "silu" else experts.act_fn
    return ExpertsMLP(router.weight.detach(), experts.gate_up_proj.detach(), experts.down_proj.detach(),
                      router.top_k, router.norm_topk_prob, act, shard)


def _modules(layer: nn.Module) -> llama.Modules:
    attn, mlp = layer.self_attn, layer.mlp
    dense = [[mlp.gate_proj, mlp.up_proj], [mlp.down_proj]] if hasattr(mlp, "gate_proj") else [[], []]
    return [attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj], dense[0], dense[1]


FAMILY = Family(model_types=("qwen3_moe",),
                build=partial(llama.build, qk_norms=True, modules=_modules, sparse=_experts))
