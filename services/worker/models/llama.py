"""Llama-shaped decoder layers: Llama (Llama 3.x rope scaling included: the rotary tables are the model's
own), Mistral (its sliding window included), Qwen2/2.5 (biased q|k|v; sliding layers where its
``layer_types`` say so) and SmolLM2. Each layer: RMS norm, fused q|k|v, rotary, paged attention, o (a residual add), RMS
norm, gated MLP (a residual add). Families of the same shape with a twist (per-head q/k norms, layers
without rotary, projections fused in the checkpoint) build on :func:`build` with its options.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from services.worker.gguf_linear import BlockLinear
from services.worker.kv_cache import PagedKVCache
from services.worker.layers.attention import PagedAttention, Rotary
from services.worker.layers.kernels import KernelChoice, Kernels
from services.worker.layers.mlp import GatedMLP
from services.worker.layers.norm import NormedOutput, RMSNorm
from services.worker.layers.parallel import Shard, column_parallel, row_parallel
from services.worker.layers.plan import StepPlan
from services.worker.models.family import Family
from services.worker.models.paged import PagedModel
from services.worker.quantized import DenseLinears, Linear, LinearFactory


class LlamaLayer:
    """One decoder layer (see the module docstring)."""

    def __init__(self, input_norm: RMSNorm, qkv: Linear, attention: PagedAttention, o: Linear, post_norm: RMSNorm,
                 mlp: GatedMLP | Mlp) -> None:
        self.input_norm, self.qkv, self.attention, self.o = input_norm, qkv, attention, o
        self.post_norm, self.mlp = post_norm, mlp
        self._width = attention.heads + 2 * attention.kv_heads

    def __call__(self, x: torch.Tensor, kv_slots: torch.Tensor, kv_blocks: torch.Tensor, step: StepPlan) -> torch.Tensor:
        qkv = self.qkv(self.input_norm(x)).view(x.shape[0], self._width, self.attention.head_dim)
        x = self.o.add_to(x, self.attention(qkv, kv_slots, kv_blocks, step))
        return self.mlp.add_to(x, self.post_norm(x))

    def projections(self) -> tuple[Linear, ...]:
        """q|k|v, o, and a dense MLP's gate|up and down."""
        mlp = (self.mlp.gate_up, self.mlp.down) if isinstance(self.mlp, GatedMLP) else ()
        return self.qkv, self.o, *mlp

    def block_weights(self) -> tuple | None:
        """The fused ``decode_layer`` op's weight arguments, where all four projections are GGUF
        block layers, the layer rotates and has no per-head norms (None: it cannot run as one call)."""
        if not isinstance(self.mlp, GatedMLP):
            return None
        qkv, o, gate_up, down = self.projections()
        if not (isinstance(qkv, BlockLinear) and isinstance(o, BlockLinear) and isinstance(gate_up, BlockLinear)
                and isinstance(down, BlockLinear)) or self.attention.q_norm is not None or not self.attention.rotates:
            return None
        return (self.input_norm.weight, self.post_norm.weight, self.input_norm.eps, qkv.records, qkv.code, qkv.bias,
                o.records, o.code, o.bias, gate_up.records, gate_up.code, self.mlp.intermediate, gate_up.bias,
                down.records, down.code, down.bias)

    def decode_whole(self, x: torch.Tensor, kv_blocks: torch.Tensor, step: StepPlan) -> torch.Tensor | None:
        ops, weights = self.attention.kernels.ops, self.block_weights()
        if ops is None or ops.decode_layer is None or weights is None or step.decode is None:
            return None
        tables, lengths = step.decode
        rotary = self.attention.rotary
        return ops.decode_layer(x, *weights, rotary.cos_table, rotary.sin_table, step.positions, self.attention.heads,
                                kv_blocks, step.slots, tables, lengths, self.attention.scale)


class Mlp(Protocol):
    def add_to(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``x`` plus this MLP of ``h``."""
        ...


Modules = tuple[list[nn.Linear], list[nn.Linear], list[nn.Linear], list[nn.Linear]]
# a family's MLP for the layers that are not a dense gated one (experts): (decoder layer, shard) -> it, or None
SparseMlp = Callable[[nn.Module, Shard], Mlp | None]


def llama_modules(layer: nn.Module) -> Modules:
    """A decoder layer's q|k|v, o, gate|up and down modules, each list fused into one projection."""
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj], [mlp.gate_proj, mlp.up_proj], [mlp.down_proj]


def build(model: PreTrainedModel, cache: PagedKVCache, max_positions: int, linears: LinearFactory | None = None,
          kernels: KernelChoice = "torch", shard: Shard | None = None, *, qk_norms: bool = False,
          modules: Callable[[nn.Module], Modules] = llama_modules, rotated: Sequence[bool] | None = None,
          sparse: SparseMlp | None = None, norm_offset: float = 0.0, sandwich_norms: bool = False,
          attention_scale: float | None = None, attention_softcap: float | None = None,
          rope_keys: Sequence[str] | None = None, embed_scale: float | None = None,
          logit_softcap: float | None = None) -> PagedModel:
    """The runner of a Llama-shaped ``model`` over ``cache``: its projections made by ``linears`` (default:
    the model's dense weights, fused), its other ops on ``kernels``, this rank's ``shard`` of every layer
    (default: the whole model). Options: ``qk_norms``, each attention has per-head q and k norms (Qwen3's);
    ``modules``, where a layer's projections are; ``rotated``, by layer, whether it applies rotary (all do
    by default); ``sparse``, the MLP of the layers that have experts instead of a gated MLP;
    ``norm_offset``, every norm scales by ``norm_offset + weight`` (Gemma's ``1 + w``, kept in float32);
    ``sandwich_norms``, the attention's and the MLP's outputs are normed too before their residual adds
    (``post_attention_layernorm``, ``post_feedforward_layernorm``; the MLP's input norm is then
    ``pre_feedforward_layernorm``); ``attention_scale`` and ``attention_softcap``, see
    :class:`~services.worker.layers.attention.PagedAttention`; ``rope_keys``, by layer, the ``layer_type``
    the model's rotary module makes that layer's table for (Gemma 3's local and global bases); ``embed_scale``
    and ``logit_softcap``, see :class:`~services.worker.models.paged.PagedModel`."""
    linears = linears or DenseLinears()
    config = model.config
    shard = shard or Shard.whole(config)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    eps = config.rms_norm_eps
    act_dtype = cache.kv.dtype  # the activations' (a bfloat16 checkpoint's tiles serve float32 ones)
    base = model.model
    windows = sliding_windows(config, max_positions)
    hidden_act = getattr(config, "hidden_act", None) or config.hidden_activation  # (Gemma's name for it)
    # the fused ops' attention reads every key in place and caps no logits: such a model runs torch's
    in_place = not any(windows) and attention_softcap is None
    chosen = Kernels.of(kernels, cache.kv, head_dim, hidden_act) if in_place else Kernels()
    rotaries = {key: Rotary(base.rotary_emb if key is None else partial(base.rotary_emb, layer_type=key), max_positions,
                            head_dim, act_dtype, cache.kv.device) for key in dict.fromkeys(rope_keys or [None])}
    act = F.silu if hidden_act == "silu" else base.layers[0].mlp.act_fn
    intermediate = config.intermediate_size

    def norm(module: torch.nn.Module, kernels: Kernels | None = chosen) -> RMSNorm:
        weight = module.weight.detach()
        return RMSNorm(weight.float() + norm_offset if norm_offset else weight.to(act_dtype), eps, kernels)

    def normed(linear: Linear, layer: nn.Module, name: str) -> Linear:
        """``linear``, its output normed by the layer's norm ``name`` where the layers have sandwich norms."""
        return NormedOutput(linear, norm(getattr(layer, name))) if sandwich_norms else linear

    layers = []
    for index, layer in enumerate(base.layers):
        attn = layer.self_attn
        q_norm, k_norm = (norm(attn.q_norm, None), norm(attn.k_norm, None)) if qk_norms else (None, None)
        experts = None if sparse is None else sparse(layer, shard)
        parts = modules(layer)
        qkv, o = linears.layer(parts[0]), linears.layer(parts[1])
        (h0, h1), (c0, c1) = shard.heads, shard.columns
        mlp = experts or GatedMLP(
            column_parallel(linears.layer(parts[2]), shard.gate_up_columns(intermediate), shard),
            normed(row_parallel(linears.layer(parts[3]), c0, c1, shard), layer, "post_feedforward_layernorm"),
            shard.intermediate, act, chosen)
        layers.append(LlamaLayer(
            input_norm=norm(layer.input_layernorm),
            qkv=column_parallel(qkv, shard.qkv_columns(heads, kv_heads, head_dim), shard),
            attention=PagedAttention(shard.num_heads, shard.num_kv_heads, head_dim,
                                     rotaries[None if rope_keys is None else rope_keys[index]], chosen, q_norm, k_norm,
                                     rotates=True if rotated is None else rotated[index], windowed=windows[index],
                                     scale=attention_scale, softcap=attention_softcap),
            o=normed(row_parallel(o, h0 * head_dim, h1 * head_dim, shard), layer, "post_attention_layernorm"),
            post_norm=norm(layer.pre_feedforward_layernorm if sandwich_norms else layer.post_attention_layernorm),
            mlp=mlp,
        ))
    if shard.world > 1:  # the transformers layers still point at the whole fused matrices: let them go
        for param in base.layers.parameters():
            param.data = param.data.new_empty(0)
    return PagedModel(cache, embed=base.embed_tokens.weight.detach().to(act_dtype), layers=layers,
                      final_norm=norm(base.norm), head=linears.head(model.get_output_embeddings()),
                      rotaries=list(rotaries.values()), heads=shard.num_heads, kv_heads=shard.num_kv_heads,
                      kernels=chosen, window=config.sliding_window if any(windows) else None, embed_scale=embed_scale,
                      logit_softcap=logit_softcap)


def sliding_windows(config: PretrainedConfig, max_positions: int) -> list[bool]:
    """By layer, whether it attends within ``config.sliding_window`` (as the transformers model does: the
    layers ``layer_types`` calls sliding, or every layer where the config has no layer types; none where
    ``use_sliding_window`` is off); a window that covers every position is no window."""
    window, layers = getattr(config, "sliding_window", None), config.num_hidden_layers
    if window is None or window >= max_positions or not getattr(config, "use_sliding_window", True):
        return [False] * layers
    types = getattr(config, "layer_types", None)
    return [t == "sliding_attention" for t in types] if types else [True] * layers


FAMILY = Family(model_types=("llama", "mistral", "qwen2"), build=build)
