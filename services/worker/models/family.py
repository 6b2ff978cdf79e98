"""What a model family file declares: the transformers ``model_type`` values it serves, how it builds a
runner, and which configurations of those types it cannot serve natively (and why)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transformers import PretrainedConfig

if TYPE_CHECKING:
    from services.worker.models.paged import PagedModel

# (model, cache, max_positions, linears, kernels, shard) -> the runner
Builder = Callable[..., "PagedModel"]


@dataclass(frozen=True)
class Family:
    model_types: tuple[str, ...]
    build: Builder
    unsupported: Callable[[PretrainedConfig, int], str | None]  # (config, max_model_len) -> why not, or None


def full_attention_only(config: PretrainedConfig, max_model_len: int) -> str | None:
    """Why a model whose layers attend over a sliding window shorter than the context cannot run on the
    paged attention, which attends over every earlier key (None: it attends fully, or the window covers
    the whole context)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    windowed = "sliding_attention" in layer_types if layer_types else True
    if window is not None and windowed and window < max_model_len:
        return f"sliding-window attention ({window} < max_model_len {max_model_len})"
    return None
