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
    # (config, max_model_len) -> why the family cannot serve this configuration natively, or None
    unsupported: Callable[[PretrainedConfig, int], str | None] = lambda config, max_model_len: None
