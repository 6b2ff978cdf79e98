"""The kernel library's decoder-layer ops for float32 rows on the CPU (``gguf_kernel.cpp``).

A decode step of a small model at batch 1 is mostly op dispatch: torch's norms, rotation, KV write,
key gather, masked attention and activation are some twenty-five calls per layer, each a few
microseconds of overhead around a few hundred multiply-adds. These ops do the same in four:

* ``rms_norm(x, w, eps)``: ``x / sqrt(mean(x^2) + eps) * w`` by row;
* ``silu_mul(gate_up)``: ``silu(gate) * up`` of a fused gate|up projection;
* ``rope_store(qkv, cos, sin, positions, rotated, pool, slots)``: rotates the query and key heads of
  ``qkv`` in place (the tables laid out as :class:`services.worker.layers.attention.Rotary` makes
  them) and copies each row's keys and values to its slot of a layer's pool;
* ``decode_attention(q, blocks, tables, lengths, scale)``: the attention of one query row per
  sequence over its keys and values read from the pool's blocks in place, grouped-query;
* ``decode_layer(...)``: a whole decoder layer of decode rows whose projections are all GGUF block
  layers (:class:`services.worker.gguf_linear.BlockLinear`): the ops above and the block kernel's
  linear layers composed in C++, one call per layer.

They come with the GGUF block kernel's library (built by :mod:`services.worker.kernel_build`); where it
is not loaded, :func:`load` returns None and the forward stays on torch's ops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FusedOps:
    """The ops' overloads themselves (a call through the packet costs ~1.4 µs more)."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    rope_store: Callable[..., None]
    decode_attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
    decode_layer: Callable[..., torch.Tensor] | None  # None: no whole-layer op (the Triton ops)


def load(kv: torch.Tensor, head_dim: int, hidden_act: str) -> FusedOps | None:
    """The ops, where the library is loaded and they apply: a float32 CPU pool, head_dim a multiple
    of 16 up to 128, a SiLU-gated MLP. None: use torch's ops."""
    if kv.device.type != "cpu" or kv.dtype != torch.float32 or head_dim % 16 or head_dim > 128 or hidden_act != "silu":
        return None
    if not hasattr(torch.ops.tiller_gguf, "decode_layer"):
        return None
    ops = torch.ops.tiller_gguf
    return FusedOps(
        rms_norm=ops.rms_norm.default,
        silu_mul=ops.silu_mul.default,
        rope_store=ops.rope_store.default,
        decode_attention=ops.decode_attention.default,
        decode_layer=ops.decode_layer.default,
    )
