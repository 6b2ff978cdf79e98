"""RMS norm, on the kernel library's op where it is loaded, and a projection whose output is normed."""

from __future__ import annotations

import torch

from services.worker.layers.kernels import Kernels
from services.worker.quantized import Linear


class RMSNorm:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last axis. A weight kept in a wider dtype than the
    activations (float32 for bfloat16 ones: an offset weight ``1 + w`` loses digits in bfloat16) norms in
    the weight's dtype, the result rounded once to the activations'."""

    def __init__(self, weight: torch.Tensor, eps: float, kernels: Kernels | None = None) -> None:
        """``kernels``: None keeps torch's op (for norms of shapes the library's op does not take)."""
        self.weight = weight
        self.eps = eps
        self.kernels = kernels
        self._shape = (weight.shape[0],)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype:
            return torch.rms_norm(x.to(self.weight.dtype), self._shape, self.weight, self.eps).to(x.dtype)
        if self.kernels is not None and self.kernels.ops is not None:
            return self.kernels.ops.rms_norm(x, self.weight, self.eps)
        return torch.rms_norm(x, self._shape, self.weight, self.eps)


class NormedOutput:
    """A projection whose output is RMS-normed before the residual add (a "sandwich" norm: Gemma's
    post-attention and post-feedforward norms). A :class:`~services.worker.quantized.Linear`."""

    def __init__(self, linear: Linear, norm: RMSNorm) -> None:
        self.linear, self.norm = linear, norm
        self.out_features = linear.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x))

    def add_to(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return x.add_(self(h))
