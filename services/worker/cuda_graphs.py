"""CUDA graphs of pure-decode steps for the native runner.

A decode step of a small model is a few hundred tiny kernels; launching them one by one from Python
costs far more than running them. A step whose inputs are all single tokens is therefore replayed
from a CUDA graph captured for its *bucket*: the batch padded up to a power of two and the block
tables padded to a power-of-two width, so a handful of graphs serve every batch. The worker
captures them all at start-up (:meth:`DecodeGraphs.capture_all`; a bucket missing then is captured
the first time it is needed); they share one memory pool (they never run concurrently, and each
keeps its own output alive).

Every step's inputs (token ids, positions, KV slots, lengths, block tables) are written into one
pinned host buffer and moved to the static device buffer the graphs read in a single asynchronous
copy. Padding rows feed token 0 at position 0, write their keys and values into slot 0 of the null
block (finite values: a gather that pads with the null block stays NaN-free) and attend to that
one slot.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.worker.kv_cache import NULL_BLOCK, PagedKVCache
from services.worker.runner import SeqInput
from services.worker.layers.plan import StepPlan, window_decode

# The forward captured: token ids, positions and the step plan -> float32 logits, one row per token.
DecodeForward = Callable[[torch.Tensor, torch.Tensor, StepPlan], torch.Tensor]


def _bucket(n: int) -> int:
    """The smallest power of two >= n."""
    return 1 << max(0, n - 1).bit_length()


class DecodeGraphs:
    """Captures and replays decode steps of ``forward`` over ``cache`` for up to ``max_batch``
    sequences whose block tables hold up to ``max_blocks`` blocks."""

    def __init__(
        self, forward: DecodeForward, cache: PagedKVCache, *, max_batch: int, max_blocks: int, in_place: bool = False,
        window: int | None = None,
    ) -> None:
        """``in_place``: the forward's attention reads the blocks in place (its decode plan is the
        block tables and lengths, not a flat gather and a key mask); ``window``: the sliding window of
        the model's windowed layers (never in place: the plan has their key mask too)."""
        self.forward = forward
        self.cache = cache
        self.block_size = cache.tables.block_size
        self.max_batch = _bucket(max_batch)
        self.max_width = _bucket(max_blocks)
        self.device = device = cache.kv.device
        self.in_place = in_place
        self.window = window
        # sections of the staging buffers: ids | positions | slots | lengths | block tables (row-major)
        n = self.max_batch
        self._sections = (0, n, 2 * n, 3 * n, 4 * n)
        size = 4 * n + n * self.max_width
        self._host = torch.zeros(size, dtype=torch.long, pin_memory=True)
        self._host_np = self._host.numpy()
        self._device = torch.zeros(size, dtype=torch.long, device=device)
        self._key_index = torch.arange(self.max_width * self.block_size, device=device)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: tuple[int, int] | None = None

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def fits(self, inputs: list[SeqInput]) -> bool:
        """Whether a step can be replayed: only single-token inputs that want logits, few enough."""
        if not inputs or len(inputs) > self.max_batch:
            return False
        return all(len(item.tokens) == 1 and item.logits for item in inputs) and (
            max(item.start for item in inputs) < self.max_width * self.block_size
        )

    def run(self, inputs: list[SeqInput]) -> torch.Tensor:
        """float32 logits ``[len(inputs), vocab]`` in input order. The tensor is the graph's static
        output: it is overwritten by the next replay, so use it before the next step."""
        n = len(inputs)
        batch = _bucket(n)
        tables = self.cache.tables
        bs = self.block_size
        width = _bucket(-(-max(item.start + 1 for item in inputs) // bs))
        key = (batch, width)
        if key not in self._graphs:
            self._capture(batch, width)
        ids_at, pos_at, slot_at, len_at, blocks_at = self._sections
        host = self._host_np
        host[ids_at : ids_at + batch] = 0
        host[pos_at : pos_at + batch] = 0
        host[slot_at : slot_at + batch] = NULL_BLOCK * bs
        host[len_at : len_at + batch] = 1
        host[blocks_at : blocks_at + batch * width] = NULL_BLOCK
        host[ids_at : ids_at + n] = [item.tokens[0] for item in inputs]
        host[pos_at : pos_at + n] = [item.start for item in inputs]
        host[len_at : len_at + n] = [item.start + 1 for item in inputs]
        slots = host[slot_at : slot_at + n]
        for i, item in enumerate(inputs):
            row = tables.seqs[item.seq_id]
            slots[i] = row[item.start // bs] * bs + item.start % bs
            used = -(-(item.start + 1) // bs)
            start = blocks_at + i * width
            host[start : start + used] = row[:used]
        used_size = blocks_at + batch * width
        self._device[:used_size].copy_(self._host[:used_size], non_blocking=True)
        graph, out = self._graphs[key]
        graph.replay()
        return out[:n]

    def capture_all(self) -> None:
        """Capture every (batch, width) bucket now, so that serving never stalls on a capture."""
        batch = 1
        while batch <= self.max_batch:
            width = 1
            while width <= self.max_width:
                if (batch, width) not in self._graphs:
                    self._capture(batch, width)
                width *= 2
            batch *= 2

    def _forward(self, batch: int, width: int) -> torch.Tensor:
        """The decode forward over the static buffers, as captured."""
        ids_at, pos_at, slot_at, len_at, blocks_at = self._sections
        buf = self._device
        lengths = buf[len_at : len_at + batch]
        blocks = buf[blocks_at : blocks_at + batch * width]
        if self.in_place:
            decode = (blocks.view(batch, width), lengths)
        else:
            keys = width * self.block_size
            decode = (blocks, (self._key_index[:keys] < lengths.unsqueeze(-1)).view(batch, 1, 1, keys))
        step = StepPlan(
            slots=buf[slot_at : slot_at + batch],
            decode=decode,
            num_decode=batch,
            prefills=[],
        )
        if self.window is not None:
            step.window_decode = window_decode(decode[1], lengths, self.window)
        return self.forward(buf[ids_at : ids_at + batch], buf[pos_at : pos_at + batch], step)

    def _capture(self, batch: int, width: int) -> None:
        """Capture the (batch, width) bucket. The staging buffer is first set to padding only, so
        the warm-up and capture runs write nowhere but the null block."""
        ids_at, pos_at, slot_at, len_at, blocks_at = self._sections
        self._device.zero_()
        self._device[slot_at : slot_at + self.max_batch].fill_(NULL_BLOCK * self.block_size)
        self._device[len_at : len_at + self.max_batch].fill_(1)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(batch, width)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._forward(batch, width)
        self._pool = graph.pool()
        self._graphs[(batch, width)] = (graph, out)

