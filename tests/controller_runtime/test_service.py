"""The real controller-runtime process over its ZeroMQ main and side channels."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import itertools
import time
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from common import aici_wire
from common.config import Settings
from common.model_source import load_tokenizer
from services.scheduler.main_channel import MainChannel
from tests.controller_runtime.wat import controller, ret_const
from tests.gateway.support import base_env, service

START_TIMEOUT_S = 120.0
_rids = itertools.count(1)


class Client:
    def __init__(self, settings: Settings) -> None:
        ctx = zmq.asyncio.Context.instance()
        self.incarnation = ""
        self.main = ctx.socket(zmq.DEALER)
        self.side = ctx.socket(zmq.DEALER)
        for sock, name in ((self.main, "controller_main"), (self.side, "controller_side")):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(settings.endpoint(name))

    async def main_raw(self, frame: bytes, timeout: float = 10.0) -> tuple[dict, list[bytes]]:
        await self.main.send(frame)
        parts = await asyncio.wait_for(self.main.recv_multipart(), timeout)
        return aici_wire.decode_reply(parts[0]), parts[1:]

    async def call(self, request: dict, timeout: float = 10.0) -> tuple[dict, list[bytes]]:
        return await self.main_raw(aici_wire.encode(request), timeout)

    async def side_raw(self, frame: bytes, timeout: float = 30.0) -> dict:
        await self.side.send(frame)
        return msgspec.msgpack.decode(await asyncio.wait_for(self.side.recv(), timeout))

    async def side_call(self, op: str, user: str = "admin", is_admin: bool = True, **fields) -> dict:
        rid = f"rid-{next(_rids)}"
        reply = await self.side_raw(aici_wire.encode({"$rid": rid, "$auth": {"user": user, "is_admin": is_admin},
                                                      "op": op, **fields}))
        assert reply["$rid"] == rid
        return reply

    def close(self) -> None:
        self.main.close(0)
        self.side.close(0)


@contextlib.asynccontextmanager
async def runtime_process(run_dir: Path):
    env = base_env(run_dir, TILLER_CONTROLLERS__MID_DEADLINE_MS="100")
    settings = Settings(run_dir=run_dir)
    with service("services.controller_runtime", env, run_dir / "controller_runtime.log") as proc:
        client = Client(settings)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, (run_dir / "controller_runtime.log").read_text()[-3000:]
            try:
                reply, _ = await client.call({"op": "ping"}, timeout=2.0)
                break
            except asyncio.TimeoutError:
                client.close()  # drop the unanswered request; a fresh DEALER starts clean
                client = Client(settings)
                assert time.monotonic() < deadline, "controller runtime did not answer ping"
        assert reply["type"] == "ok" and reply["data"] == {"pong": 1} and reply["incarnation"]
        client.incarnation = reply["incarnation"]  # the runtime's life, named in every main-channel reply
        try:
            yield client
        finally:
            client.close()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


async def test_channels_faults_and_restart(tmp_path):
    good = controller()
    trapping = controller(mid="unreachable")
    async with runtime_process(tmp_path) as rt:
        reply, _ = await rt.call({"op": "tokens"})
        assert reply["data"]["vocab_size"] == 49152
        words = (reply["data"]["vocab_size"] + 31) // 32

        # malformed main-channel frames get errors; the service goes on
        for frame in (b"\xc1not msgpack", aici_wire.encode({"op": "nope"}), aici_wire.encode([1, 2]),
                      aici_wire.encode({"op": "mid_process", "ops": [{"id": "x"}]})):
            reply, frames = await rt.main_raw(frame)
            assert reply["type"] == "error" and reply["is_user_error"] and not frames
            assert reply["incarnation"] == rt.incarnation
        assert (await rt.call({"op": "ping"}))[0]["data"] == {"pong": 1}

        # side channel: bad requests
        no_rid = await rt.side_raw(aici_wire.encode({"op": "get_tags"}))
        assert no_rid["type"] == "error" and "$rid" in no_rid["error"]
        assert "base64" in (await rt.side_call("mk_module", binary="%%%"))["error"]
        bad = await rt.side_call("mk_module", binary=b64(b"\0asm garbage"))
        assert bad["type"] == "error" and bad["is_user_error"] and "invalid Wasm module" in bad["error"]
        no_abi = await rt.side_call("mk_module", binary=b64(b"\0asm\1\0\0\0"))
        assert "does not export 'memory'" in no_abi["error"]
        assert "unknown side-channel op" in (await rt.side_call("frobnicate"))["error"]

        # upload, tag, list
        made = await rt.side_call("mk_module", binary=b64(good))
        assert made["type"] == "ok" and made["data"]["module_id"] == hashlib.sha256(good).hexdigest()
        assert made["data"]["wasm_size"] == len(good) and made["data"]["compiled_size"] > 0
        trap_id = (await rt.side_call("mk_module", binary=b64(trapping)))["data"]["module_id"]
        for tag, user, admin, message in (("1abc", "admin", True, "start with a letter"),
                                          ("a" * 51, "admin", True, "longer than 50"),
                                          ("ab cd", "admin", True, "letters, digits"),
                                          ("deadbeefdeadbeefdeadbeef", "admin", True, "looks like a module id"),
                                          ("bob.x", "alice", False, "must start with 'alice.'")):
            reply = await rt.side_call("set_tags", user=user, is_admin=admin, module_id=made["data"]["module_id"],
                                       tags=[tag])
            assert reply["type"] == "error" and message in reply["error"], reply
        unknown = await rt.side_call("set_tags", module_id="f" * 64, tags=["x"])
        assert "unknown module id" in unknown["error"]
        tagged = await rt.side_call("set_tags", user="alice", is_admin=False, module_id=made["data"]["module_id"],
                                    tags=["alice.good"])
        assert tagged["data"]["tags"][0]["updated_by"] == "alice"
        await asyncio.sleep(1.1)  # updated_at has one-second resolution
        await rt.side_call("set_tags", module_id=trap_id, tags=["trapper"])
        listed = (await rt.side_call("get_tags"))["data"]["tags"]
        assert [t["tag"] for t in listed] == ["trapper", "alice.good"]
        assert listed[1]["module_id"] == made["data"]["module_id"] and listed[0]["updated_by"] == "admin"

        # instantiate: by tag, by id, unknown module, native
        for req_id, ref in (("r1", "alice.good"), ("r2", trap_id), ("r3", "native:constrained")):
            reply = await rt.side_call("instantiate", req_id=req_id, prompt=[1, 2, 3], module_id=ref,
                                       module_arg={"regex": "[ab]+"} if req_id == "r3" else "x")
            assert reply["type"] == "ok" and reply["data"]["error"] == "", reply
        missing = await rt.side_call("instantiate", req_id="r4", prompt=[1], module_id="no-such-tag")
        assert missing["type"] == "error" and "unknown controller module or tag" in missing["error"]

        # one step: bind, pre, mid with one trapping sequence among good ones, post
        reply, _ = await rt.call({"op": "post_pre_process", "post_ops": [], "freed": [],
                                  "pre_ops": [{"id": 1, "req_id": "r1"}, {"id": 2, "req_id": "r2"},
                                              {"id": 3, "req_id": "r3"}, {"id": 4, "req_id": "unknown"}]})
        pre = reply["data"]["pre_seqs"]
        assert all(pre[s]["result"] == {"suspend": False, "num_forks": 1, "ff_tokens": []} for s in "123")
        assert "no instantiated controller" in pre["4"]["error"]
        reply, frames = await rt.call({"op": "mid_process", "ops": [{"id": 1, "clone_id": None}, {"id": 2},
                                                                    {"id": 3}, {"id": 5, "clone_id": 1}]})
        seqs = reply["data"]["seqs"]
        assert reply["data"]["num_seqs"] == 4 and len(frames) == 1 and len(frames[0]) == 4 * words * 4
        assert [seqs[k]["result"] for k in "153"] == [None] * 3
        assert seqs["2"]["result"] is None and "unreachable" in seqs["2"]["error"]
        assert frames[0][:words * 4] == b"\xff" * (words * 4) and not any(frames[0][words * 4:2 * words * 4])
        row3 = int.from_bytes(frames[0][2 * words * 4:3 * words * 4], "little")
        a_token = load_tokenizer(Settings()).encode("a")[0]
        assert row3 >> a_token & 1 and bin(row3).count("1") < 1000
        reply, _ = await rt.call({"op": "post_pre_process", "post_ops": [{"id": 1, "tokens": [5], "backtrack": 0}],
                                  "pre_ops": [], "freed": [2]})
        assert reply["data"]["post_seqs"]["1"]["result"] == {"stop": False}
        assert set(reply["data"]["pre_seqs"]) == {"1", "3", "5"}
        channel = MainChannel(Settings(run_dir=tmp_path).endpoint("controller_main"))  # the scheduler's end
        assert await channel.ping() == "ok" and channel.incarnation == rt.incarnation
        first = rt.incarnation

    # modules and tags survive a restart; the restarted runtime names a new incarnation
    async with runtime_process(tmp_path) as rt:
        assert rt.incarnation != first
        async with asyncio.timeout(10):
            while await channel.ping() != "ok":  # the first call after the drop is refused
                await asyncio.sleep(0.1)
        assert channel.incarnation == rt.incarnation
        channel.close()
        listed = (await rt.side_call("get_tags"))["data"]["tags"]
        assert [t["tag"] for t in listed] == ["trapper", "alice.good"]
        reply = await rt.side_call("instantiate", req_id="again", prompt=[1], module_id="alice.good", module_arg="")
        assert reply["type"] == "ok"
        again = await rt.side_call("mk_module", binary=b64(good))
        assert again["data"]["module_id"] == hashlib.sha256(good).hexdigest()


# init_prompt logs its module arg (read into 16384..) through fd_write (iovec at 16000, count at 16008)
ECHO_ARG = controller(init_prompt="""
    (local $n i32)
    (local.set $n (call $read_blob (call $module_arg) (i32.const 16384) (i32.const 4096)))
    (i32.store (i32.const 16000) (i32.const 16384))
    (i32.store (i32.const 16004) (local.get $n))
    (drop (call $fd_write (i32.const 1) (i32.const 16000) (i32.const 1) (i32.const 16008)))
""" + ret_const(1024, "{}"))


async def test_wire_details_as_aici(tmp_path):
    """tokens names EOS; a side request with a non-string $rid still gets it back in the error; a JSON
    module_arg reaches the controller serialized as serde_json does (compact, UTF-8)."""
    eos = load_tokenizer(Settings()).eos_token_id
    async with runtime_process(tmp_path) as rt:
        reply, _ = await rt.call({"op": "tokens"})
        assert reply == {"type": "ok", "data": {"vocab_size": 49152, "eos_token_id": eos}, "incarnation": rt.incarnation}

        for rid in (7, ["a"]):
            reply = await rt.side_raw(aici_wire.encode({"$rid": rid, "op": "get_tags"}))
            assert reply["type"] == "error" and reply["$rid"] == rid and "string $rid" in reply["error"], reply

        module_id = (await rt.side_call("mk_module", binary=b64(ECHO_ARG)))["data"]["module_id"]
        arg = {"a": [1, "é"], "b": {"c": None}}
        reply = await rt.side_call("instantiate", req_id="echo", prompt=[1], module_id=module_id, module_arg=arg)
        assert reply["type"] == "ok" and reply["data"]["logs"] == '{"a":[1,"é"],"b":{"c":null}}', reply

        # msgpack carries what JSON cannot: the caller's error (it was an internal error, is_user_error false)
        reply = await rt.side_call("instantiate", req_id="bytes", prompt=[1], module_id=module_id,
                                   module_arg={"a": b"\x00"})
        assert reply["type"] == "error" and reply["is_user_error"] and reply["code"] == "invalid_request", reply
        assert reply["error"] == "module_arg is not a JSON value: Object of type bytes is not JSON serializable"
