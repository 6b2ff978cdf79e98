"""RMS norm, on the kernel library's op where it is loaded."""

from __future__ import annotations

import torch

from services.worker.layers.kernels import Kernels


class RMSNorm:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last axis."""

    def __init__(self, weight: torch.Tensor, eps: float, kernels: Kernels | None = None) -> None:
        """``kernels``: None keeps torch's op (for norms of shapes the library's op does not take)."""
        self.weight = weight
        self.eps = eps
        self.kernels = kernels
        self._shape = (weight.shape[0],)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and self.kernels.ops is not None:
            return self.kernels.ops.rms_norm(x, self.weight, self.eps)
        return torch.rms_norm(x, self._shape, self.weight, self.eps)
