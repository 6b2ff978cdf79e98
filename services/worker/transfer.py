"""Host values to device tensors without a host sync.

``torch.tensor(values, device="cuda")`` copies from pageable memory and then waits for the whole
stream, so every small index tensor built inside a step would stall the host until the GPU has
caught up. Staging through pinned memory (torch's caching host allocator, so no allocation per
call once warm) lets the copy be queued behind the work already in flight.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(
    values: Sequence[int] | Sequence[float] | Sequence[bool] | np.ndarray,
    device: torch.device,
    dtype: torch.dtype = torch.long,
) -> torch.Tensor:
    """``values`` as a ``dtype`` tensor on ``device``, queued (not waited for) on a GPU."""
    if device.type != "cuda":
        return torch.as_tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
