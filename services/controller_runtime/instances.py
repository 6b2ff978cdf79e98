"""One interface over Wasm and native controllers: typed callbacks with deadlines, results validated
against the ABI's JSON shapes, failures turned into ControllerError."""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec

from common import aici_wire
from common.config import Controllers
from common.wire import DECODE_ERRORS
from controllers.native.base import FF_MIN, NativeController
from services.controller_runtime.budget import CpuShare, OpClock
from services.controller_runtime.host import HostError, SeqHost
from services.controller_runtime.wasm import ControllerError, WasmController

class ResultDecoder:
    """A callback's JSON result decoded into its type; the results nearly every step returns (as the SDK
    writes them) are decoded once and shared (nothing mutates a result)."""

    def __init__(self, ty: Any, common: tuple[bytes, ...]) -> None:
        self.decoder = msgspec.json.Decoder(ty)
        self.common = {raw: self.decoder.decode(raw) for raw in common}

    def decode(self, raw: bytes) -> Any:
        result = self.common.get(raw)
        return self.decoder.decode(raw) if result is None else result


_pre_decoder = ResultDecoder(aici_wire.PreProcessResult, (b'{"num_forks":1,"suspend":false,"ff_tokens":[]}',))
_post_decoder = ResultDecoder(aici_wire.PostProcessResult, (b'{"stop":false}', b'{"stop":true}'))
_mid_decoder = ResultDecoder(aici_wire.MidProcessResult, (b'{"SampleWithBias":{}}',))
SAMPLE = _mid_decoder.decode(b'{"SampleWithBias":{}}')
CONTINUE, STOPPED = _post_decoder.decode(b'{"stop":false}'), _post_decoder.decode(b'{"stop":true}')
PRE_STOPPED = aici_wire.PreProcessResult(num_forks=0)
_SAMPLE_DICT = {"SampleWithBias": {}}


def _native_mid(value: Any) -> aici_wire.MidProcessResult:
    """A native controller's mid_process result, typed ("Stop" or a MidBranch; msgspec's conversion to the
    union costs ~15 µs a call, to the struct ~1 µs)."""
    if isinstance(value, str):
        if value == "Stop":
            return "Stop"
        raise msgspec.ValidationError(f"expected \"Stop\" or an object, got {value!r:.100}")
    return SAMPLE if value == _SAMPLE_DICT else msgspec.convert(value, aici_wire.MidBranch)


def _check_mid(result: aici_wire.MidProcessResult, host: SeqHost) -> aici_wire.MidProcessResult:
    if isinstance(result, aici_wire.MidBranch):
        if (result.SampleWithBias is None) == (result.Splice is None):
            raise ControllerError("mid_process result must have exactly one of SampleWithBias, Splice")
        if result.SampleWithBias is not None and not host.mask_set:
            raise ControllerError("mid_process returned SampleWithBias without returning a logit bias")
        if result.Splice is not None and (why := _outside_vocab("mid_process", "Splice.ff_tokens",
                                                                 result.Splice.ff_tokens, host)):
            raise ControllerError(why)
    return result


def _outside_vocab(name: str, field: str, tokens: list[int], host: SeqHost) -> str:
    """Why ``tokens`` of a result are invalid: they hold ids past the vocabulary (a worker cannot feed them; their
    text was empty, a negative one indexed the vocabulary from its end); '' when they are not."""
    vocab = host.tokenizer.vocab_size
    if not tokens or max(tokens) < vocab:
        return ""
    bad = sorted({t for t in tokens if t >= vocab})
    return f"{name} returned an invalid result: {field} {bad[:8]} outside the vocabulary of {vocab}"


class WasmInstance:
    def __init__(self, ctrl: WasmController, deadlines: Controllers) -> None:
        self.ctrl = ctrl
        self.host = ctrl.host
        self.d = deadlines
        self._alone: tuple[int, bytes] = (-1, b"")  # (seq_id, mid_process's argument while it has no fork)
        self._mask_bytes = ctrl.host.tokenizer.mask_words * 4
        self._io_area = ctrl.module.has_io  # without one the guest declares nothing: every callback is called
        self._eos = ctrl.host.tokenizer.eos_token
        # tokens the host committed to the guest's declared constraint for it, not yet handed over
        self._committed: list[int] = []

    def _invoke(self, export: str, arg: bytes, deadline: float, decoder: ResultDecoder,
                mask_address: int | None = None, stopped: Any = None) -> Any:
        """Call ``export``; tokens committed for the guest are handed over first, and when it stops on them
        the call is not made: ``stopped`` is its result."""
        if self._committed:
            return self._hand_over(export, arg, deadline, decoder, mask_address, stopped)
        raw = self.ctrl.invoke(export, arg, deadline, mask_address)
        try:
            return decoder.decode(raw)
        except DECODE_ERRORS as exc:
            self.ctrl.dead = f"{export} returned an invalid result: {exc}"
            raise ControllerError(self.ctrl.dead) from exc

    def _hand_over(self, export: str, arg: bytes, deadline: float, decoder: ResultDecoder,
                   mask_address: int | None, stopped: Any) -> Any:
        """The tokens the host committed for the guest (declared post_process calls it answered) go to it in one
        post_process marked ``committed``, then ``export`` runs unless that stopped; what both log and store
        is kept."""
        tokens, self._committed = self._committed, []
        arg_over = b'{"tokens":[%s],"backtrack":0,"committed":true}' % ",".join(map(str, tokens)).encode()
        if self._invoke("aici_post_process", arg_over, deadline, _post_decoder).stop:
            return stopped
        with self.host.keeping_effects():
            return self._invoke(export, arg, deadline, decoder, mask_address, stopped)

    def setup(self, prompt: list[int]) -> None:
        self.ctrl.setup(self.d.init_deadline_ms)
        with self.host.keeping_effects():  # what the constructor did
            self.ctrl.invoke("aici_init_prompt", json.dumps({"prompt": prompt}).encode(), self.d.init_deadline_ms)

    @property
    def pre_default(self) -> bool:
        """pre_process would continue with no effect (the guest says so through its I/O area): the runtime
        skips the call."""
        return self._io_area and self.ctrl.pre_default

    def pre_process(self) -> aici_wire.PreProcessResult:
        result = self._invoke("aici_pre_process", b"{}", self.d.pre_deadline_ms, _pre_decoder, stopped=PRE_STOPPED)
        if why := _outside_vocab("aici_pre_process", "ff_tokens", result.ff_tokens, self.host):
            self.ctrl.dead = why
            raise ControllerError(why)
        return result

    def mid_process(self, fork_group: list[int] | None, mask_address: int,
                    deadline_ms: float) -> aici_wire.MidProcessResult:
        """``fork_group`` None: the sequence alone (no fork this step, the common case)."""
        seq_id = self.host.seq_id
        if fork_group is None or fork_group == [seq_id]:
            handle, ff_limit = self.ctrl.mid_constraint if self._io_area else (0, 0)
            if handle:
                splice = self._splice_from(handle, ff_limit) if ff_limit else None
                if splice is not None:
                    return splice
                if self._mask_from(handle, mask_address):
                    return SAMPLE
            if self._alone[0] != seq_id:
                self._alone = (seq_id, b'{"fork_group":[%d]}' % seq_id)
            arg = self._alone[1]
        else:
            arg = b'{"fork_group":[%s]}' % b",".join(b"%d" % i for i in fork_group)
        result = self._invoke("aici_mid_process", arg, deadline_ms, _mid_decoder, mask_address, stopped="Stop")
        if result is SAMPLE and self.host.mask_set:
            return result
        try:
            return _check_mid(result, self.host)
        except ControllerError as exc:
            self.ctrl.dead = str(exc)
            raise

    def _splice_from(self, handle: int, limit: int) -> aici_wire.MidBranch | None:
        """mid_process as the guest declared it when constraint ``handle`` forces FF_MIN tokens or more: a Splice of
        them (at most ``limit``), without calling it; None when it does not (or is unknown)."""
        constraint = self.host.constraints.get(handle)
        tokens = constraint.ff_tokens(limit) if constraint is not None else []
        if len(tokens) < FF_MIN:
            return None
        self.host.begin_call(None)
        return aici_wire.MidBranch(Splice=aici_wire.Splice(ff_tokens=tokens))

    def _mask_from(self, handle: int, mask_address: int) -> bool:
        """mid_process as the guest declared it (the mask of constraint ``handle``), without calling it; False
        (nothing returned) when the constraint is unknown or not OK: then the guest's own mid_process decides."""
        host = self.host
        constraint = host.constraints.get(handle)
        if constraint is None:
            return False
        host.begin_call(mask_address)
        host.mask_set = constraint.fill_mask_going(mask_address, self._mask_bytes)
        return host.mask_set

    def post_process(self, tokens: list[int], backtrack: int, deadline_ms: float | None = None
                     ) -> aici_wire.PostProcessResult:
        """``deadline_ms`` None: ``post_deadline_ms``."""
        if (self._io_area and not backtrack and (handle := self.ctrl.post_constraint(len(tokens)))
                and self._commit_for(handle, tokens)):
            return CONTINUE
        if len(tokens) == 1:
            arg = b'{"tokens":[%d],"backtrack":%d}' % (tokens[0], backtrack)
        else:
            arg = b'{"tokens":[%s],"backtrack":%d}' % (",".join(map(str, tokens)).encode(), backtrack)
        return self._invoke("aici_post_process", arg, deadline_ms or self.d.post_deadline_ms, _post_decoder,
                            stopped=STOPPED)

    def _commit_for(self, handle: int, tokens: list[int]) -> bool:
        """post_process as the guest declared it (commit ``tokens`` to constraint ``handle``, continue), without
        calling it; False (nothing done) when that does not hold: then the guest's own post_process decides."""
        host = self.host
        constraint = host.constraints.get(handle)
        if constraint is None or self._eos in tokens or not constraint.commit_going(tokens):
            return False
        host.begin_call(None)
        self.ctrl.posts_answered(len(tokens))
        self._committed += tokens
        return True

    def fork(self, seq_id: int) -> WasmInstance:
        child = WasmInstance(self.ctrl.fork(seq_id), self.d)
        child._committed = list(self._committed)
        return child

    @property
    def dead(self) -> str:
        return self.ctrl.dead

    def close(self) -> None:
        self.ctrl.close()


class NativeInstance:
    """A trusted Python controller; exceptions and overrun deadlines end the sequence (after the call)."""

    @property
    def pre_default(self) -> bool:
        """The controller says its pre_process would continue with no effect: the runtime skips the call."""
        if self.dead or self.obj is None:
            return False
        try:
            return bool(self.obj.pre_is_default())
        except Exception:  # noqa: BLE001 - pre_process then runs, and fails the sequence as it should
            return False

    def __init__(self, cls: type[NativeController], host: SeqHost, deadlines: Controllers, op_clock: OpClock) -> None:
        self.cls = cls
        self.host = host
        self.d = deadlines
        self.op_clock = op_clock
        self.obj: NativeController | None = None
        self.dead = ""

    def _run(self, name: str, deadline_ms: float, fn, mask_address: int | None = None, cpu: CpuShare | None = None):
        """``fn()`` under ``deadline_ms`` of CPU time: past it on the wall clock, the call fails if the CPU time
        of ``cpu`` (default: the main-channel call in progress) is past it too. Time a busy host held the
        runtime off the CPU fails no controller."""
        if self.dead:
            raise ControllerError(f"controller already failed: {self.dead}")
        self.host.begin_call(mask_address)
        start = time.perf_counter()
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - a controller bug ends only its sequence
            self.dead = f"{name}: {type(exc).__name__}: {exc}" if not isinstance(exc, HostError) else f"{name}: {exc}"
            raise ControllerError(self.dead) from exc
        if (time.perf_counter() - start) * 1000 > deadline_ms:
            cpu_ms = (cpu or self.op_clock.cpu).cpu_s() * 1000
            if cpu_ms > deadline_ms:
                self.dead = f"{name}: deadline of {deadline_ms:g} ms exceeded ({cpu_ms:.1f} ms of CPU)"
                raise ControllerError(self.dead)
        return result

    def _convert(self, name: str, value: Any, ty: Any) -> Any:
        try:
            return msgspec.convert(value, ty)
        except DECODE_ERRORS as exc:
            self.dead = f"{name} returned an invalid result: {exc}"
            raise ControllerError(self.dead) from exc

    def setup(self, prompt: list[int]) -> None:
        def init() -> None:
            self.obj = self.cls(self.host, self.host.request.module_arg)
            self.obj.init_prompt(list(prompt))

        self._run("init_prompt", self.d.init_deadline_ms, init, cpu=CpuShare())  # on the side channel's thread

    def pre_process(self) -> aici_wire.PreProcessResult:
        r = self._run("pre_process", self.d.pre_deadline_ms, self.obj.pre_process)
        result = self._convert("pre_process", r, aici_wire.PreProcessResult)
        if why := _outside_vocab("pre_process", "ff_tokens", result.ff_tokens, self.host):
            self.dead = why
            raise ControllerError(why)
        return result

    def mid_process(self, fork_group: list[int] | None, mask_address: int,
                    deadline_ms: float) -> aici_wire.MidProcessResult:
        """``fork_group`` None: the sequence alone (no fork this step)."""
        group = [self.host.seq_id] if fork_group is None else fork_group
        r = self._run("mid_process", deadline_ms, lambda: self.obj.mid_process(group), mask_address)
        try:
            result = _native_mid(r)
        except DECODE_ERRORS as exc:
            self.dead = f"mid_process returned an invalid result: {exc}"
            raise ControllerError(self.dead) from exc
        try:
            return _check_mid(result, self.host)
        except ControllerError as exc:
            self.dead = str(exc)
            raise

    def post_process(self, tokens: list[int], backtrack: int, deadline_ms: float | None = None
                     ) -> aici_wire.PostProcessResult:
        r = self._run("post_process", deadline_ms or self.d.post_deadline_ms,
                      lambda: self.obj.post_process(tokens, backtrack))
        return self._convert("post_process", r, aici_wire.PostProcessResult)

    def fork(self, seq_id: int) -> NativeInstance:
        if self.dead:
            raise ControllerError(f"cannot fork a failed controller: {self.dead}")
        child = NativeInstance(self.cls, self.host.fork(seq_id), self.d, self.op_clock)
        try:
            child.obj = self.obj.fork(child.host)
        except Exception as exc:  # noqa: BLE001
            raise ControllerError(f"fork: {type(exc).__name__}: {exc}") from exc
        return child

    def close(self) -> None:
        self.obj = None


Instance = WasmInstance | NativeInstance
