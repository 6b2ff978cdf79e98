"""The gated MLP of Llama-shaped decoder layers: ``down(act(gate(x)) * up(x))``, gate|up one matmul."""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.worker.layers.kernels import Kernels
from services.worker.quantized import Linear


class GatedMLP:
    """``gate_up``: the fused gate|up projection (``2 * intermediate`` columns); ``act``: the gate's
    activation (the fused ops, which are loaded for SiLU models only, do it with the product)."""

    def __init__(self, gate_up: Linear, down: Linear, intermediate: int,
                 act: Callable[[torch.Tensor], torch.Tensor], kernels: Kernels) -> None:
        self.gate_up = gate_up
        self.down = down
        self.intermediate = intermediate
        self.act = act
        self.kernels = kernels

    def add_to(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``x`` plus the MLP of ``h`` (x is updated in place where the projection allows)."""
        ops = self.kernels.ops
        if ops is not None:
            h = ops.silu_mul(self.gate_up(h))
        else:
            gate, up = self.gate_up(h).view(-1, 2, self.intermediate).unbind(1)
            h = self.act(gate).mul_(up)
        return self.down.add_to(x, h)
