"""The per-step plan of the native forward: what all decoder layers of one step share, and how it is made.

One step flattens every token of every sequence into rows. Decode rows are the tokens of single-token
inputs and of short ones (:data:`DECODE_ROWS_MAX`: a controller's splice); they attend all at once.
Longer inputs are prefills, attended one by one. The plan holds the index tensors (slots, block
tables, masks, the steered rows and their deltas) that every layer uses, built once. Its own module so
that the models (:mod:`services.worker.models`) and the CUDA-graph replay of their decode steps
(:mod:`services.worker.cuda_graphs`) both use it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.worker.kv_cache import NULL_BLOCK, PagedKVCache
from services.worker.layers.steering import LayerAdds, plan_rows
from services.worker.runner import SeqInput
from services.worker.transfer import to_device

# Inputs of at most this many tokens (a decode token, a controller's splice, a short turn) run as decode
# rows, one per token, each attending to the keys up to its own: every row's keys and values are written
# before any row attends, so row j of an input sees the rows before it. That keeps a step that carries a
# splice on the decode path (a whole layer per call on GGUF weights). Each row reads its context again, so
# longer inputs go as prefills: about 16 tokens is where the two ways cost the same on the CPU kernel
# (deploy/loadtest/splice_bench.py).
DECODE_ROWS_MAX = 16


@dataclass
class Prefill:
    """A multi-token input's attention plan: its rows, and for a continued sequence (``start > 0``)
    the blocks holding its keys and values and its causal mask; a fresh one attends to itself."""

    row: int
    n: int
    blocks: torch.Tensor | None
    mask: torch.Tensor | None
    window_mask: torch.Tensor | None = None  # the causal mask within a sliding window (models that have one)


@dataclass
class StepPlan:
    """Everything about one step that all layers share."""

    slots: torch.Tensor  # where each row's keys and values go
    # (blocks [n * width], mask [n, 1, 1, width * block_size]); fused: (tables [n, width], lengths [n])
    decode: tuple[torch.Tensor, torch.Tensor] | None
    num_decode: int
    prefills: list[Prefill]
    window_decode: torch.Tensor | None = None  # the decode rows' key mask within a sliding window
    steering: LayerAdds = field(default_factory=dict)  # what is added to the rows after each layer (steering)
    # by rotary table (:class:`services.worker.layers.attention.Rotary`): its cos and sin at each row's
    # position (torch's ops)
    rotations: dict[object, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    positions: torch.Tensor = field(init=False)  # each row's position (the fused ops index the tables)


@dataclass
class StepRows:
    """One step's rows: the token ids and positions fed, the plan, and where each input's rows are."""

    ids: list[int]
    positions: list[int]
    plan: StepPlan
    first_row: list[int]  # by input: its first row
    last_row: list[int]  # by input: its last row (whose logits it samples from)


def plan_step(inputs: list[SeqInput], cache: PagedKVCache, in_place: bool, window: int | None = None) -> StepRows:
    """Lay ``inputs`` out as rows (short ones first, as decode rows of one batch; longer ones after, one
    by one), zero the fresh blocks they write, and plan the attention. ``in_place``: the decode rows'
    attention reads the blocks in place (the fused ops), so its plan is tables and lengths. ``window``: the
    model's sliding window, for the masks of its windowed layers (a query at q sees the keys after
    ``q - window``, as transformers' sliding-window masks do); never in place."""
    assert window is None or not in_place, "the in-place decode attention has no window"
    tables, device = cache.tables, cache.kv.device
    order = sorted(range(len(inputs)), key=lambda i: len(inputs[i].tokens) > DECODE_ROWS_MAX)
    decode = [(item.seq_id, item.start + j + 1) for item in (inputs[i] for i in order)
              if len(item.tokens) <= DECODE_ROWS_MAX for j in range(len(item.tokens))]
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    last_row = [0] * len(inputs)
    first_row = [0] * len(inputs)
    prefills: list[Prefill] = []
    fresh: list[int] = []
    bs = tables.block_size
    for i in order:
        item = inputs[i]
        n, row = len(item.tokens), len(ids)
        fresh += tables.seqs[item.seq_id][-(-item.start // bs) : -(-(item.start + n) // bs)]
        ids += item.tokens
        positions += range(item.start, item.start + n)
        slots += tables.slots(item.seq_id, item.start, item.start + n)
        last_row[i] = row + n - 1
        first_row[i] = row
        if n > DECODE_ROWS_MAX:
            prefills.append(_plan_prefill(cache, item, row, window))
    if fresh:
        cache.zero_blocks(fresh)
    plan = StepPlan(
        slots=to_device(slots, device),
        decode=_plan_decode(cache, decode, in_place) if decode else None,
        num_decode=len(decode),
        prefills=prefills,
        steering=plan_rows(inputs, first_row, device),
    )
    if window is not None and plan.decode is not None:
        plan.window_decode = window_decode(plan.decode[1], to_device([length for _, length in decode], device), window)
    return StepRows(ids, positions, plan, first_row, last_row)


def window_decode(mask: torch.Tensor, lengths: torch.Tensor, window: int) -> torch.Tensor:
    """The decode rows' key ``mask`` ``[n, 1, 1, keys]`` within a sliding ``window``: each row (``lengths``,
    the keys it attends to) sees its last ``window`` keys."""
    first = (lengths - window).view(-1, 1, 1, 1)  # each row's first key inside the window
    return mask & (torch.arange(mask.shape[-1], device=mask.device) >= first)


def _plan_decode(cache: PagedKVCache, decode: list[tuple[int, int]], in_place: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """For decode rows ``(seq_id, keys it attends to)``: their block tables, padded to the longest
    with the (zeroed) null block, flattened for one gather; and the key mask ``[n, 1, 1, blocks *
    block_size]``. Always a mask, even where all rows have one length: attention over exactly that
    many keys and no mask differs from this in the last bit, enough to flip a near-tie.
    In place: the tables ``[n, blocks]`` and each row's keys ``[n]``."""
    tables, device = cache.tables, cache.kv.device
    bs = tables.block_size
    width = -(-max(length for _, length in decode) // bs)
    rows = [tables.seqs[seq_id][:width] for seq_id, _ in decode]
    blocks = to_device([r + [NULL_BLOCK] * (width - len(r)) for r in rows], device)
    lengths = to_device([length for _, length in decode], device)
    if in_place:
        return blocks, lengths
    valid = torch.arange(width * bs, device=device) < lengths.unsqueeze(-1)
    return blocks.view(-1), valid.view(len(decode), 1, 1, width * bs)


def _plan_prefill(cache: PagedKVCache, item: SeqInput, row: int, window: int | None) -> Prefill:
    n = len(item.tokens)
    device = cache.kv.device
    total = item.start + n
    query_pos = torch.arange(item.start, total, device=device).unsqueeze(-1)
    if item.start == 0:  # it attends to its own rows: causal, and a mask only within a window
        keys = torch.arange(n, device=device)
        windowed = None if window is None else (keys <= query_pos) & (keys > query_pos - window)
        return Prefill(row=row, n=n, blocks=None, mask=None, window_mask=windowed)
    bs = cache.tables.block_size
    blocks = cache.tables.seqs[item.seq_id][: -(-total // bs)]
    keys = torch.arange(len(blocks) * bs, device=device)
    mask = keys <= query_pos
    windowed = None if window is None else mask & (keys > query_pos - window)
    return Prefill(row=row, n=n, blocks=to_device(blocks, device), mask=mask, window_mask=windowed)
