"""``python -m services.worker.follower``: ranks 1..N-1 of a tensor-parallel worker (see
:mod:`services.worker.tensor_parallel`). Each loads the model, builds the same engine as rank 0 over its
shard, then runs every frame rank 0 sends; it exits when a collective fails, i.e. when rank 0 is gone."""

from __future__ import annotations

import argparse
import os

import structlog
import torch.distributed as dist

from common import wire
from common.config import Settings, get_settings
from common.logging import configure_logging
from services.worker.engine import Engine
from services.worker.model_loader import load_model
from services.worker.tensor_parallel import Ranks

log = structlog.get_logger()


def follow(ranks: Ranks, settings: Settings) -> None:
    """Load the model, build the same engine as rank 0, then run every frame it sends."""
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
