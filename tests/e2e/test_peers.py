"""The internal sockets as a peer process sees them: good messages work, bad ones get a specific error,
and nothing else is lost. Real processes, real ZeroMQ sockets."""

from __future__ import annotations

import asyncio
import time
import uuid

import msgspec
import pytest
import zmq
import zmq.asyncio

from common import aici_wire, wire
from common.sockets import MAX_MESSAGE_BYTES, Dealer, probe_health

TESTER = wire.Principal(user="tester")  # who the store calls below are for
CALLER = msgspec.to_builtins(TESTER)  # the same in a raw header

pytestmark = pytest.mark.asyncio


# msgpack nested past the decoder's depth, in a field the schemas ignore: its RecursionError crashed the session
# store and went unanswered elsewhere (a socket reader's callback failed with it)
DEEP = b"\x91" * 3000 + b"\xc0"


async def raw_request(endpoint: str, *frames: bytes, timeout: float = 5.0) -> list[bytes]:
    """Send raw frames from a fresh DEALER and return the reply's frames."""
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        await sock.send_multipart(list(frames))
        assert await sock.poll(int(timeout * 1000)), f"no reply from {endpoint}"
        return await sock.recv_multipart()
    finally:
        sock.close(0)


def submit(stack, prompt: str, max_tokens: int = 8, **kwargs) -> wire.Submit:
    return wire.Submit(
        rid=f"test-{uuid.uuid4().hex[:8]}",
        prompt=wire.pack_tokens(stack.tokenizer(prompt).input_ids),
        sampling=wire.SamplingParams(temperature=0.0),
        max_tokens=max_tokens,
        **kwargs,
    )


class EventCollector:
    """A gateway stand-in written against the wire schemas: collects Events/RequestFailed per request."""

    def __init__(self, endpoint: str) -> None:
        self.events: dict[str, list[wire.TokenEvent]] = {}
        self.failures: dict[str, wire.RequestFailed] = {}
        self.done: dict[str, asyncio.Event] = {}
        self.dealer = Dealer(zmq.asyncio.Context.instance(), endpoint, on_message=self._on_message)
        self.dealer.start()

    def _on_message(self, msg: wire.Message, _: list[bytes]) -> None:
        if isinstance(msg, wire.Events):
            for event in msg.token_events():
                self.events.setdefault(event.rid, []).append(event)
                if event.finish_reason:
                    self.done.setdefault(event.rid, asyncio.Event()).set()
        elif isinstance(msg, wire.RequestFailed):
            self.failures[msg.rid] = msg
            self.done.setdefault(msg.rid, asyncio.Event()).set()

    async def run(self, request: wire.Submit, timeout: float = 120.0) -> list[wire.TokenEvent]:
        reply, _ = await self.dealer.request(request)
        assert isinstance(reply, wire.Queued) and reply.rid == request.rid, reply
        await asyncio.wait_for(self.done.setdefault(request.rid, asyncio.Event()).wait(), timeout)
        return self.events.get(request.rid, [])

    def close(self) -> None:
        self.dealer.close()


async def test_controller_runtime_main_channel(stack):
    endpoint = stack.settings.endpoint("controller_main")
    reply = msgspec.msgpack.decode((await raw_request(endpoint, aici_wire.encode({"op": "ping"})))[0])
    incarnation = reply.pop("incarnation")  # Tiller's addition: the runtime process's life
    assert reply == {"type": "ok", "data": {"pong": 1}} and incarnation
    reply = msgspec.msgpack.decode((await raw_request(endpoint, aici_wire.encode({"op": "tokens"})))[0])
    assert reply == {"type": "ok", "data": {"vocab_size": len(stack.tokenizer), "eos_token_id": stack.tokenizer.eos_token_id},
                     "incarnation": incarnation}


@pytest.mark.parametrize(
    "frame, expected",
    [
        (b"\xc1not msgpack", "malformed main-channel request"),
        (aici_wire.encode({"op": "launch_missiles"}), "launch_missiles"),
        (aici_wire.encode([1, 2, 3]), "malformed main-channel request"),
        (b"\x82\xa2op\xa4ping\xa1x" + DEEP, "malformed main-channel request: maximum recursion depth exceeded"),
    ],
)
async def test_controller_runtime_main_channel_bad_input(stack, frame, expected):
    endpoint = stack.settings.endpoint("controller_main")
    reply = msgspec.msgpack.decode((await raw_request(endpoint, frame))[0])
    assert reply["type"] == "error" and expected in reply["error"]
    reply = msgspec.msgpack.decode((await raw_request(endpoint, aici_wire.encode({"op": "ping"})))[0])
    assert reply["data"] == {"pong": 1}


async def test_controller_runtime_side_channel_bad_input(stack):
    endpoint = stack.settings.endpoint("controller_side")
    reply = msgspec.msgpack.decode((await raw_request(endpoint, aici_wire.encode({"op": "get_tags"})))[0])
    assert reply["type"] == "error" and "$rid" in reply["error"]
    reply = msgspec.msgpack.decode(
        (await raw_request(endpoint, aici_wire.encode({"$rid": "r1", "op": "no_such_op"})))[0]
    )
    # AICI's error envelope: is_user_error says the request, not the runtime, was at fault
    assert reply == {"type": "error", "error": "unknown side-channel op 'no_such_op'", "data": {}, "$rid": "r1",
                     "is_user_error": True}
    reply = msgspec.msgpack.decode((await raw_request(endpoint, b"\x83\xa4$rid\xa2r2\xa2op\xa8get_tags\xa1x" + DEEP))[0])
    assert reply["type"] == "error" and "malformed side-channel request: maximum recursion depth" in reply["error"]
    reply = msgspec.msgpack.decode((await raw_request(endpoint, aici_wire.encode({"$rid": "r3", "op": "get_tags"})))[0])
    assert reply["type"] == "ok" and reply["$rid"] == "r3"


@pytest.mark.parametrize("endpoint_name, service", [("controller_main", "controller_runtime"),
                                                    ("controller_side", "controller_runtime"),
                                                    ("scheduler", "scheduler")])
async def test_a_message_past_the_size_limit_drops_its_peer_and_the_service_goes_on(stack, endpoint_name, service):
    """Every bound socket drops a peer whose message is larger than MAX_MESSAGE_BYTES, unread (the controller
    runtime's took it whole, and answered it)."""
    endpoint = stack.settings.endpoint(endpoint_name)
    pid = stack.pid(service)
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        await sock.send(bytes(MAX_MESSAGE_BYTES + 1))
        assert not await sock.poll(3000), "a message past the limit was read and answered"
    finally:
        sock.close(0)
    ping = aici_wire.encode({"$rid": "r", "op": "get_tags"} if endpoint_name == "controller_side" else {"op": "ping"})
    reply = (await raw_request(endpoint, wire.encode(wire.Health()) if service == "scheduler" else ping))[0]
    assert reply and stack.pid(service) == pid


@pytest.mark.parametrize("service", ["scheduler", "session_store"])
@pytest.mark.parametrize(
    "header, expected",
    [
        (b"\xc1\xc1", "malformed message"),
        (msgspec.msgpack.encode({"type": "no_such_type"}), "malformed message"),
        (msgspec.msgpack.encode({"type": "submit", "rid": 7}), "malformed message"),
        (b"\x82\xa4type\xa6health\xa1x" + DEEP, "malformed message: maximum recursion depth exceeded"),
    ],
)
async def test_malformed_frames_get_an_error_and_the_service_goes_on(stack, service, header, expected):
    endpoint = stack.settings.endpoint(service)
    pid = stack.pid(service)
    reply = wire.decode((await raw_request(endpoint, header))[0])
    assert isinstance(reply, wire.Error) and reply.code == "invalid_request" and expected in reply.message
    health = wire.decode((await raw_request(endpoint, wire.encode(wire.Health())))[0])
    assert isinstance(health, wire.HealthReply) and health.ready
    assert stack.pid(service) == pid


async def test_a_message_for_another_role_on_the_workers_socket_gets_an_error(stack):
    """A gateway's message sent to the socket workers join: an Error naming it (it was logged, never answered)."""
    endpoint = stack.settings.endpoint("worker")
    request = wire.Submit(rid="r", prompt=wire.pack_tokens([1]), sampling=wire.SamplingParams(), max_tokens=1, mid=7)
    reply = wire.decode((await raw_request(endpoint, wire.encode(request)))[0])
    assert isinstance(reply, wire.Error) and reply.mid == 7 and reply.code == "invalid_request"
    assert reply.message == "the scheduler's worker socket does not take Submit messages"
    health = wire.decode((await raw_request(stack.settings.endpoint("scheduler"), wire.encode(wire.Health())))[0])
    assert isinstance(health, wire.HealthReply) and health.ready and len(health.facts.workers) == 1


async def test_scheduler_refuses_bad_submissions(stack):
    endpoint = stack.settings.endpoint("scheduler")
    dealer = Dealer(zmq.asyncio.Context.instance(), endpoint)
    try:
        def raw(rid: str, prompt: bytes) -> wire.Submit:
            return wire.Submit(rid=rid, prompt=prompt, sampling=wire.SamplingParams(), max_tokens=4)

        reply, _ = await dealer.request(raw("long", wire.pack_tokens([1] * 5000)))
        assert isinstance(reply, wire.Error) and reply.code == "context_length_exceeded"
        reply, _ = await dealer.request(raw("empty", b""))
        assert isinstance(reply, wire.Error) and reply.code == "invalid_request"
        reply, _ = await dealer.request(raw("ragged", b"\x01\x00\x00"))  # not whole int32s
        assert isinstance(reply, wire.Error) and reply.code == "invalid_request" and "int32" in reply.message
        for rid, ids in (("oov", [10**7]), ("negative", [5, -5])):
            reply, _ = await dealer.request(raw(rid, wire.pack_tokens(ids)))
            assert isinstance(reply, wire.Error) and "token ids" in reply.message, rid
        reply, _ = await dealer.request(wire.Cancel(rid="never-submitted"))
        assert isinstance(reply, wire.Error) and "never-submitted" in reply.message
    finally:
        dealer.close()


async def test_scheduler_streams_greedy_tokens_equal_to_transformers(stack, hf_greedy):
    collector = EventCollector(stack.settings.endpoint("scheduler"))
    try:
        request = submit(stack, "The three primary colours are", max_tokens=16)
        events = await collector.run(request)
        tokens = [t.token_id for e in events for t in e.tokens]
        assert tokens == hf_greedy(wire.unpack_tokens(request.prompt), 16)
        assert events[-1].finish_reason in ("length", "stop")
        assert events[-1].completion_tokens == len(tokens)
        text = "".join(e.text for e in events)
        assert text == stack.tokenizer.decode(tokens, skip_special_tokens=True)
    finally:
        collector.close()


async def test_session_store_keeps_records_across_a_restart(stack):
    endpoint = stack.settings.endpoint("session_store")
    dealer = Dealer(zmq.asyncio.Context.instance(), endpoint)
    rid = f"durable-{uuid.uuid4().hex[:8]}"
    try:
        reply, _ = await dealer.request(wire.RecordRequest(rid=rid, owner=TESTER.user, surface="test", model="m",
                                                           prompt="hi", created_at=time.time()))
        assert isinstance(reply, wire.Ok)
        reply, _ = await dealer.request(wire.RecordFeedback(rid=rid, caller=TESTER, rating=1, text="good",
                                                            position=3))
        assert isinstance(reply, wire.FeedbackRecorded) and reply.feedback_id > 0
        reply, _ = await dealer.request(wire.RecordFeedback(rid="unknown-request", caller=TESTER, rating=1))
        assert isinstance(reply, wire.Error) and reply.code == "not_found"
    finally:
        dealer.close()
    old_pid = stack.pid("session_store")
    stack.restart("session_store")
    assert stack.pid("session_store") != old_pid
    dealer = Dealer(zmq.asyncio.Context.instance(), endpoint)
    try:
        for _ in range(50):
            try:
                reply, _ = await dealer.request(wire.GetRequest(rid=rid, caller=TESTER), timeout=1.0)
                break
            except asyncio.TimeoutError:
                continue
        assert isinstance(reply, wire.RequestRecordReply)
        assert reply.record.prompt == "hi"
        assert [(f.rating, f.text, f.position) for f in reply.record.feedback] == [(1.0, "good", 3)]
    finally:
        dealer.close()


async def test_killed_worker_fails_its_requests_cleanly_and_a_new_worker_serves(stack, hf_greedy):
    collector = EventCollector(stack.settings.endpoint("scheduler"))
    try:
        doomed = submit(stack, "Count from one to one hundred:", max_tokens=400, ignore_eos=True)
        reply, _ = await collector.dealer.request(doomed)
        assert isinstance(reply, wire.Queued)
        for _ in range(200):  # wait until tokens flow, then kill the worker mid-stream
            if collector.events.get(doomed.rid):
                break
            await asyncio.sleep(0.05)
        stack.kill("worker")
        await asyncio.wait_for(collector.done.setdefault(doomed.rid, asyncio.Event()).wait(), 30)
        failure = collector.failures[doomed.rid]
        assert failure.code == "service_unavailable" and failure.recoverable and failure.recovery_action == "retry"

        deadline = time.monotonic() + 120
        while not (await asyncio.to_thread(stack.scheduler_health))["ready"]:
            assert time.monotonic() < deadline, "no worker came back"
            await asyncio.sleep(0.5)
        request = submit(stack, "The capital of Italy is", max_tokens=8)
        events = await collector.run(request)
        assert [t.token_id for e in events for t in e.tokens] == hf_greedy(wire.unpack_tokens(request.prompt), 8)
    finally:
        collector.close()


async def test_a_restarted_scheduler_starts_from_a_clean_worker(stack, hf_greedy):
    """A scheduler restarted mid-request numbers its sequences from 1 again: the worker must not append the
    new request to the sequence the old scheduler left there (its first step drops everything: free_all)."""

    async def restart_scheduler() -> None:
        stack.restart("scheduler")
        deadline = time.monotonic() + 60
        while True:  # a loaded machine takes seconds to start one: no answer yet is "not ready"
            reply = await probe_health(stack.settings.endpoint("scheduler"), timeout=2.0)
            if reply is not None and reply.ready:
                return
            assert time.monotonic() < deadline, "the scheduler did not become ready again"
            await asyncio.sleep(0.2)

    await restart_scheduler()  # fresh numbering: the next request is sequence 1
    collector = EventCollector(stack.settings.endpoint("scheduler"))
    try:
        doomed = submit(stack, "Count from one to one hundred:", max_tokens=400, ignore_eos=True)
        reply, _ = await collector.dealer.request(doomed)
        assert isinstance(reply, wire.Queued)
        for _ in range(200):  # tokens flow: the worker holds sequence 1
            if len(collector.events.get(doomed.rid, [])) >= 3:
                break
            await asyncio.sleep(0.05)
        assert collector.events.get(doomed.rid), "the first request never produced tokens"
    finally:
        collector.close()
    await restart_scheduler()
    collector = EventCollector(stack.settings.endpoint("scheduler"))
    try:
        request = submit(stack, "The capital of Italy is", max_tokens=8)
        events = await collector.run(request)
        assert [t.token_id for e in events for t in e.tokens] == hf_greedy(wire.unpack_tokens(request.prompt), 8)
    finally:
        collector.close()


@pytest.mark.parametrize("header, expected", [
    # values msgpack carries and the store's columns cannot hold: each crashed the store (a new pid, every
    # request in flight to it lost) before
    ({"type": "record_request", "rid": "r", "owner": "tester", "surface": "s", "model": "m", "prompt": "p",
      "params": {"a": b"\x00"}},
     "the request's params are not JSON: Object of type bytes is not JSON serializable"),
    ({"type": "record_completion", "rid": "r", "generated_text": "", "finish_reason": "stop",
      "prompt_tokens": 2**64 - 1, "completion_tokens": 0}, "Expected `int` <= 9223372036854775807 - at `$.prompt_tokens`"),
    ({"type": "record_feedback", "rid": "r", "caller": CALLER, "rating": 1.0, "position": 2**64 - 1},
     "at `$.position`"),
    ({"type": "record_feedback", "rid": "r", "caller": CALLER, "rating": float("nan")}, "at `$.rating`"),
    ({"type": "salience_begin", "session_id": "s", "caller": CALLER, "offset": 0, "max_len": 9, "lease_s": 1.0,
      "append_tokens": [-1]},
     "Expected `int` >= 0 - at `$.append_tokens[0]`"),
    ({"type": "salience_end", "session_id": "s", "lease": "", "append_tokens": [2**32]},
     "Expected `int` <= 4294967295 - at `$.append_tokens[0]`"),
    ({"type": "salience_fork", "session_id": "s", "caller": CALLER, "at_position": -1},
     "Expected `int` >= 0 - at `$.at_position`"),
])
async def test_the_session_store_refuses_values_it_cannot_store_and_goes_on(stack, header, expected):
    endpoint = stack.settings.endpoint("session_store")
    pid = stack.pid("session_store")
    reply = wire.decode((await raw_request(endpoint, msgspec.msgpack.encode(header)))[0])
    assert isinstance(reply, wire.Error) and reply.code == "invalid_request" and expected in reply.message, reply
    assert stack.pid("session_store") == pid
    dealer = Dealer(zmq.asyncio.Context.instance(), endpoint)
    try:
        rid = f"after-{uuid.uuid4().hex[:8]}"
        reply, _ = await dealer.request(wire.RecordRequest(rid=rid, owner=TESTER.user, surface="test", model="m",
                                                           prompt="hi"))
        assert isinstance(reply, wire.Ok)
        reply, _ = await dealer.request(wire.GetRequest(rid=rid, caller=TESTER))
        assert isinstance(reply, wire.RequestRecordReply) and reply.record.prompt == "hi"
    finally:
        dealer.close()


class FakeWorker:
    """A peer that joins the scheduler as a ready worker of the served model and answers every step with a token
    id past the vocabulary (a broken worker)."""

    def __init__(self, endpoint: str, facts: wire.ModelFacts) -> None:
        self.sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, b"fake-worker")
        self.sock.connect(endpoint)
        self.hello = wire.WorkerHello(
            worker_id="fake-worker", stage="ready", progress=100, model=facts.model, vocab_size=facts.vocab_size,
            max_model_len=facts.max_model_len, eos_token_ids=facts.eos_token_ids, kv_capacity_tokens=1 << 30,
            incarnation="fake", wire_version=wire.WIRE_VERSION)
        self.steps = 0

    async def serve(self) -> None:
        await self.sock.send_multipart([wire.encode(self.hello)])
        while True:
            msg = wire.decode((await self.sock.recv_multipart())[0])
            if isinstance(msg, wire.Health):
                await self.sock.send_multipart([wire.encode(wire.HealthReply(service="worker", ready=True,
                                                                             mid=msg.mid))])
            elif isinstance(msg, wire.Step):
                self.steps += 1
                slots = len(msg.slot_ids())
                result = wire.StepResult(step_id=msg.step_id, tokens=wire.pack_tokens([10**6] * slots),
                                         logprobs=wire.pack_logprobs([0.0] * slots))
                await self.sock.send_multipart([wire.encode(result)])


async def test_a_worker_answering_token_ids_past_the_vocabulary_is_dropped(stack, hf_greedy):
    """Its tokens came back as empty text, its requests a success; now they fail as a lost worker's do
    (retryable), it is dropped, and the real worker's requests are greedy as ever."""
    pids = {service: stack.pid(service) for service in ("scheduler", "worker", "gateway")}
    facts = (await probe_health(stack.settings.endpoint("scheduler"))).facts
    fake = FakeWorker(stack.settings.endpoint("worker"), facts)
    serving = asyncio.ensure_future(fake.serve())
    collector = EventCollector(stack.settings.endpoint("scheduler"))
    try:
        for _ in range(100):  # it joined
            health = await probe_health(stack.settings.endpoint("scheduler"))
            if "fake-worker" in [w.worker for w in health.facts.workers]:
                break
            await asyncio.sleep(0.05)
        requests = [submit(stack, "The capital of Italy is", max_tokens=8) for _ in range(4)]
        runs = await asyncio.gather(*(collector.run(r) for r in requests))
        expected = hf_greedy(wire.unpack_tokens(requests[0].prompt), 8)
        assert fake.steps and any(r.rid in collector.failures for r in requests)
        for request, events in zip(requests, runs):
            failure = collector.failures.get(request.rid)
            if failure is None:
                assert [t.token_id for e in events for t in e.tokens] == expected
            else:
                assert failure.code == "service_unavailable" and failure.recoverable
                assert "sampled token ids [1000000] outside the vocabulary of 49152" in failure.message
        health = await probe_health(stack.settings.endpoint("scheduler"))
        assert [w.worker for w in health.facts.workers] == [facts.workers[0].worker]
        assert {service: stack.pid(service) for service in pids} == pids
    finally:
        serving.cancel()
        fake.sock.close(0)
        collector.close()
