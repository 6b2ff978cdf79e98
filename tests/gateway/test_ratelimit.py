"""The per-client sliding-window rate limiter."""

from __future__ import annotations

import pytest

from common.errors import RATE_LIMITED
from services.gateway.protocol import GatewayError
from services.gateway.ratelimit import RateLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_limit_per_client_and_window():
    clock = Clock()
    limiter = RateLimiter(2, clock)
    limiter.check("a")
    clock.now += 10
    limiter.check("a")
    limiter.check("b")  # other clients are counted apart
    with pytest.raises(GatewayError) as caught:
        limiter.check("a")
    assert caught.value.code == RATE_LIMITED
    assert caught.value.retry_after_s == pytest.approx(50.0)  # the first request leaves the window in 50 s
    clock.now += 50.01
    limiter.check("a")
    with pytest.raises(GatewayError):
        limiter.check("a")


def test_zero_disables():
    limiter = RateLimiter(0)
    for _ in range(1000):
        limiter.check("a")


def test_idle_clients_are_swept():
    clock = Clock()
    limiter = RateLimiter(5, clock)
    for i in range(100):
        limiter.check(f"client-{i}")
    clock.now += 61
    limiter.check("new")
    assert list(limiter._hits) == ["new"]
