"""Tensor parallelism on torch.distributed: one worker made of N ranks on one host.

Sharding: every native family's projections are built column- or row-parallel by the shared layers
(:mod:`services.worker.layers.parallel`), each rank holding its KV heads in its own paged cache; this module
is the ranks' lockstep and transport.

Lockstep. Rank 0 alone talks to the scheduler. It sends every frame it runs (a Step and its mask
frame, a StepMasks, or a :class:`common.wire.StepAbandon`) to the other ranks before running it;
each rank runs the same :class:`services.worker.engine.Engine` calls on the same frames
(:mod:`services.worker.follower`), so block tables, prefix caches, sampling generators and last samples
stay identical on every rank without further messages. Only rank 0's results go back.

Transport. The all-reduces run on the default process group (gloo on the CPU, NCCL on GPUs); the
frames go over a gloo group (a length tensor, then the bytes), on the CPU and on GPUs alike.
Ranks 1..N-1 are child processes of rank 0 (``python -m services.worker.follower``); they
exit when a collective fails, i.e. when rank 0 is gone.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

from common.config import Settings
from services.worker.layers.parallel import Shard

# A rank idles in a broadcast until the next step: any finite wait would end an idle worker.
IDLE_TIMEOUT = timedelta(days=365)


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
        subprocess.Popen([sys.executable, "-m", "services.worker.follower", "--rank", str(rank), "--port", str(port)])
        for rank in range(1, world)
    ]
    return Ranks.join(settings, 0, port), children
