"""Rotary position embedding, the KV write and attention over the paged pool.

A layer's fused q|k|v projection is viewed as ``[tokens, heads + 2 * kv_heads, head_dim]``: the query
and key heads are rotated (and, for families that have them, normed per head first), the key and value
heads written to each row's slot of the layer's pool, then attention runs for all decode rows at once,
over a padded gather of their cached keys and values (or, on the fused ops, read from the blocks in
place), and per prefill. Grouped-query attention never repeats the key heads, except in a prefill whose
attention logits are soft-capped (Gemma 2's): torch's fused attention has no cap, so that one runs as plain
matmuls, the key heads repeated for the query heads of their group.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from services.worker.layers.kernels import Kernels
from services.worker.layers.norm import RMSNorm
from services.worker.layers.plan import StepPlan


# a model's rotary module: (a tensor of the activations' dtype, positions [1, n]) -> cos, sin [1, n, head_dim]
RotaryModule = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class Rotary:
    """cos and sin tables ``[max_positions, head_dim]`` computed once from the model's own rotary module
    (so every rope variant transformers knows, Llama 3's scaling included, comes as the model defines it),
    with sin laid out so that ``rotate_half(x) * sin`` becomes ``roll(x, half) * [-sin_1, sin_2]``. A model
    whose layers rotate with different bases (Gemma 3's local and global layers) has one per base."""

    def __init__(self, rotary: RotaryModule, max_positions: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        probe = torch.zeros(1, dtype=dtype, device=device)
        positions = torch.arange(max_positions, device=device).unsqueeze(0)
        cos, sin = rotary(probe, positions)
        half = head_dim // 2
        self.cos_table = cos[0].contiguous()
        self.sin_table = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1).contiguous()

    def prepare(self, step: StepPlan, positions: torch.Tensor, heads: int, kv_heads: int, fused: bool) -> None:
        """Give ``step`` what the layers rotate with: the rows' positions (the fused op indexes the tables),
        or this table's cos and sin ``[tokens, heads + 2 * kv_heads, head_dim]`` for rotating a whole q|k|v
        projection at once, the value heads getting cos 1, sin 0 (left as they are)."""
        if fused:
            step.positions = positions
            return
        cos = self.cos_table.index_select(0, positions).unsqueeze(1)
        sin = self.sin_table.index_select(0, positions).unsqueeze(1)
        tokens, rotated = positions.shape[0], heads + kv_heads
        shape = (tokens, kv_heads, cos.shape[-1])
        step.rotations[self] = (torch.cat((cos.expand(tokens, rotated, -1), cos.new_ones(shape)), dim=1),
                                torch.cat((sin.expand(tokens, rotated, -1), sin.new_zeros(shape)), dim=1))


class PagedAttention:
    """One layer's attention over its slice of the paged pool (``heads`` and ``kv_heads``: this rank's)."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, rotary: Rotary, kernels: Kernels,
                 q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None, rotates: bool = True,
                 windowed: bool = False, scale: float | None = None, softcap: float | None = None) -> None:
        """``q_norm``, ``k_norm``: per-head norms before the rotation; ``rotates``: False for a layer that
        applies no rotary (its keys are stored as they come); ``windowed``: the layer attends within the
        model's sliding window (the step plan's window masks), never in place; ``scale``: of the attention
        logits (default ``head_dim ** -0.5``); ``softcap``: the logits become ``softcap * tanh(logits /
        softcap)`` before the mask and the softmax, never in place."""
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.softcap = softcap
        self.rotary = rotary
        self.rotates = rotates
        self.windowed = windowed
        self.kernels = kernels
        self.q_norm, self.k_norm = q_norm, k_norm

    def __call__(self, qkv: torch.Tensor, kv_slots: torch.Tensor, kv_blocks: torch.Tensor,
                 step: StepPlan) -> torch.Tensor:
        """The attention output ``[tokens, heads * head_dim]`` of the projection ``qkv``
        ``[tokens, heads + 2 * kv_heads, head_dim]``; writes this step's keys and values into the layer's
        pool (``kv_slots`` and ``kv_blocks`` are two views of it)."""
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        if self.q_norm is not None and self.k_norm is not None:
            qkv[:, :heads] = self.q_norm(qkv[:, :heads])
            qkv[:, heads : heads + kv_heads] = self.k_norm(qkv[:, heads : heads + kv_heads])
        ops = self.kernels.ops
        if ops is not None:
            ops.rope_store(qkv, self.rotary.cos_table, self.rotary.sin_table, step.positions,
                           heads + kv_heads if self.rotates else 0, kv_slots, step.slots)
        else:
            if self.rotates:
                cos, sin = step.rotations[self.rotary]
                qkv = torch.addcmul(qkv * cos, qkv.roll(dim // 2, -1), sin)
            kv_slots.index_copy_(0, step.slots, qkv[:, heads:])

        outs: list[torch.Tensor] = []
        if step.decode is not None and ops is not None:
            tables, lengths = step.decode
            q = qkv[: step.num_decode, :heads]
            outs.append(ops.decode_attention(q, kv_blocks, tables, lengths, self.scale))
        elif step.decode is not None:
            blocks, mask = step.decode
            if self.windowed:
                mask = step.window_decode
            n = step.num_decode
            # Grouped-query attention without repeating keys: [n, kv_heads, heads/kv_heads, dim].
            q = qkv[:n, :heads].reshape(n, kv_heads, heads // kv_heads, dim)
            kv = kv_blocks.index_select(0, blocks).view(n, mask.shape[-1], 2 * kv_heads, dim)
            k, v = kv[:, :, :kv_heads].transpose(1, 2), kv[:, :, kv_heads:].transpose(1, 2)
            outs.append(self._attend(q, k, v, mask, gqa=False).reshape(n, heads * dim))
        for p in step.prefills:
            q = qkv[p.row : p.row + p.n, :heads].transpose(0, 1).unsqueeze(0)
            if p.blocks is None:
                kv = qkv[p.row : p.row + p.n, heads:]
            else:
                kv = kv_blocks.index_select(0, p.blocks).view(-1, 2 * kv_heads, dim)
            k, v = kv[:, :kv_heads].transpose(0, 1).unsqueeze(0), kv[:, kv_heads:].transpose(0, 1).unsqueeze(0)
            mask = p.window_mask if self.windowed else p.mask
            out = self._attend(q, k, v, mask, gqa=True)
            outs.append(out[0].transpose(0, 1).reshape(p.n, heads * dim))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                gqa: bool) -> torch.Tensor:
        """Attention of ``q`` ``[..., heads, n, dim]`` over ``k`` and ``v`` ``[..., kv_heads, keys, dim]``
        under the boolean ``mask`` (None: causal); ``gqa``: ``heads`` may be a multiple of ``kv_heads`` (else
        they are equal)."""
        if self.softcap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale,
                                                  enable_gqa=gqa)
        group = q.shape[-3] // k.shape[-3]
        if group > 1:
            k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
        logits = torch.tanh(q @ k.transpose(-1, -2) * self.scale / self.softcap) * self.softcap
        if mask is None:
            n, keys = logits.shape[-2:]
            mask = torch.ones(n, keys, dtype=torch.bool, device=q.device).tril(keys - n)
        weights = logits.masked_fill(~mask, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
        return weights @ v
