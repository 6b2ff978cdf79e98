"""The per-step plan of the native forward: what all decoder layers of one step share.

Its own module so that the forward (:mod:`services.worker.paged_llama`) and the CUDA-graph replay
of its decode steps (:mod:`services.worker.cuda_graphs`) both build it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Prefill:
    """A multi-token input's attention plan: its rows, and for a continued sequence (``start > 0``)
    the blocks holding its keys and values and its causal mask; a fresh one attends to itself."""

    row: int
    n: int
    blocks: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass
class StepPlan:
    """Everything about one step that all layers share."""

    slots: torch.Tensor  # where each row's keys and values go
    # (blocks [n * width], mask [n, 1, 1, width * block_size]); fused: (tables [n, width], lengths [n])
    decode: tuple[torch.Tensor, torch.Tensor] | None
    num_decode: int
    prefills: list[Prefill]
    cos: torch.Tensor = field(init=False)  # the rotation's tables at each row's position (torch's ops)
    sin: torch.Tensor = field(init=False)
    positions: torch.Tensor = field(init=False)  # each row's position (the fused ops index the tables)
