"""Tensor parallelism on torch.distributed: one worker made of N ranks on one host.

Sharding (Megatron-style). Attention is split by key/value head groups: rank r holds the query
heads of its KV heads, so the fused q|k|v projection is column-parallel (each rank computes its
own heads' queries, keys and values, and keeps its own KV heads in its own paged cache) and the
output projection is row-parallel (each rank multiplies its heads' attention output by its rows
of ``o``; the partial sums are all-reduced before the residual add). The MLP is split by
intermediate columns the same way: gate|up column-parallel, down row-parallel, one all-reduce.
Embeddings, norms and the LM head stay replicated, so every rank ends a step with the same
hidden states and the same logits. Uneven splits are allowed (SmolLM2-135M has 3 KV heads: with
2 ranks, rank 0 holds 2 of them); more ranks than KV heads is refused.

Lockstep. Rank 0 alone talks to the scheduler. It sends every frame it runs (a Step and its mask
frame, a StepMasks, or a :class:`common.wire.StepAbandon`) to the other ranks before running it;
each rank runs the same :class:`services.worker.engine.Engine` calls on the same frames, so block
tables, prefix caches, sampling generators and last samples stay identical on every rank without
further messages. Only rank 0's results go back.

Transport. The all-reduces run on the default process group (gloo on the CPU, NCCL on GPUs); the
frames go over a gloo group (a length tensor, then the bytes), on the CPU and on GPUs alike.
Ranks 1..N-1 are child processes of rank 0 (``python -m services.worker.tensor_parallel``); they
exit when a collective fails, i.e. when rank 0 is gone.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta

import structlog
import torch
import torch.distributed as dist
from transformers import PretrainedConfig, PreTrainedModel

from common import wire
from common.config import Settings, get_settings
from common.logging import configure_logging
from services.worker.kv_cache import PagedKVCache
from services.worker.paged_llama import PagedLlama, _Layer
from services.worker.quantized import Dense, Linear

log = structlog.get_logger()

# A rank idles in a broadcast until the next step: any finite wait would end an idle worker.
IDLE_TIMEOUT = timedelta(days=365)


def split(total: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, end)`` of part ``index`` when ``total`` items are cut into ``parts`` contiguous
    parts as evenly as possible (the first ones one larger)."""
    size, extra = divmod(total, parts)
    start = index * size + min(index, extra)
    return start, start + size + (1 if index < extra else 0)


@dataclass(frozen=True)
class Shard:
    """What one rank holds: query heads ``[heads)``, key/value heads ``[kv_heads)`` and MLP
    intermediate columns ``[columns)``."""

    rank: int
    world: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    columns: tuple[int, int]

    @classmethod
    def plan(cls, config: PretrainedConfig, rank: int, world: int) -> Shard:
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if world > kv_heads:
            raise ValueError(f"tensor parallel {world} needs at least {world} key/value heads; the model has {kv_heads}")
        group = heads // kv_heads
        k0, k1 = split(kv_heads, world, rank)
        return cls(rank, world, (k0 * group, k1 * group), (k0, k1), split(config.intermediate_size, world, rank))

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]


class TensorParallelLlama(PagedLlama):
    """:class:`PagedLlama` over one rank's shard of every decoder layer (see the module docstring)."""

    def __init__(self, model: PreTrainedModel, cache: PagedKVCache, max_positions: int, shard: Shard) -> None:
        super().__init__(model, cache, max_positions)
        heads, kv_heads, dim, inter = self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate
        (h0, h1), (k0, k1), (c0, c1) = shard.heads, shard.kv_heads, shard.columns
        qkv_cols = [(h0 * dim, h1 * dim), ((heads + k0) * dim, (heads + k1) * dim),
                    ((heads + kv_heads + k0) * dim, (heads + kv_heads + k1) * dim)]
        gate_up_cols = [(c0, c1), (inter + c0, inter + c1)]
        self.layers = [
            _Layer(
                input_norm=layer.input_norm,
                qkv=_column_shard(layer.qkv, qkv_cols),
                o=RowParallel(_dense(layer.o), h0 * dim, h1 * dim),
                post_norm=layer.post_norm,
                gate_up=_column_shard(layer.gate_up, gate_up_cols),
                down=RowParallel(_dense(layer.down), c0, c1),
            )
            for layer in self.layers
        ]
        self.num_heads, self.num_kv_heads, self.intermediate = h1 - h0, k1 - k0, c1 - c0
        # The transformers layers still point at the whole fused matrices: let them go.
        for param in model.model.layers.parameters():
            param.data = param.data.new_empty(0)


def _dense(linear: Linear) -> Dense:
    if not isinstance(linear, Dense):
        raise TypeError("tensor parallel shards dense weights only (weights=fp32)")
    return linear


class RowParallel:
    """Rows ``[start, end)`` of a dense layer's ``[in, out]`` matrix: this rank's partial product,
    summed over the ranks; the bias is added once, after the sum."""

    def __init__(self, whole: Dense, start: int, end: int) -> None:
        self.weight_t = whole.weight_t[start:end].contiguous()
        self.bias = whole.bias
        self.out_features = whole.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.mm(x, self.weight_t)
        dist.all_reduce(out)
        return out if self.bias is None else out.add_(self.bias)

    def add_to(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return self(h).add_(x)


def _column_shard(linear: Linear, ranges: list[tuple[int, int]]) -> Dense:
    """Column-parallel: the given output column ranges of a dense layer (and its bias)."""
    whole = _dense(linear)
    bias = None if whole.bias is None else _columns(whole.bias, ranges)
    return Dense(_columns(whole.weight_t, ranges), bias)


def _columns(matrix: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """The given column ranges of ``matrix`` (the last axis), side by side, contiguous."""
    return torch.cat([matrix[..., a:b] for a, b in ranges], dim=-1).contiguous()


class Ranks:
    """A rank's place in the group: its shard once the model is known, and the frame channel."""

    def __init__(self, rank: int, world: int, control: dist.ProcessGroup) -> None:
        self.rank, self.world, self.control = rank, world, control
        self.shard: Shard | None = None

    @classmethod
    def join(cls, settings: Settings, rank: int, port: int) -> Ranks:
        """Join the process group of ``distributed.tensor_parallel`` ranks rendezvousing at ``port``."""
        world = settings.distributed.tensor_parallel
        cuda = settings.device == "cuda" or (settings.device == "auto" and torch.cuda.is_available())
        if cuda:
            torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=IDLE_TIMEOUT,
        )
        control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT) if cuda else dist.group.WORLD
        return cls(rank, world, control)

    def runner(self, model: PreTrainedModel, cache: PagedKVCache, max_positions: int) -> TensorParallelLlama:
        assert self.shard is not None
        return TensorParallelLlama(model, cache, max_positions, self.shard)

    def plan(self, config: PretrainedConfig) -> Shard:
        self.shard = Shard.plan(config.get_text_config(), self.rank, self.world)
        return self.shard

    def agree(self, num_blocks: int) -> int:
        """The smallest KV pool any rank can afford: block tables must be the same everywhere."""
        value = torch.tensor([num_blocks], dtype=torch.int64)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.control)
        return int(value.item())

    def send(self, frames: list[bytes]) -> None:
        """Rank 0: hand a message's frames (header, then an optional binary frame) to every rank."""
        sizes = torch.tensor([len(frames[0]), len(frames[1]) if len(frames) > 1 else -1], dtype=torch.int64)
        dist.broadcast(sizes, src=0, group=self.control)
        data = torch.frombuffer(bytearray(b"".join(frames)), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.control)

    def receive(self) -> list[bytes]:
        """Ranks 1..N-1: the next frames rank 0 sent."""
        sizes = torch.empty(2, dtype=torch.int64)
        dist.broadcast(sizes, src=0, group=self.control)
        header, frame = (int(n) for n in sizes)
        data = torch.empty(header + max(frame, 0), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.control)
        raw = data.numpy().tobytes()
        return [raw[:header]] if frame < 0 else [raw[:header], raw[header:]]


def start_followers(settings: Settings) -> tuple[Ranks, list[subprocess.Popen[bytes]]]:
    """Rank 0: start ranks 1..N-1 as child processes and join the group with them."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", settings.distributed.port))
        port = probe.getsockname()[1]
    world = settings.distributed.tensor_parallel
    children = [
        subprocess.Popen([sys.executable, "-m", "services.worker.tensor_parallel", "--rank", str(rank), "--port", str(port)])
        for rank in range(1, world)
    ]
    return Ranks.join(settings, 0, port), children


def follow(ranks: Ranks, settings: Settings) -> None:
    """Ranks 1..N-1: load the model, build the same engine as rank 0, then run every frame it sends."""
    from services.worker.engine import Engine
    from services.worker.model_loader import load_model

    loaded = load_model(settings, lambda progress, message: None)
    engine = Engine.create(loaded, settings, ranks=ranks)
    forwarded = None  # a masks_follow step awaiting its StepMasks
    while True:
        frames = ranks.receive()
        msg = wire.decode(frames[0])
        frame = frames[1] if len(frames) > 1 else None
        try:
            if isinstance(msg, wire.Step):
                forwarded = None
                if msg.masks_follow:
                    forwarded = engine.forward(msg)
                else:
                    engine.step(msg, frame)
            elif isinstance(msg, wire.StepMasks) and forwarded is not None:
                engine.sample_with(forwarded, msg, frame)
            elif isinstance(msg, wire.StepAbandon) and forwarded is not None:
                engine.abandon(forwarded, msg.reason)
        except Exception:  # rank 0 met the same failure and reported it; stay in step with it
            log.exception("worker.rank_step_failed", rank=ranks.rank)
            if isinstance(msg, wire.Step):
                engine.free(msg.slot_ids())


def main() -> None:
    parser = argparse.ArgumentParser(description="one rank (1..N-1) of a tensor-parallel worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    settings = get_settings()
    configure_logging("worker", settings.log_level)
    structlog.contextvars.bind_contextvars(service="worker", rank=args.rank, leader_pid=os.getppid())
    ranks = Ranks.join(settings, args.rank, args.port)
    try:
        follow(ranks, settings)
    except (RuntimeError, dist.DistBackendError) as exc:  # rank 0 is gone
        log.info("worker.rank_exit", rank=args.rank, reason=str(exc))


if __name__ == "__main__":
    main()
