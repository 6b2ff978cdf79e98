"""The session store's one rate window for several gateways (``RateHit``): every gateway's requests of a client
count against one ``limits.rate_limit_per_minute``, answered over the wire as ``RateVerdict``."""

from __future__ import annotations

from pathlib import Path

import pytest

from common import wire
from common.config import Settings
from services.session_store.service import SessionStore


@pytest.fixture
def service(tmp_path: Path) -> SessionStore:
    service = SessionStore(Settings(run_dir=tmp_path, limits={"rate_limit_per_minute": 2}))
    yield service
    service.router.close()
    service.store.close()


def hit(service: SessionStore, client: str) -> float | None:
    reply = wire.decode(wire.encode(service.handle(wire.decode(wire.encode(wire.RateHit(client=client))))))
    assert isinstance(reply, wire.RateVerdict)
    return reply.retry_after_s


def test_a_client_gets_the_limit_whichever_gateway_asks(service: SessionStore):
    assert hit(service, "user:alice") is None
    assert hit(service, "user:alice") is None
    assert 59.0 < hit(service, "user:alice") <= 60.0
    assert hit(service, "user:bob") is None  # counted apart
