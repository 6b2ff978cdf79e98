"""Controller runtime: the main channel (step-synchronous, from the scheduler) and the side channel
(asynchronous, from the gateway), both ROUTER sockets speaking the AICI runtime protocol's shapes as msgpack.

Main-channel replies are ``[identity, header]``, plus for mid_process one binary frame with the
packed mask rows (controllers/ABI.md). Main calls run on the event loop (µs each, bounded by the
per-call deadlines), answered from its reader callback (``common.sockets.LoopReader``: no future or task
per message, which took about half of the runtime's main-thread time, py-spy ``--gil`` during
``controller_bench.py --json 16``); side calls that compile or run
controller code (mk_module, instantiate) run in worker threads so they never hold up a step.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import os
from typing import Any

import structlog
import zmq
import zmq.asyncio

from common import aici_wire
from common.config import Settings
from common.errors import WireError
from common.incarnation import process_incarnation
from common.model_source import resolve_model
from common.quotas import QuotaExceeded
from common.sockets import MAX_MESSAGE_BYTES, LoopReader, bind, copy_flag
from common.wire import Principal
from controllers.native import load_native_controllers
from services.controller_runtime.registry import ModuleRegistry, RegistryError
from services.controller_runtime.runtime import Runtime, UserError
from services.controller_runtime.tokenizer import TokenizerInfo
from services.controller_runtime.wasm import WasmEngine

log = structlog.get_logger()

DEFAULT_AUTH = {"user": "local", "is_admin": False}


class ControllerRuntime:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        cfg = settings.controllers
        lower_priority(cfg.nice)  # first: the threads started below (epoch ticker, ZeroMQ, to_thread) inherit it
        self.incarnation = process_incarnation()  # in every main-channel reply
        self.tokenizer = TokenizerInfo.from_directory(resolve_model(settings).directory)
        self.vocab_size = self.tokenizer.vocab_size
        self.engine = WasmEngine(cfg, self.tokenizer)
        self.registry = ModuleRegistry(settings.controller_module_dir, self.engine, settings.tenants)
        self.runtime = Runtime(cfg, self.tokenizer, self.engine, self.registry,
                               load_native_controllers(cfg.native), settings.steering)
        ctx = zmq.asyncio.Context.instance()
        self.main = self._bind(ctx, settings.endpoint("controller_main"))
        self.side = self._bind(ctx, settings.endpoint("controller_side"))

    def _bind(self, ctx: zmq.asyncio.Context, endpoint: str) -> zmq.asyncio.Socket:
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        bind(sock, endpoint, self.settings.curve)
        return sock

    # -- main channel ----------------------------------------------------------------------------------
    def handle_main(self, frame: bytes) -> tuple[aici_wire.MainOk[Any] | aici_wire.MainError, list[bytes | bytearray]]:
        """The reply header and its binary frames (the mask rows for mid_process)."""
        try:
            request = aici_wire.decode_main(frame)
        except WireError as exc:
            return aici_wire.MainError(error=str(exc), is_user_error=True), []
        try:
            match request:
                case aici_wire.Ping():
                    return aici_wire.MainOk(data=aici_wire.Pong()), []
                case aici_wire.Tokens():
                    tokens = aici_wire.TokensReply(vocab_size=self.vocab_size, eos_token_id=self.tokenizer.eos_token)
                    return aici_wire.MainOk(data=tokens), []
                case aici_wire.PostPreProcess():
                    data, rows = self.runtime.post_pre_mid(request)
                    return aici_wire.MainOk(data=data), [rows] if request.mid_ahead else []
                case aici_wire.MidProcess():
                    data, rows = self.runtime.mid_process(request)
                    return aici_wire.MainOk(data=data), [rows]
        except Exception as exc:  # noqa: BLE001 - a runtime bug answers this call, the service goes on
            log.exception("controller_runtime.main_failed", op=type(request).__name__)
            return aici_wire.MainError(error=f"internal error: {type(exc).__name__}: {exc}"), []
        return aici_wire.MainError(error="unknown op", is_user_error=True), []

    # -- side channel ----------------------------------------------------------------------------------
    async def handle_side(self, frame: bytes) -> dict:
        try:
            request = aici_wire.decode_side(frame)
        except aici_wire.SideRequestError as exc:
            echo = {} if exc.rid is None else {"$rid": exc.rid}
            return aici_wire.error(str(exc), is_user_error=True, **echo)
        except WireError as exc:
            return aici_wire.error(str(exc), is_user_error=True)
        rid = {"$rid": request["$rid"]}
        auth = request.get("$auth") if isinstance(request.get("$auth"), dict) else DEFAULT_AUTH
        who = Principal(user=str(auth.get("user", "local")), admin=auth.get("is_admin") is True)
        op = request.get("op")
        bound = structlog.contextvars.bound_contextvars(rid=request["$rid"], op=op, user=who.user)
        with bound:
            try:
                if op == "mk_module":
                    data = await asyncio.to_thread(self.registry.create, _binary(request), who.user)
                elif op == "set_tags":
                    data = {"tags": self.registry.set_tags(request.get("module_id"), request.get("tags"), who)}
                elif op == "get_tags":
                    data = {"tags": self.registry.get_tags(who)}
                elif op == "instantiate":
                    ok, data = await asyncio.to_thread(
                        self.runtime.instantiate, request.get("req_id"), request.get("prompt"),
                        request.get("module_id"), request.get("module_arg"), who)
                    if not ok:
                        log.info("controller_runtime.instantiate_failed", error=data.error)
                        return aici_wire.error(data.error, is_user_error=True, **rid) | {"data": data}
                else:
                    return aici_wire.error(f"unknown side-channel op {op!r}", is_user_error=True, **rid)
            except UserError as exc:
                return aici_wire.error(str(exc), is_user_error=True, code=exc.code, **rid)
            except RegistryError as exc:
                return aici_wire.error(str(exc), is_user_error=True, **rid)
            except QuotaExceeded as exc:  # the gateway answers 429
                return aici_wire.error(exc.message, is_user_error=True, code=exc.code, **rid)
            except Exception as exc:  # noqa: BLE001
                log.exception("controller_runtime.side_failed")
                return aici_wire.error(f"internal error: {type(exc).__name__}: {exc}", is_user_error=False, **rid)
        return aici_wire.ok(data, **rid)

    def _answer_main(self, parts: list[bytes]) -> None:
        if len(parts) < 2:
            return
        try:
            reply, binary = self.handle_main(parts[1])
            reply.incarnation = self.incarnation
            frames = [parts[0], aici_wire.encode(reply), *binary]
        except Exception:  # noqa: BLE001 - the reader goes on with the next message
            log.exception("controller_runtime.main_reply_failed")
            return
        self._main_io.try_send(frames, copy_flag(binary))  # a ROUTER never waits: it drops for a peer that is gone

    def _answer_side(self, parts: list[bytes]) -> None:
        if len(parts) < 2:
            return
        task = asyncio.create_task(self._side_reply(parts[0], parts[1]))
        self._side_calls.add(task)
        task.add_done_callback(self._side_calls.discard)

    async def _side_reply(self, identity: bytes, frame: bytes) -> None:
        self._side_io.try_send([identity, aici_wire.encode(await self.handle_side(frame))], True)

    async def run(self) -> None:
        log.info("controller_runtime.ready", main=self.settings.endpoint("controller_main"),
                 side=self.settings.endpoint("controller_side"), vocab_size=self.vocab_size,
                 natives=sorted(self.runtime.natives), module_dir=str(self.settings.controller_module_dir))
        self._side_calls: set[asyncio.Task] = set()  # side calls in progress
        self._main_io = LoopReader(self.main, self._answer_main)
        self._side_io = LoopReader(self.side, self._answer_side)
        try:
            await asyncio.Event().wait()  # the readers answer from the event loop until the service stops
        finally:
            self._main_io.close()
            self._side_io.close()


def lower_priority(nice: int) -> None:
    """Run at Unix priority ``nice`` at least (Linux keeps it per thread: call before starting any)."""
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if nice > current:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
        log.info("controller_runtime.nice", nice=nice)


def _binary(request: dict[str, Any]) -> bytes:
    binary = request.get("binary")
    if isinstance(binary, bytes):  # msgpack callers may send raw bytes
        return binary
    if not isinstance(binary, str):
        raise UserError("mk_module needs 'binary': the base64-encoded Wasm module")
    try:
        return base64.b64decode(binary, validate=True)
    except binascii.Error as exc:
        raise UserError(f"mk_module 'binary' is not valid base64: {exc}") from exc
