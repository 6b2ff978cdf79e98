"""The controller runtime's state machine: instantiated controllers waiting for a sequence, live
sequences, and the AICI runtime protocol's calls (instantiate, post_pre_process, mid_process) over them.

Every per-sequence failure (trap, timeout, memory limit, bad host call, invalid result) becomes that
sequence's ``error``; the other sequences of the call proceed. A failed sequence keeps answering with
its error until the scheduler frees it.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import time
from collections.abc import Iterator
from typing import Any, TypeVar

import structlog

from common import aici_wire
from common.config import Controllers, Steering
from common.errors import INVALID_REQUEST, RATE_LIMITED
from common.wire import Principal
from controllers.native.base import NativeController
from services.controller_runtime.budget import CpuShare, OpClock, UserBudgets
from services.controller_runtime.host import RequestState, SeqHost, VariableStore
from services.controller_runtime.instances import SAMPLE, Instance, NativeInstance, WasmInstance
from services.controller_runtime.registry import ModuleRegistry, RegistryError
from services.controller_runtime.steering import Effects, SteerScope
from services.controller_runtime.tokenizer import TokenizerInfo
from services.controller_runtime.wasm import ControllerError, WasmController, WasmEngine

log = structlog.get_logger()

NATIVE_PREFIX = "native:"
CAPABILITIES = {"fork": True, "backtrack": True, "ff_tokens": True}
LOCAL = Principal(user="local")  # who instantiates when no one is named (in-process callers)
# the reply for a pre_process the guest lets the runtime skip (shared: only ever encoded)
PRE_DEFAULT_REPLY = aici_wire.PreOutcome(result=aici_wire.PreProcessResult())
O = TypeVar("O", bound=aici_wire.SeqOutcome)


class UserError(ValueError):
    """A request the caller got wrong (unknown module, duplicate req_id...); ``code`` is the client-facing
    error code the side channel's reply names."""

    code = INVALID_REQUEST


class OverBudget(UserError):
    """A user past their controller budget (CPU time, live controlled requests): retry later."""

    code = RATE_LIMITED


def module_arg_bytes(arg: Any) -> bytes:
    """AICI: a string module_arg is passed as is, any other JSON value serialized (msgpack callers may
    also send bytes). UserError: a value JSON cannot hold (bytes inside it, nesting past the serializer's)."""
    if isinstance(arg, bytes):
        return arg
    try:
        return aici_wire.module_arg_text(arg).encode()
    except (TypeError, ValueError, RecursionError) as exc:
        raise UserError(f"module_arg is not a JSON value: {exc}") from exc


def seq_result(outcome: type[O], host: SeqHost, micros: int, result: Any = None, error: str = "") -> O:
    """A sequence's outcome of one callback, with what it logged and stored."""
    if error and not error.startswith("controller already failed"):
        log.info("controller_runtime.seq_failed", req_id=host.request.req_id, seq_id=host.seq_id, error=error[:500])
    if not host.logs and not host.storage_log:  # the usual step (the host's empty list stays its own)
        return outcome(error=error, result=result, micros=micros)
    return outcome(error=error, result=result, storage=host.storage_log, logs=host.logs_text(), micros=micros)


class CallLedger:
    """The controller time of one main-channel call per user, charged to the budgets once at its end. Refusals
    are those of charging every callback as it ends: a user's callbacks are refused from the first one after
    their credit (as of the call's start) is spent, this call's spending included. Callbacks are timed by the
    wall clock; what is charged is that time scaled by the call's :class:`CpuShare`."""

    __slots__ = ("budgets", "spent", "credit", "cpu")

    def __init__(self, budgets: UserBudgets, cpu: CpuShare) -> None:
        self.budgets = budgets
        self.cpu = cpu
        self.spent: dict[str, float] = {}
        self.credit: dict[str, float] = {}  # each user's credit when first seen in this call (inf: no limit)

    def allows(self, user: str) -> bool:
        """Whether ``user``'s next callback may run (else :meth:`refusal` says why)."""
        credit = self.credit.get(user)
        if credit is None:
            budgets = self.budgets
            credit = self.credit[user] = budgets.credit_s(user, time.monotonic()) if budgets.share else math.inf
        return self.spent.get(user, 0.0) < credit

    def refusal(self, user: str) -> str:
        """After :meth:`allows` said no: why ``user``'s next callback may not run, with what they spent so far
        charged ("": the bucket refilled meanwhile, it may run)."""
        now = time.monotonic()
        budgets = self.budgets
        budgets.charge(user, self.spent.pop(user, 0.0) * self.cpu.share(), now)
        refusal = budgets.exhausted(user, now)
        self.credit[user] = -math.inf if refusal else budgets.credit_s(user, now)
        return refusal

    def spend(self, user: str, start: float) -> int:
        """Book the wall time since ``start`` to ``user``; returns it in µs."""
        elapsed = time.perf_counter() - start
        self.spent[user] = self.spent.get(user, 0.0) + elapsed
        return int(elapsed * 1e6)

    def settle(self) -> None:
        now, share = time.monotonic(), self.cpu.share()
        for user, seconds in self.spent.items():
            self.budgets.charge(user, seconds * share, now)
        self.spent.clear()


class Runtime:
    def __init__(self, settings: Controllers, tokenizer: TokenizerInfo, engine: WasmEngine,
                 registry: ModuleRegistry, natives: dict[str, type[NativeController]],
                 steering: Steering | None = None) -> None:
        self.settings = settings
        self.steering = steering or Steering()  # the bounds of what controllers may steer with (tiller_steer)
        self.effects = Effects()  # what the main-channel call under way reports besides its results
        self.tokenizer = tokenizer
        self.engine = engine
        self.registry = registry
        self.natives = natives
        self.pending: dict[str, tuple[float, Instance]] = {}  # req_id -> (created, instance) not yet bound
        self.seqs: dict[int, Instance] = {}
        self._row_bytes = tokenizer.mask_words * 4
        # a user's whole mid deadline, which is what they get while they used less than the slack of this step
        self._mid_full_ms = self._mid_deadline_ms(0.0)
        self._mid_slack_ms = settings.mid_deadline_ms - self._mid_full_ms + settings.epoch_tick_ms
        self.budgets = UserBudgets(settings.user_cpu_share, settings.user_cpu_burst_s, settings.max_controlled_per_user)
        self.op_clock = OpClock()

    # -- side channel: instantiate (runs in a worker thread) ----------------------------------------------
    def instantiate(self, req_id: Any, prompt: Any, module_ref: Any, module_arg: Any,
                    who: Principal = LOCAL) -> tuple[bool, aici_wire.InitOutcome]:
        """Create and initialise a controller for ``who`` (a tag: one they see); returns (ok, its outcome: the
        AICI SequenceResult)."""
        user = who.user
        if not isinstance(req_id, str) or not req_id:
            raise UserError("instantiate needs a string req_id")
        self._expire_pending()
        if req_id in self.pending:
            raise UserError(f"req_id {req_id!r} is already instantiated")
        if isinstance(prompt, str):
            prompt = self.tokenizer.tokenize(prompt.encode())
        if not isinstance(prompt, list) or not all(isinstance(t, int) and 0 <= t < self.tokenizer.vocab_size
                                                   for t in prompt):
            raise UserError("prompt must be a list of token ids in the vocabulary (or a string)")
        if not isinstance(module_ref, str) or not module_ref:
            raise UserError("instantiate needs a module_id (module id, tag or native:<name>)")
        if refusal := self.budgets.refusal(user, time.monotonic()):
            raise OverBudget(refusal)
        request = RequestState(req_id, module_arg_bytes(module_arg), VariableStore(self.settings.max_storage_bytes),
                               user=user, effects=self.effects)
        host = SeqHost(self.tokenizer, request, CAPABILITIES, self.settings.max_log_bytes, self.settings.max_constraints)
        cpu = CpuShare()
        instance: Instance | None = None
        try:
            with self.engine.ticker:  # a span: the epoch ticker stays awake between its guest calls
                instance = self._make_instance(module_ref, host, who)  # (a Wasm start function runs here)
                instance.setup(prompt)
        except ControllerError as exc:  # as in AICI: a failed start is the sequence's result, not a refusal
            if instance is not None:
                instance.close()
            return False, seq_result(aici_wire.InitOutcome, host, self._charge(host, cpu), error=str(exc))
        request.live_seqs = 1
        self.budgets.started(user, time.monotonic())
        self.pending[req_id] = (time.monotonic(), instance)
        return True, seq_result(aici_wire.InitOutcome, host, self._charge(host, cpu), result={})

    def _charge(self, host: SeqHost, cpu: CpuShare) -> int:
        """The microseconds since ``cpu`` began; their CPU time is charged to the sequence's user."""
        self.budgets.charge(host.request.user, cpu.cpu_s(), time.monotonic())
        return int(cpu.wall_s() * 1e6)

    @contextlib.contextmanager
    def _main_call(self) -> Iterator[CallLedger]:
        """One main-channel call: its ledger (settled at the end) on the call's CPU clock, within a span of the
        epoch ticker (which stays awake between the call's guest calls)."""
        ledger = CallLedger(self.budgets, self.op_clock.begin())
        with self.engine.ticker:
            try:
                yield ledger
            finally:
                ledger.settle()

    def _ended(self, instance: Instance) -> None:
        request = instance.host.request
        request.live_seqs -= 1
        if request.live_seqs <= 0:
            self.budgets.ended(request.user, time.monotonic())
        instance.close()

    def _expire_pending(self) -> None:
        """Drop instances whose request never reached the GPU (cancelled before its first step)."""
        cutoff = time.monotonic() - self.settings.pending_ttl_s
        for req_id, (created, instance) in list(self.pending.items()):
            if created < cutoff and self.pending.pop(req_id, None) is not None:
                self._ended(instance)

    def _make_instance(self, module_ref: str, host: SeqHost, who: Principal) -> Instance:
        """A sequence's controller from ``module_ref``: an unknown module raises UserError (a refusal), a
        module that fails to instantiate ControllerError (a failed start)."""
        if module_ref.startswith(NATIVE_PREFIX):
            cls = self.natives.get(module_ref[len(NATIVE_PREFIX):])
            if cls is None:
                raise UserError(f"unknown native controller {module_ref!r}; configured: "
                                f"{sorted(NATIVE_PREFIX + n for n in self.natives)}")
            return NativeInstance(cls, host, self.settings, self.op_clock)
        try:
            _, module = self.registry.resolve(module_ref, who)
        except RegistryError as exc:
            raise UserError(str(exc)) from exc
        return WasmInstance(WasmController(self.engine, module, host), self.settings)

    # -- main channel ----------------------------------------------------------------------------------
    def free(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            instance = self.seqs.pop(seq_id, None)
            if instance is not None:
                self._ended(instance)

    def post_pre_process(self, req: aici_wire.PostPreProcess) -> aici_wire.PostPreProcessReply:
        """The op without ``mid_ahead`` (:meth:`post_pre_mid` takes that)."""
        return self._post_pre_process(req)

    def _post_pre_process(self, req: aici_wire.PostPreProcess) -> aici_wire.PostPreProcessReply:
        if req.reset:  # a restarted scheduler: the sequences bound so far belong to requests that are gone
            self.free(list(self.seqs))
        self.free(req.freed)
        for readout in req.readouts:
            if (instance := self.seqs.get(readout.id)) is not None:
                instance.host.last_readout = readout.values
        with self._main_call() as ledger:
            post_seqs = self._posts(req, ledger)
            pre_seqs: dict[str, aici_wire.PreOutcome] = {}
            for op in req.pre_ops:
                error = self._bind(op)
                if error:
                    pre_seqs[str(op.id)] = aici_wire.PreOutcome(error=error)
            ahead = set(req.ahead)
            waiting, defaults = [], []
            for seq_id, instance in self.seqs.items():
                key = str(seq_id)
                if key in pre_seqs:
                    continue
                if instance.pre_default:
                    pre_seqs[key] = PRE_DEFAULT_REPLY
                    defaults.append(seq_id)
                elif seq_id in ahead:  # its step went out already: pre_process runs before its next one
                    waiting.append(seq_id)
                else:
                    pre_seqs[key] = self._pre(instance, ledger)
        reply = aici_wire.PostPreProcessReply(post_seqs=post_seqs, pre_seqs=pre_seqs, waiting=waiting,
                                              pre_default=defaults)
        self.effects.into(reply)
        return reply

    def post_pre_mid(self, req: aici_wire.PostPreProcess) -> tuple[aici_wire.PostPreProcessReply, bytearray]:
        """post_pre_process, then (``req.mid_ahead``) mid_process for the ``ahead`` sequences that go on: those whose
        post_process neither stopped nor failed them and whose pre_process is the default (what the scheduler
        samples of a step that went ahead), in ``ahead`` order; returns (reply, their mask rows)."""
        reply = self._post_pre_process(req)
        if not req.mid_ahead:
            return reply, bytearray()
        ended = {int(key) for key, post in reply.post_seqs.items()
                 if post.error or (post.result is not None and post.result.stop)}
        defaults = set(reply.pre_default)
        going = [seq_id for seq_id in req.ahead if seq_id in defaults and seq_id not in ended]
        if not going:
            reply.mid = aici_wire.MidProcessReply()
            return reply, bytearray()
        reply.mid, rows = self._mid_process(aici_wire.MidProcess(ops=[aici_wire.MidOp(id=s) for s in going]))
        reply.mid_ids = going
        return reply, rows

    def _bind(self, op: aici_wire.PreOp) -> str:
        """Bind ``op.req_id``'s instance to ``op.id``. The scheduler never reuses a live id, so an id that
        is still bound belongs to a sequence it lost (e.g. it restarted): that instance is dropped."""
        if op.id in self.seqs:
            log.info("controller_runtime.rebind", seq_id=op.id, req_id=op.req_id)
            self.free([op.id])
        entry = self.pending.pop(op.req_id, None)
        if entry is None:
            return f"no instantiated controller for req_id {op.req_id!r}"
        instance = entry[1]
        host = instance.host
        host.seq_id = op.id
        host.request.steering = SteerScope.of(op, self.steering)
        if host.readouts_wanted:  # asked for in init_prompt
            host.readouts_on()
        self.seqs[op.id] = instance
        return ""

    def _posts(self, req: aici_wire.PostPreProcess, ledger: CallLedger) -> dict[str, aici_wire.PostOutcome]:
        """post_process of the post_ops. Those of ``ahead`` sequences run beside the forward pass, as mid_process
        does, where a busy host may hold the runtime off the CPU for longer than ``post_deadline_ms``: they share
        their user's ``mid_deadline_ms`` for the step, as their mid_process calls do."""
        if not req.ahead:
            return {str(op.id): self._post(op.id, op.tokens, op.backtrack, ledger) for op in req.post_ops}
        ahead, used_ms = set(req.ahead), {}
        posts = {}
        full_ms, slack_ms = self._mid_full_ms, self._mid_slack_ms
        for op in req.post_ops:
            deadline_ms = None
            if op.id in ahead and (instance := self.seqs.get(op.id)) is not None:
                user = instance.host.request.user
                used = used_ms.get(user, 0.0)  # (as in mid_process: the whole deadline while under the slack)
                deadline_ms = full_ms if used < slack_ms else self._mid_deadline_ms(used)
            posts[str(op.id)] = post = self._post(op.id, op.tokens, op.backtrack, ledger, deadline_ms)
            if deadline_ms is not None:
                used_ms[user] = used_ms.get(user, 0.0) + post.micros / 1000
        return posts

    def _post(self, seq_id: int, tokens: list[int], backtrack: int, ledger: CallLedger,
              deadline_ms: float | None = None) -> aici_wire.PostOutcome:
        instance = self.seqs.get(seq_id)
        if instance is None:
            return aici_wire.PostOutcome(error=f"unknown sequence {seq_id}")
        host = instance.host
        start = time.perf_counter()
        try:
            result = instance.post_process(tokens, backtrack, deadline_ms)
        except ControllerError as exc:
            return seq_result(aici_wire.PostOutcome, host, ledger.spend(host.request.user, start), error=str(exc))
        return seq_result(aici_wire.PostOutcome, host, ledger.spend(host.request.user, start), result=result)

    def _pre(self, instance: Instance, ledger: CallLedger) -> aici_wire.PreOutcome:
        """pre_process (one the guest flags as the default is not called: the caller answers it); ff_tokens
        it asks for are fed straight back to post_process (up to max_ff_rounds times), as AICI v0.0.x does,
        so the scheduler never reports them in post_ops."""
        host = instance.host
        if not ledger.allows(host.request.user) and (refusal := ledger.refusal(host.request.user)):
            return seq_result(aici_wire.PreOutcome, host, 0, error=refusal)
        start = time.perf_counter()
        logs, storage, ff = [], [], []
        try:
            result = instance.pre_process()
            if result.num_forks == 1 and not result.ff_tokens:  # the usual step: no fork, nothing to fast-forward
                return seq_result(aici_wire.PreOutcome, host, ledger.spend(host.request.user, start), result=result)
            for round_ in range(self.settings.max_ff_rounds):
                if round_:
                    result = instance.pre_process()
                logs.append(host.logs_text())
                storage += host.storage_log
                if result.num_forks != 1 or result.suspend or not result.ff_tokens:
                    break
                ff += result.ff_tokens
                post = instance.post_process(result.ff_tokens, 0)
                logs.append(host.logs_text())
                storage += host.storage_log
                if post.stop:
                    result = aici_wire.PreProcessResult(num_forks=0)
                    break
            if result.num_forks > 1:
                live = host.request.live_seqs + result.num_forks - 1
                if live > self.settings.max_forks:
                    raise ControllerError(f"fork into {result.num_forks} would make {live} sequences for the "
                                          f"request, more than max_forks {self.settings.max_forks}")
        except ControllerError as exc:
            logs.append(host.logs_text())
            failed = seq_result(aici_wire.PreOutcome, host, ledger.spend(host.request.user, start), error=str(exc))
            failed.storage, failed.logs = storage + host.storage_log, "".join(logs)
            return failed
        if ff:
            result = aici_wire.PreProcessResult(num_forks=result.num_forks, suspend=result.suspend,
                                                ff_tokens=ff + result.ff_tokens)
        return aici_wire.PreOutcome(result=result, storage=storage, logs="".join(logs),
                                    micros=ledger.spend(host.request.user, start))

    def _mid_deadline_ms(self, used_ms: float) -> float:
        """What is left of a user's ``mid_deadline_ms`` in this step after ``used_ms``, in whole epoch ticks;
        at least a short call's deadline (``pre_deadline_ms``), so that their well-behaved controllers
        still run."""
        s = self.settings
        left = max(s.mid_deadline_ms - used_ms, min(s.pre_deadline_ms, s.mid_deadline_ms))
        return math.ceil(left / s.epoch_tick_ms) * s.epoch_tick_ms

    def mid_process(self, req: aici_wire.MidProcess) -> tuple[aici_wire.MidProcessReply, bytearray]:
        return self._mid_process(req)

    def _mid_process(self, req: aici_wire.MidProcess) -> tuple[aici_wire.MidProcessReply, bytearray]:
        """Fork the clones, then run mid_process for every op in order; returns (reply, mask rows).
        ``mid_deadline_ms`` bounds each user's sequences of the step together (the step waits for the
        masks): once they used it, the user's next ones get a short call's deadline, so a user whose
        controllers loop holds the step up by about one deadline, not one per sequence."""
        rows = bytearray(len(req.ops) * self._row_bytes)
        base = ctypes.addressof(ctypes.c_char.from_buffer(rows)) if rows else 0
        seqs: dict[str, aici_wire.MidOutcome] = {}
        groups: dict[int, list[int]] = {}  # fork groups of the clones and their parents; others are alone
        failed: dict[int, str] = {}
        for op in req.ops:
            if op.clone_id is None:
                continue
            if op.id in self.seqs:
                failed[op.id] = f"sequence {op.id} already exists; cannot clone {op.clone_id} into it"
                continue
            parent = self.seqs.get(op.clone_id)
            if parent is None:
                failed[op.id] = f"unknown clone_id {op.clone_id}"
                continue
            if parent.host.request.live_seqs >= self.settings.max_forks:
                failed[op.id] = f"request already has max_forks {self.settings.max_forks} sequences"
                continue
            try:
                self.seqs[op.id] = parent.fork(op.id)
            except ControllerError as exc:
                failed[op.id] = str(exc)
                continue
            parent.host.request.live_seqs += 1
            groups.setdefault(op.clone_id, [op.clone_id]).append(op.id)
            groups[op.id] = groups[op.clone_id]
        used_ms: dict[str, float] = {}  # user -> mid_process time of their sequences so far in this step
        row_bytes, live, full_ms, slack_ms = self._row_bytes, self.seqs, self._mid_full_ms, self._mid_slack_ms
        with self._main_call() as ledger:
            for i, op in enumerate(req.ops):
                seq_id = op.id
                instance = live.get(seq_id)
                if instance is None or (failed and seq_id in failed):
                    seqs[str(seq_id)] = aici_wire.MidOutcome(error=failed.get(seq_id, f"unknown sequence {seq_id}"))
                    continue
                host = instance.host
                user = host.request.user
                if not ledger.allows(user) and (refusal := ledger.refusal(user)):
                    seqs[str(seq_id)] = seq_result(aici_wire.MidOutcome, host, 0, error=refusal)
                    continue
                start = time.perf_counter()
                used = used_ms.get(user, 0.0)
                deadline_ms = full_ms if used < slack_ms else self._mid_deadline_ms(used)
                try:
                    result = instance.mid_process(groups.get(seq_id) if groups else None, base + i * row_bytes,
                                                  deadline_ms)
                except ControllerError as exc:
                    result, error = None, str(exc)
                else:
                    error = ""
                micros = ledger.spend(user, start)
                used_ms[user] = used_ms.get(user, 0.0) + micros / 1000
                seqs[str(seq_id)] = seq_result(aici_wire.MidOutcome, host, micros, error=error,
                                               result=None if error or result is SAMPLE else _as_replied(result))
        reply = aici_wire.MidProcessReply(seqs=seqs, num_seqs=len(req.ops))
        self.effects.into(reply)
        return reply, rows


def _as_replied(result: aici_wire.MidProcessResult) -> aici_wire.MidProcessResult | None:
    """The reply's ``result``: null when the sequence samples under its mask (the AICI runtime protocol), else "Stop" or
    the Splice."""
    if isinstance(result, str) or result.SampleWithBias is None:
        return result
    return None
