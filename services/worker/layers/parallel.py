"""Tensor parallelism as the layers see it (Megatron-style; the ranks' lockstep and transport are
:mod:`services.worker.tensor_parallel`'s).

Attention is split by key/value head groups: rank r holds the query heads of its KV heads, so a fused
q|k|v projection is column-parallel (each rank computes its own heads' queries, keys and values, and keeps
its own KV heads in its own paged cache) and the output projection row-parallel (each rank multiplies its
heads' attention output by its rows of ``o``; the partial sums are all-reduced before the residual add). A
gated MLP is split by intermediate columns the same way: gate|up column-parallel, down row-parallel.
Embeddings, norms and the LM head stay replicated. Uneven splits are allowed (SmolLM2-135M has 3 KV heads:
with 2 ranks, rank 0 holds 2 of them); more ranks than KV heads is refused. A model built with a one-rank
:class:`Shard` (:meth:`Shard.whole`) has plain projections: every family gets tensor parallelism by
building its projections through :func:`column_parallel` and :func:`row_parallel`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

from services.worker.quantized import Dense, Linear


def split(total: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, end)`` of part ``index`` when ``total`` items are cut into ``parts`` contiguous
    parts as evenly as possible (the first ones one larger)."""
    size, extra = divmod(total, parts)
    start = index * size + min(index, extra)
    return start, start + size + (1 if index < extra else 0)


@dataclass(frozen=True)
class Shard:
    """What one rank holds: query heads ``[heads)``, key/value heads ``[kv_heads)`` and MLP
    intermediate columns ``[columns)``."""

    rank: int
    world: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    columns: tuple[int, int]

    @classmethod
    def plan(cls, config: PretrainedConfig, rank: int, world: int) -> Shard:
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if world > kv_heads:
            raise ValueError(f"tensor parallel {world} needs at least {world} key/value heads; the model has {kv_heads}")
        group = heads // kv_heads
        k0, k1 = split(kv_heads, world, rank)
        return cls(rank, world, (k0 * group, k1 * group), (k0, k1), split(config.intermediate_size, world, rank))

    @classmethod
    def whole(cls, config: PretrainedConfig) -> Shard:
        """The one rank of a model that is not split."""
        return cls.plan(config, 0, 1)

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate(self) -> int:
        return self.columns[1] - self.columns[0]

    def qkv_columns(self, heads: int, kv_heads: int, head_dim: int) -> list[tuple[int, int]]:
        """This rank's output columns of a fused q|k|v projection of ``heads`` and ``kv_heads``."""
        (h0, h1), (k0, k1), dim = self.heads, self.kv_heads, head_dim
        return [(h0 * dim, h1 * dim), ((heads + k0) * dim, (heads + k1) * dim),
                ((heads + kv_heads + k0) * dim, (heads + kv_heads + k1) * dim)]

    def gate_up_columns(self, intermediate: int) -> list[tuple[int, int]]:
        """This rank's output columns of a fused gate|up projection."""
        c0, c1 = self.columns
        return [(c0, c1), (intermediate + c0, intermediate + c1)]


def column_parallel(linear: Linear, ranges: list[tuple[int, int]], shard: Shard) -> Linear:
    """Column-parallel: the given output column ranges of a dense layer (and its bias); the layer itself
    on one rank."""
    if shard.world == 1:
        return linear
    whole = _dense(linear)
    bias = None if whole.bias is None else _columns(whole.bias, ranges)
    return Dense(_columns(whole.weight_t, ranges), bias)


def row_parallel(linear: Linear, start: int, end: int, shard: Shard) -> Linear:
    """Row-parallel: rows ``[start, end)`` of a dense layer, summed over the ranks; the layer itself on
    one rank."""
    return linear if shard.world == 1 else RowParallel(_dense(linear), start, end)


def _dense(linear: Linear) -> Dense:
    if not isinstance(linear, Dense):
        raise TypeError("tensor parallel shards dense weights only (weights=fp32)")
    return linear


class RowParallel:
    """Rows ``[start, end)`` of a dense layer's ``[in, out]`` matrix: this rank's partial product,
    summed over the ranks; the bias is added once, after the sum."""

    def __init__(self, whole: Dense, start: int, end: int) -> None:
        self.weight_t = whole.weight_t[start:end].contiguous()
        self.bias = whole.bias
        self.out_features = whole.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.mm(x, self.weight_t)
        dist.all_reduce(out)
        return out if self.bias is None else out.add_(self.bias)

    def add_to(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self(h).add_(x)


def _columns(matrix: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """The given column ranges of ``matrix`` (the last axis), side by side, contiguous."""
    return torch.cat([matrix[..., a:b] for a, b in ranges], dim=-1).contiguous()
