"""A mixture-of-experts MLP (Qwen3-MoE's): a router picks each row's top-k experts, each expert a gated
MLP; the rows of one expert run as one matmul pair (grouped by expert), and each row's expert outputs,
weighted by the router, are added in expert order (as transformers adds them, so the sums round alike).

On N ranks every expert's intermediate columns are split as a dense MLP's are (column-parallel gate|up,
row-parallel down); the routing is replicated, and the ranks' partial outputs are summed once per layer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from services.worker.layers.parallel import Shard, split


class ExpertsMLP:
    """``router`` ``[experts, hidden]``; ``gate_up`` ``[experts, 2 * intermediate, hidden]`` and ``down``
    ``[experts, hidden, intermediate]`` as transformers stores them (this rank's columns are taken here)."""

    def __init__(self, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int, norm_top_k: bool,
                 act: Callable[[torch.Tensor], torch.Tensor], shard: Shard) -> None:
        intermediate = down.shape[-1]
        c0, c1 = split(intermediate, shard.world, shard.rank)
        self.router_t = router.t().contiguous()
        # [experts, hidden, 2 * columns]: each expert's gate then up columns of this rank, x @ W
        self.gate_up_t = torch.cat((gate_up[:, c0:c1], gate_up[:, intermediate + c0 : intermediate + c1]), 1)
        self.gate_up_t = self.gate_up_t.transpose(1, 2).contiguous()
        self.down_t = down[:, :, c0:c1].transpose(1, 2).contiguous()  # [experts, columns, hidden]
        self.columns = c1 - c0
        self.top_k, self.norm_top_k, self.act = top_k, norm_top_k, act
        self.sharded = shard.world > 1

    def add_to(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``x`` plus the experts' weighted outputs for ``h``."""
        probs = F.softmax(h @ self.router_t, dim=-1, dtype=torch.float)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_top_k:
            weights /= weights.sum(dim=-1, keepdim=True)
        weights = weights.to(h.dtype).flatten()
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # the (row, choice) pairs grouped by expert, in expert order
        counts = torch.bincount(flat, minlength=self.router_t.shape[1]).tolist()
        out = torch.zeros_like(h)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                picked = order[start : start + count]
                rows = picked // self.top_k
                gate, up = (h[rows] @ self.gate_up_t[expert]).split(self.columns, dim=-1)
                y = (self.act(gate) * up) @ self.down_t[expert]
                out.index_add_(0, rows, y * weights[picked, None])
                start += count
        if self.sharded:
            dist.all_reduce(out)
        return x.add_(out)
