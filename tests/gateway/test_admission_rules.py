"""The admission pipeline's decisions with fakes: auth per surface, rate limit then content filter, and the
metrics and request record a request leaves once, whatever way it ends."""

from __future__ import annotations

import pytest

from common.config import Settings
from common import wire
from common.errors import CONTENT_FILTER, RATE_LIMITED
from services.gateway.admission import Admission, record_error
from services.gateway.auth import EVERGREEN, HTTP, SALIENCE, accepted_tokens, presented_token, refusal
from services.gateway.deps import Gateway
from services.gateway.metrics import Metrics
from services.gateway.protocol import GatewayError
from services.gateway.ratelimit import RateLimiter
from services.gateway.tenants import Tenant


class FakeText:
    def refused(self, text: str) -> bool:
        return "forbidden" in text

    def token_text(self, token_id: int) -> str:
        return {1: "for", 2: "bidden", 3: "ok"}.get(token_id, "")


class FakeStore:
    def __init__(self) -> None:
        self.requests: list[tuple] = []
        self.completions: list[tuple] = []

    def record_request(self, rid: str, **fields) -> None:
        self.requests.append((rid, fields))

    def record_completion(self, rid: str, **fields) -> None:
        self.completions.append((rid, fields))


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


ANYONE = Tenant(wire.Principal(user="localhost", admin=True), authenticated=False)  # no auth: the implicit user


def gateway(rate_limit: int = 0) -> Gateway:
    return Gateway(settings=Settings(), scheduler=None, store=FakeStore(), text=FakeText(),
                   limiter=RateLimiter(rate_limit), metrics=Metrics(), created=0)


def sample(gw: Gateway, name: str, **labels: str) -> float:
    return gw.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_rate_limit_comes_before_the_content_filter_and_counts_refused_prompts():
    gw = gateway(rate_limit=1)
    with pytest.raises(GatewayError) as caught:
        await Admission(gw, rid="a", surface="salience", client="c", tenant=ANYONE).admit("forbidden words", "append_tokens")
    assert caught.value.code == CONTENT_FILTER and "append_tokens" in caught.value.message
    with pytest.raises(GatewayError) as caught:
        await Admission(gw, rid="b", surface="aici", client="c", tenant=ANYONE).admit("fine")
    assert caught.value.code == RATE_LIMITED
    await Admission(gw, rid="c", surface="aici", client="other", tenant=ANYONE).admit("fine")  # clients are counted apart


async def test_with_auth_the_rate_limit_counts_users_not_addresses():
    gw = gateway(rate_limit=1)
    alice, bob = (Tenant(wire.Principal(user=u), authenticated=True) for u in ("alice", "bob"))
    await Admission(gw, rid="a", surface="openai", client="10.0.0.1", tenant=alice).admit("fine")
    with pytest.raises(GatewayError) as caught:  # alice from another address is still alice
        await Admission(gw, rid="b", surface="openai", client="10.0.0.2", tenant=alice).admit("fine")
    assert caught.value.code == RATE_LIMITED
    await Admission(gw, rid="c", surface="openai", client="10.0.0.1", tenant=bob).admit("fine")  # bob behind alice's NAT


def test_written_tokens_are_screened_as_text_and_output_is_screened():
    admission = Admission(gateway(), rid="r", surface="salience", client="c", tenant=ANYONE)
    assert admission.written_tokens([1, 2]) == "forbidden"
    assert admission.screens_out("so forbidden") and not admission.screens_out("") and not admission.screens_out("ok")


def test_end_counts_once_and_completes_the_record_of_an_accepted_request():
    gw, clock = gateway(), Clock()
    admission = Admission(gw, rid="r1", surface="salience", client="c", tenant=ANYONE, clock=clock)
    assert sample(gw, "tiller:active_streams", surface="salience") == 1
    admission.record(prompt="hi", params={"max_tokens": 2})
    clock.now += 0.5
    admission.tokens(1)
    admission.tokens(1)
    assert admission.end("length", text="ab", prompt_tokens=3, completion_tokens=2) == 0.5
    admission.end("internal_error")  # a second end changes nothing
    assert sample(gw, "tiller:requests_total", surface="salience", outcome="length") == 1
    assert sample(gw, "tiller:requests_total", surface="salience", outcome="internal_error") == 0
    assert sample(gw, "tiller:active_streams", surface="salience") == 0
    assert sample(gw, "tiller:generation_tokens_total", surface="salience") == 2
    assert sample(gw, "tiller:prompt_tokens_total", surface="salience") == 3
    assert sample(gw, "tiller:time_to_first_token_seconds_count", surface="salience") == 1
    assert gw.store.requests == [("r1", {"owner": "localhost", "surface": "salience", "model": gw.settings.served_model_name,
                                         "prompt": "hi", "params": {"max_tokens": 2}})]
    assert gw.store.completions[0][1]["error"] == "" and gw.store.completions[0][1]["completion_tokens"] == 2


def test_a_refused_request_is_counted_but_leaves_no_record():
    gw = gateway()
    Admission(gw, rid="r", surface="aici", client="c", tenant=ANYONE).end(RATE_LIMITED)
    assert sample(gw, "tiller:requests_total", surface="aici", outcome=RATE_LIMITED) == 1
    assert not gw.store.requests and not gw.store.completions


def test_record_error_names_only_errors():
    assert [record_error(o) for o in ("length", "stop", "cancelled", CONTENT_FILTER)] == [""] * 4
    assert record_error("timeout") == "timeout"


def settings(**env) -> Settings:
    return Settings.model_validate(env)


def test_tokens_per_surface():
    open_settings = settings()
    assert not any(accepted_tokens(open_settings, s) for s in (HTTP, EVERGREEN, SALIENCE))
    only_controllers = settings(api_auth={"tokens": {"t": "alice"}})  # tokens guard the controller API only
    assert not accepted_tokens(only_controllers, EVERGREEN) and not accepted_tokens(only_controllers, SALIENCE)
    everywhere = settings(api_auth={"tokens": {"t": "alice"}, "everywhere": True}, sessions={"auth_token": "s"})
    assert accepted_tokens(everywhere, HTTP) == accepted_tokens(everywhere, EVERGREEN) == {"t"}
    assert accepted_tokens(everywhere, SALIENCE) == {"t", "s"}
    assert accepted_tokens(settings(sessions={"auth_token": "s"}), SALIENCE) == {"s"}


def test_refusal_and_presented_token():
    assert presented_token({"authorization": "Bearer abc "}, "api-key") == "abc"
    assert presented_token({"authorization": "Basic abc", "api-key": "k"}, "api-key") == "k"
    assert presented_token({}, "api-key") == ""
    tokens = frozenset({"abc"})
    assert refusal(frozenset(), "", "api-key") is None
    assert refusal(tokens, "abc", "api-key") is None
    assert "authorization: Bearer" in refusal(tokens, "", "api-key")
    assert refusal(tokens, "abd", "api-key") == "the bearer token is not valid"
