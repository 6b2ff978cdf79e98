"""The per-client sliding-window rate limit: the window, and the gateway's limiter counting here or in the
session store (several gateways on one port)."""

from __future__ import annotations

import pytest

from common.errors import INTERNAL_ERROR, RATE_LIMITED, TillerError
from common.ratelimit import SlidingWindow
from services.gateway.protocol import GatewayError
from services.gateway.ratelimit import RateLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_limit_per_client_and_window():
    clock = Clock()
    window = SlidingWindow(2, clock)
    assert window.hit("a") is None
    clock.now += 10
    assert window.hit("a") is None
    assert window.hit("b") is None  # other clients are counted apart
    assert window.hit("a") == pytest.approx(50.0)  # the first request leaves the window in 50 s
    clock.now += 50.01
    assert window.hit("a") is None
    assert window.hit("a") is not None


def test_zero_disables():
    window = SlidingWindow(0)
    assert all(window.hit("a") is None for _ in range(1000))


def test_idle_clients_are_swept():
    clock = Clock()
    window = SlidingWindow(5, clock)
    for i in range(100):
        window.hit(f"client-{i}")
    clock.now += 61
    window.hit("new")
    assert list(window._hits) == ["new"]


async def test_the_limiter_refuses_with_the_time_to_retry():
    clock = Clock()
    limiter = RateLimiter(1, clock)
    await limiter.check("a")
    with pytest.raises(GatewayError) as caught:
        await limiter.check("a")
    assert caught.value.code == RATE_LIMITED and caught.value.retry_after_s == pytest.approx(60.0)
    assert "rate limit of 1 requests per minute exceeded" in caught.value.message


async def test_a_shared_limit_is_counted_remotely_and_admits_when_the_store_is_silent():
    asked: list[str] = []
    answers: list[float | None | Exception] = [None, 12.5, TillerError(INTERNAL_ERROR, "no answer")]

    async def remote(client: str) -> float | None:
        asked.append(client)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    limiter = RateLimiter(3, remote=remote)
    await limiter.check("a")
    with pytest.raises(GatewayError) as caught:
        await limiter.check("a")
    assert caught.value.retry_after_s == 12.5
    await limiter.check("a")  # the store did not answer: admitted (logged)
    assert asked == ["a", "a", "a"]
    await RateLimiter(0, remote=remote).check("a")  # disabled: nothing asked
    assert len(asked) == 3
