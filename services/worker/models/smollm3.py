"""SmolLM3: Llama's layers, every few of them without rotary (``no_rope_layers``: 1 where a layer rotates,
0 where it attends without positions)."""

from __future__ import annotations

from transformers import PreTrainedModel

from services.worker.kv_cache import PagedKVCache
from services.worker.layers.kernels import KernelChoice
from services.worker.layers.parallel import Shard
from services.worker.models import llama
from services.worker.models.family import Family
from services.worker.models.paged import PagedModel
from services.worker.quantized import LinearFactory


def build(model: PreTrainedModel, cache: PagedKVCache, max_positions: int, linears: LinearFactory | None = None,
          kernels: KernelChoice = "torch", shard: Shard | None = None) -> PagedModel:
    rotated = [bool(flag) for flag in model.config.no_rope_layers]
    return llama.build(model, cache, max_positions, linears, kernels, shard, rotated=rotated)


FAMILY = Family(model_types=("smollm3",), build=build)
