"""The gateway's dependency container: the clients and shared state every request needs, built once per app."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from common.config import Settings
from services.gateway.metrics import Metrics
from services.gateway.ratelimit import RateLimiter
from services.gateway.scheduler_client import SchedulerClient
from services.gateway.side_channel import SideChannel
from services.gateway.store import StoreClient
from services.gateway.text import TextProcessor
from services.gateway.vector_cache import VectorCache


@dataclass
class Gateway:
    """What every request needs, built once per app."""

    settings: Settings
    scheduler: SchedulerClient
    store: StoreClient
    text: TextProcessor
    limiter: RateLimiter
    metrics: Metrics
    created: int  # unix time the gateway started (OpenAI's model ``created``)
    side: SideChannel | None = None  # the controller runtime's side channel (controllers, tags, instantiate)
    vectors: VectorCache = field(default_factory=VectorCache)  # steering vectors' content by id


def new_request_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"
