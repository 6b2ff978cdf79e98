"""Which kernels a model's layers run on: one object all of its layers share, so a profiler or a test can
switch a whole model between torch's ops and the fused ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from services.worker import fused_ops

KernelChoice = Literal["torch", "library", "triton"]


@dataclass
class Kernels:
    """``ops``: the fused ops (the kernel library's on the CPU, Triton's on a GPU), None for torch's.
    ``whole_layers``: with the library's ops, a decode-only step runs each layer whose projections are
    all GGUF block layers as one call."""

    ops: fused_ops.FusedOps | None = None
    whole_layers: bool = True

    @classmethod
    def of(cls, choice: KernelChoice, kv: torch.Tensor, head_dim: int, hidden_act: str) -> Kernels:
        """The ops ``choice`` names, where they apply to this pool and model (else torch's)."""
        if choice == "library":
            return cls(fused_ops.load(kv, head_dim, hidden_act))
        if choice == "triton":
            from services.worker import triton_ops  # Triton comes with torch's CUDA builds, not its CPU ones

            return cls(triton_ops.load(kv, head_dim, hidden_act))
        return cls()
