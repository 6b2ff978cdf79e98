"""The Wasm host: one wasmtime Engine per process, the ABI's imports (controllers/ABI.md), and one
Store per controlled sequence.

Calls go through wasmtime's *unchecked* C entry points both ways, which cuts a callback from ~100 µs
to ~15 µs: export signatures are checked once when a module is prepared and every guest pointer is
bounds-checked against the memory size. Deadlines use epoch interruption driven by a ticker thread
(CPU time of the calling thread, about the cost of fuel metering); a timeout, trap, memory limit or host
misuse ends only the sequence whose call it was.
"""

from __future__ import annotations

import ctypes
import json
import math
import struct
import threading
import time
from collections.abc import Callable
from ctypes import byref, c_void_p
from threading import get_ident
from dataclasses import dataclass
from importlib.metadata import version

import wasmtime
from wasmtime import _ffi as ffi

from common.config import Controllers
from services.controller_runtime.host import HostError, SeqHost, memmove
from services.controller_runtime.tokenizer import TokenizerInfo

I32, I64 = wasmtime.ValType.i32(), wasmtime.ValType.i64()
BLOB_MODULE_ARG, BLOB_TOKENIZE, BLOB_PROCESS_ARG, BLOB_STORAGE, BLOB_TRIE = 1, 2, 4, 5, 100
WASI_BADF, WASI_PERM = 8, 63
# the optional I/O area (ABI.md "Fast path"): its flags say pre_process is the default / mid_process is the mask
# of constraint (flags >> 8) & IO_HANDLE
IO_HEADER, IO_NONE, IO_PRE_DEFAULT, IO_MID_CONSTRAINT = 16, 0xFFFFFFFF, 1, 2
IO_POST_SHIFT, IO_POST_TOKENS = 2, 0xFC  # flags bits 2-7: tokens whose post_process the host may answer
IO_HANDLE = 0x7FFFFF  # flags bits 8-30: the constraint
IO_MID_FF = 1 << 31  # with IO_MID_CONSTRAINT: mid_process splices the constraint's forced tokens (FF_MIN or more)

# The hot path with plain-address prototypes: no per-call argument conversion. Only the call into the guest
# releases the GIL (so that the epoch ticker can interrupt it); the quick getters and setters keep it
# (PYFUNCTYPE), which saves a GIL hand-over to the ticker thread per call.
_memory_data = ctypes.PYFUNCTYPE(c_void_p, c_void_p, c_void_p)(("wasmtime_memory_data", ffi.dll))
_memory_size = ctypes.PYFUNCTYPE(ctypes.c_size_t, c_void_p, c_void_p)(("wasmtime_memory_data_size", ffi.dll))
_call_unchecked = ctypes.CFUNCTYPE(c_void_p, c_void_p, c_void_p, c_void_p, ctypes.c_size_t, c_void_p)(
    ("wasmtime_func_call_unchecked", ffi.dll))
_set_epoch_deadline = ctypes.PYFUNCTYPE(None, c_void_p, ctypes.c_uint64)(
    ("wasmtime_context_set_epoch_deadline", ffi.dll))
_increment_epoch = ctypes.PYFUNCTYPE(None, c_void_p)(("wasmtime_engine_increment_epoch", ffi.dll))
# host functions: the raw value slots arrive as int32s; argument k is v[4*k] (wasmtime_val_raw is 16 bytes)
_callback_t = ctypes.CFUNCTYPE(ctypes.c_size_t, c_void_p, c_void_p, ctypes.POINTER(ctypes.c_int32), ctypes.c_size_t)
_define_unchecked = ctypes.CFUNCTYPE(c_void_p, c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p,
                                     ctypes.c_size_t, c_void_p, c_void_p, c_void_p, c_void_p)(
    ("wasmtime_linker_define_func_unchecked", ffi.dll))
_no_finalizer = ctypes.CFUNCTYPE(None, c_void_p)(lambda _: None)
_ONE = ctypes.c_size_t(1)  # the argument count of every export call
_io_words = struct.Struct("<II")
_io_none = _io_words.pack(IO_NONE, IO_NONE)

# export name -> (params, results) every module must have (aici_panic is optional)
REQUIRED_EXPORTS = {
    "aici_init": (0, 0), "aici_create": (0, 1), "aici_init_prompt": (1, 0),
    "aici_pre_process": (1, 0), "aici_mid_process": (1, 0), "aici_post_process": (1, 0),
}


class ControllerError(Exception):
    """Ends one sequence; the message goes into its result's ``error``."""


def _cause(text: str) -> str:
    """The cause in a wasmtime error's text: its last line, after the backtrace ('' if none)."""
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""


class Ticker:
    """Advances the engine's epoch every ``period`` seconds of CPU time of the threads running guest calls
    while guest code may run, and sleeps otherwise (a tick counts only for CPU time a running call's thread
    had, :meth:`_computed`: a busy host holding the runtime off the CPU fails no controller's deadline).

    A guest call wakes it when it sleeps (``awake``), and it ticks for as long as any call runs, so every
    call's deadline is enforced, wherever the call comes from. Between the calls of one *span* (``with
    ticker:``, reference-counted: the runtime opens one per main-channel op and per instantiate) it stays
    awake, so a burst of calls pays one wake-up; at its first tick with no call running and no span open it
    sleeps. Through the stack a step's calls come in one or two such bursts a forward pass apart, and each
    tick wakes a thread that takes the GIL: ticking through the gaps cost the runtime more CPU than its
    calls. A span with no guest call (a native controller's, a declared mid_process mask's) wakes nothing."""

    def __init__(self, engine: wasmtime.Engine, period: float) -> None:
        self.engine, self.period = engine, period
        self._engine_addr = ctypes.cast(engine.ptr(), c_void_p).value
        # thread id -> the controller whose export runs on it now (None: none); host functions find theirs here
        self.running: dict[int, WasmController | None] = {}
        self.spans = 0  # spans open, on every thread
        self.awake = False
        # thread running a guest call -> (its controller, the CPU time its counted ticks took, once read)
        self._seen: dict[int, tuple[WasmController, float | None]] = {}
        self._spans_lock = threading.Lock()
        self._wake = threading.Event()
        threading.Thread(target=self._run, name="epoch-ticker", daemon=True).start()

    def __enter__(self) -> None:
        with self._spans_lock:
            self.spans += 1

    def __exit__(self, *_: object) -> None:
        with self._spans_lock:
            self.spans -= 1

    def enter(self, inst: WasmController) -> None:
        """A guest call of ``inst`` begins on this thread (:meth:`leave` when it ends)."""
        self.running[get_ident()] = inst
        if not self.awake:
            self.wake()

    def wake(self) -> None:
        self.awake = True
        self._wake.set()

    def leave(self) -> None:
        self.running[get_ident()] = None

    def _computed(self) -> bool:
        """Whether this tick counts: a thread running a guest call has had a tick's worth of CPU (rounded, half a
        tick or more) that no counted tick took yet; no guest call running: yes (the tick is then no one's). The
        CPU clock is read only for a controller seen running at the tick before too (a call that may be long): a
        tick that finds another call counts without a read, and so does the first read (a deadline's ticks
        already round up by one). A thread's CPU time accrues across ticks, so one on the CPU a third of the
        time has every third tick counted."""
        seen, period, computed, anyone = self._seen, self.period, False, False
        for thread, inst in list(self.running.items()):
            if inst is None:
                seen.pop(thread, None)
                continue
            anyone = True
            last = seen.get(thread)
            if last is None or last[0] is not inst:
                seen[thread] = (inst, None)
                computed = True
                continue
            try:  # (not cached: a thread's id may be reused by the next thread)
                now = time.clock_gettime(time.pthread_getcpuclockid(thread))
            except OSError:  # no clock to read: the wall clock's tick counts
                return True
            counted = last[1]  # the CPU time the counted ticks took
            if counted is None:
                seen[thread] = (inst, now)
                computed = True
            elif now - counted >= period / 2:
                seen[thread] = (inst, counted + period)
                computed = True
        return computed or not anyone

    def _needed(self) -> bool:
        return bool(self.spans) or any(self.running.values())

    def _run(self) -> None:
        engine, period, increment = self._engine_addr, self.period, _increment_epoch
        while True:
            self._wake.wait()
            time.sleep(period)
            if self._computed():
                increment(engine)  # one GIL hold per tick: the increment keeps it
            if not self._needed():
                self.awake = False
                self._wake.clear()
                if self._needed():  # a call began meanwhile (it saw the ticker awake): stay awake
                    self.wake()


@dataclass
class WasmModule:
    """A compiled module ready to instantiate cheaply (imports resolved once)."""

    module: wasmtime.Module
    pre: wasmtime.InstancePre
    mutable_globals: list[str]
    has_panic: bool
    has_io: bool


class WasmEngine:
    def __init__(self, settings: Controllers, tokenizer: TokenizerInfo) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        cfg = wasmtime.Config()
        cfg.epoch_interruption = True
        cfg.cranelift_opt_level = "speed"
        cfg.max_wasm_stack = settings.max_wasm_stack_bytes
        cfg.memory_may_move = False  # a memory's base address is fixed: WasmController caches it
        self.engine = wasmtime.Engine(cfg)
        self.cache_key = f"wasmtime-{version('wasmtime')}-epoch"  # compiled artifacts depend on both
        self.linker = wasmtime.Linker(self.engine)
        self._callbacks: list = []  # keep ctypes callbacks alive
        self.ticker = Ticker(self.engine, settings.epoch_tick_ms / 1000)
        _define_imports(self)
        self.deadline_ticks: dict[float, ctypes.c_uint64] = {}  # deadline ms -> epoch ticks (ticks())

    def ticks(self, deadline_ms: float) -> ctypes.c_uint64:
        """The epoch ticks of a deadline, as the argument of ``wasmtime_context_set_epoch_deadline`` (a ctypes
        object: passed as is, where an int is converted at every call)."""
        ticks = self.deadline_ticks.get(deadline_ms)
        if ticks is None:
            ticks = self.deadline_ticks[deadline_ms] = ctypes.c_uint64(
                math.ceil(deadline_ms / self.settings.epoch_tick_ms) + 1)
        return ticks

    # -- modules ---------------------------------------------------------------------------------------
    def compile(self, wasm: bytes) -> wasmtime.Module:
        try:
            return wasmtime.Module(self.engine, wasm)
        except wasmtime.WasmtimeError as exc:
            raise ControllerError(f"invalid Wasm module: {exc}") from exc

    def deserialize(self, artifact: bytes) -> wasmtime.Module:
        return wasmtime.Module.deserialize(self.engine, artifact)

    def prepare(self, module: wasmtime.Module) -> WasmModule:
        """Check the module against the ABI and resolve its imports; raises ControllerError."""
        exports = {e.name: e.type for e in module.exports}
        memory = exports.get("memory")
        if not isinstance(memory, wasmtime.MemoryType):
            raise ControllerError("module does not export 'memory'")
        if memory.is_shared:
            raise ControllerError("the module's memory is shared: a controller's memory must be its own")
        least = memory.limits.min * memory.page_size
        if least > self.settings.max_memory_bytes:
            raise ControllerError(f"the module's memory starts at {least} bytes, past a controller's limit of "
                                  f"{self.settings.max_memory_bytes} bytes")
        for name, (nparams, nresults) in REQUIRED_EXPORTS.items():
            ty = exports.get(name)
            if not isinstance(ty, wasmtime.FuncType):
                raise ControllerError(f"module does not export function {name!r}")
            if [str(p) for p in ty.params] != ["i32"] * nparams or [str(r) for r in ty.results] != ["i32"] * nresults:
                raise ControllerError(f"export {name!r} has type {ty.params}->{ty.results}, "
                                      f"expected {nparams} i32 params and {nresults} i32 results")
        panic = exports.get("aici_panic")
        if panic is not None and (not isinstance(panic, wasmtime.FuncType) or panic.params or panic.results):
            raise ControllerError("export 'aici_panic' must take and return nothing")
        io = exports.get("tiller_io")
        if io is not None and (not isinstance(io, wasmtime.FuncType) or io.params or [str(r) for r in io.results] != ["i32"]):
            raise ControllerError("export 'tiller_io' must take nothing and return an i32")
        try:
            pre = self.linker.instantiate_pre(module)
        except wasmtime.WasmtimeError as exc:
            raise ControllerError(f"module imports something the host does not provide: {exc}") from exc
        mutable = [n for n, t in exports.items() if isinstance(t, wasmtime.GlobalType) and t.mutable]
        return WasmModule(module, pre, mutable, panic is not None, io is not None)


class WasmController:
    """One sequence's instance: its own Store, memory, host state and controller handle."""

    def __init__(self, engine: WasmEngine, module: WasmModule, host: SeqHost) -> None:
        self.engine = engine
        self.module = module
        self.host = host
        self.handle = 0
        self.dead = ""
        self._ticker, self._deadline_ticks = engine.ticker, engine.deadline_ticks  # read by every call
        self.store = wasmtime.Store(engine.engine)
        self.store.set_limits(memory_size=engine.settings.max_memory_bytes, instances=1, tables=2,
                              table_elements=100_000)
        init_ms = engine.settings.init_deadline_ms  # a start function runs at instantiation, in the init's time
        self.store.set_epoch_deadline(engine.ticks(init_ms).value)
        self._ticker.enter(self)
        try:
            self.instance = module.pre.instantiate(self.store)
        except (wasmtime.WasmtimeError, wasmtime.Trap) as exc:
            if isinstance(exc, wasmtime.Trap) and exc.trap_code == wasmtime.TrapCode.INTERRUPT:
                why = f"its start function ran past the deadline of {init_ms:g} ms"
            else:
                why = _cause(str(exc))
            raise ControllerError(f"instantiation failed: {why}") from exc
        finally:
            self._ticker.leave()
        ex = self.instance.exports(self.store)
        self.exports = ex
        self.memory: wasmtime.Memory = ex["memory"]
        self._ctx = self.store._context()
        self._ctx_addr = ctypes.cast(self._ctx, c_void_p).value
        self._mem_addr = ctypes.addressof(self.memory._memory)
        self._base = _memory_data(self._ctx_addr, self._mem_addr)
        self._size = 0  # grows only; re-read when exceeded
        self._view = memoryview(b"")  # the guest's memory up to _size (it never moves: valid until it grows)
        self._grown(0, 0)
        names = [*REQUIRED_EXPORTS, "tiller_io"] if module.has_io else list(REQUIRED_EXPORTS)
        self._func_structs = [ex[name]._func for name in names]  # keep alive
        # the arguments of every call as ctypes objects, which ctypes passes as they are (ints it converts)
        self._ctx_arg = c_void_p(self._ctx_addr)
        self._funcs = {name: c_void_p(ctypes.addressof(f)) for name, f in zip(names, self._func_structs)}
        self._io: memoryview | None = None  # the guest's I/O area (header + cap bytes), once set up
        self._io_flags: ctypes.c_uint32 | None = None  # its flags word
        self._io_offset = self._io_cap = 0
        self._panic = byref(ex["aici_panic"]._func) if module.has_panic else None
        self._args = (ffi.wasmtime_val_raw * 1)()
        self._args_arg = c_void_p(ctypes.addressof(self._args))
        self._arg = self._args[0]  # a view of the one argument (and result) slot
        self._trap = ctypes.POINTER(ffi.wasm_trap_t)()
        self._trap_arg = c_void_p(ctypes.addressof(self._trap))
        self.blob_process_arg = self.blob_tokenize = self.blob_storage = b""

    # -- guest memory ----------------------------------------------------------------------------------
    def _grown(self, ptr: int, end: int) -> None:
        """Re-read the memory's size after an access to [ptr, end) went beyond what was known."""
        self._size = _memory_size(self._ctx_addr, self._mem_addr)
        self._view = memoryview((ctypes.c_char * self._size).from_address(self._base)).cast("B")
        if end > self._size:
            raise HostError(f"guest pointer {ptr}+{end - ptr} is outside its memory ({self._size} bytes)")

    def guest_address(self, ptr: int, length: int) -> int:
        """The host address of the guest's bytes [ptr, ptr + length), bounds-checked. ``ptr``, and ``length``
        when negative, are the guest's i32s read as unsigned, as Wasm does; a length the host computed (a count
        of u32s times 4) is taken whole: masked, 2**30 tokens would be 0 bytes."""
        ptr &= 0xFFFFFFFF
        end = ptr + (length if length >= 0 else length & 0xFFFFFFFF)
        if end > self._size:
            self._grown(ptr, end)
        return self._base + ptr

    def view(self, ptr: int, length: int) -> memoryview:
        """The guest's bytes [ptr, ptr + length), bounds-checked as :meth:`guest_address`; valid until the next
        guest call."""
        ptr &= 0xFFFFFFFF
        end = ptr + (length if length >= 0 else length & 0xFFFFFFFF)
        if end > self._size:
            self._grown(ptr, end)
        return self._view[ptr:end]

    def read(self, ptr: int, length: int) -> bytes:
        return self.view(ptr, length).tobytes()

    def write(self, ptr: int, data: bytes) -> None:
        memmove(self.guest_address(ptr, len(data)), data, len(data))

    # -- calls -----------------------------------------------------------------------------------------
    def _call(self, export: str, deadline_ms: float, with_handle: bool) -> int:
        """Run an export under the deadline; returns its i32 result (0 if none); raises ControllerError."""
        ticker = self._ticker
        running, thread = ticker.running, get_ident()
        running[thread] = self  # Ticker.enter, inlined
        if not ticker.awake:
            ticker.wake()
        ctx = self._ctx_arg
        _set_epoch_deadline(ctx, self._deadline_ticks.get(deadline_ms) or self.engine.ticks(deadline_ms))
        self._arg.i32 = self.handle if with_handle else 0
        try:
            error = _call_unchecked(ctx, self._funcs[export], self._args_arg, _ONE, self._trap_arg)
        finally:
            running[thread] = None
        if error:  # a host function failed (its trap comes back as an error)
            err = wasmtime.WasmtimeError._from_ptr(ctypes.cast(error, ctypes.POINTER(ffi.wasmtime_error_t)))
            raise ControllerError(self._failure(export, str(err), None, deadline_ms))
        if self._trap:
            t = wasmtime.Trap._from_ptr(ctypes.POINTER(ffi.wasm_trap_t)(self._trap.contents))
            self._trap = ctypes.POINTER(ffi.wasm_trap_t)()
            self._trap_arg = c_void_p(ctypes.addressof(self._trap))
            raise ControllerError(self._failure(export, t.message, t.trap_code, deadline_ms))
        return self._arg.i32

    def _failure(self, export: str, text: str, code: wasmtime.TrapCode | None, deadline_ms: float) -> str:
        if self.host.error:
            return f"{export}: {self.host.error}"
        if code == wasmtime.TrapCode.INTERRUPT:
            return f"{export}: deadline of {deadline_ms:g} ms exceeded"
        message = _cause(text) or str(code)
        size = _memory_size(self._ctx_addr, self._mem_addr)  # a failed memory.grow shows up as a trap later
        return f"{export}: trap: {message} (memory {size} of {self.engine.settings.max_memory_bytes} bytes)"

    def invoke(self, export: str, arg: bytes, deadline_ms: float, mask_address: int | None = None) -> bytes:
        """Set the process arg, call ``export``, return the JSON bytes the guest returned."""
        if self.dead:
            raise ControllerError(f"controller already failed: {self.dead}")
        host = self.host
        host.begin_call(mask_address)
        self.blob_process_arg = arg
        io = self._io
        if io is not None:  # arg_len + arg (or NONE: read the blob), result_len = NONE: "write your result here"
            n = len(arg)
            if n <= self._io_cap:
                _io_words.pack_into(io, 8, n, IO_NONE)
                io[IO_HEADER:IO_HEADER + n] = arg
            else:
                io[8:16] = _io_none
        try:
            self._call(export, deadline_ms, True)
            result = host.result
            if result is None and io is not None:
                result = host.result = self._io_result(export)
            if result is None:
                raise ControllerError(f"{export}: aici_host_return_process_result not called")
        except ControllerError as exc:
            self.dead = str(exc)
            self._call_panic()
            raise
        return result

    def _io_result(self, export: str) -> bytes | None:
        """The result the guest wrote in its I/O area, if it did."""
        n = self._io_result_len.value
        if n == IO_NONE:
            return None
        if n > self._io_cap:
            raise ControllerError(f"{export}: result_len {n} is beyond the I/O area's capacity {self._io_cap}")
        return self._io[IO_HEADER:IO_HEADER + n].tobytes()

    @property
    def pre_default(self) -> bool:
        """The guest says its pre_process always continues with no effects (the host may skip calling it);
        never once it failed."""
        return self._io_flags is not None and bool(self._io_flags.value & IO_PRE_DEFAULT) and not self.dead

    @property
    def mid_constraint(self) -> tuple[int, int]:
        """The handle of the constraint whose mask the guest says its mid_process would return (sampling
        when the constraint is OK, no other effect), and how many of the constraint's forced tokens it would
        splice instead when they are at least FF_MIN (0: it never splices); handle 0: none, call mid_process."""
        flags = self._io_flags.value if self._io_flags is not None else 0
        if not flags & IO_MID_CONSTRAINT or self.dead:
            return 0, 0
        ff_limit = ((flags & IO_POST_TOKENS) >> IO_POST_SHIFT) + 1 if flags & IO_MID_FF else 0
        return (flags >> 8) & IO_HANDLE, ff_limit

    def post_constraint(self, n: int) -> int:
        """The handle of the constraint the guest says its post_process of ``n`` tokens (backtrack 0, no EOS)
        would only commit them to, continuing when the commit is OK; 0: none, call post_process."""
        flags = self._io_flags.value if self._io_flags is not None else 0
        return (flags >> 8) & IO_HANDLE if (flags & IO_POST_TOKENS) >> IO_POST_SHIFT >= n and not self.dead else 0

    def posts_answered(self, n: int) -> None:
        """The host answered a post_process of ``n`` tokens as declared: that many fewer it may answer."""
        self._io_flags.value -= n << IO_POST_SHIFT

    def _call_panic(self) -> None:
        if self._panic is None:
            return
        trap = ctypes.POINTER(ffi.wasm_trap_t)()
        _set_epoch_deadline(self._ctx_addr, self.engine.ticks(self.engine.settings.pre_deadline_ms))
        self.engine.ticker.enter(self)
        try:
            ffi.wasmtime_func_call_unchecked(self._ctx, self._panic, self._args, 1, byref(trap))
        finally:
            self.engine.ticker.leave()

    def setup(self, deadline_ms: float) -> None:
        """aici_init + aici_create (the controller's constructor runs here)."""
        self.host.begin_call(None)
        try:
            self._call("aici_init", deadline_ms, with_handle=False)
            self.handle = self._call("aici_create", deadline_ms, with_handle=False)
            if self.module.has_io:
                self._set_io(self._call("tiller_io", deadline_ms, with_handle=False) & 0xFFFFFFFF)
        except ControllerError as exc:
            self.dead = str(exc)
            raise

    def _set_io(self, offset: int, cap: int | None = None) -> None:
        """Check the I/O area at guest ``offset``: its header and ``cap`` bytes (read from the header unless
        given) must lie in the memory, which never moves, so a view over it stays valid."""
        try:
            if cap is None:
                cap = ctypes.c_uint32.from_address(self.guest_address(offset, IO_HEADER)).value
            address = self.guest_address(offset, IO_HEADER + cap)
        except HostError as exc:
            raise ControllerError(f"tiller_io: the I/O area is not in the guest's memory: {exc}") from exc
        self._io = memoryview((ctypes.c_char * (IO_HEADER + cap)).from_address(address)).cast("B")
        self._io_flags = ctypes.c_uint32.from_address(address + 4)
        self._io_result_len = ctypes.c_uint32.from_address(address + 12)
        self._io_offset, self._io_cap = offset, cap

    def fork(self, seq_id: int) -> WasmController:
        """A new instance whose memory and mutable globals are copies of this one's (between calls)."""
        if self.dead:
            raise ControllerError(f"cannot fork a failed controller: {self.dead}")
        child = WasmController(self.engine, self.module, self.host.fork(seq_id))
        child.handle = self.handle
        src_size = _memory_size(self._ctx_addr, self._mem_addr)
        dst_size = _memory_size(child._ctx_addr, child._mem_addr)
        if src_size > dst_size:
            try:
                child.memory.grow(child.store, (src_size - dst_size) // 65536)
            except wasmtime.WasmtimeError as exc:
                child.close()
                raise ControllerError(f"fork: {exc}") from exc
        ctypes.memmove(_memory_data(child._ctx_addr, child._mem_addr), _memory_data(self._ctx_addr, self._mem_addr),
                       src_size)
        for name in self.module.mutable_globals:
            child.exports[name].set_value(child.store, self.exports[name].value(self.store))
        if self._io is not None:
            child._set_io(self._io_offset, self._io_cap)
        return child

    def close(self) -> None:
        self.store.close()


# -- imports ------------------------------------------------------------------------------------------

def _define_imports(engine: WasmEngine) -> None:
    tok = engine.tokenizer
    settings = engine.settings

    running = engine.ticker.running

    def define(module: str, name: str, params: list, results: list, fn: Callable) -> None:
        ty = wasmtime.FuncType(params, results)
        has_result = bool(results)

        def callback(_env, _caller, vals, _n):
            inst = running.get(get_ident())
            try:
                if inst is None:
                    raise HostError("host function called outside a controller call")
                r = fn(inst, vals)
                if has_result:
                    vals[0] = r
                return 0
            except BaseException as exc:  # noqa: BLE001 - becomes a trap of this sequence only
                message = str(exc) if isinstance(exc, HostError) else f"{name}: {type(exc).__name__}: {exc}"
                if inst is not None and not inst.host.error:
                    inst.host.error = f"{name}: {message}" if isinstance(exc, HostError) else message
                raw = message.encode()
                return ctypes.cast(ffi.wasmtime_trap_new(raw, len(raw)), c_void_p).value

        cb = _callback_t(callback)
        engine._callbacks.append((cb, ty))
        m, n = module.encode(), name.encode()
        address = lambda obj: ctypes.cast(obj, c_void_p).value  # noqa: E731
        error = _define_unchecked(address(engine.linker.ptr()), m, len(m), n, len(n), address(ty.ptr()), address(cb),
                                  None, address(_no_finalizer))
        if error:
            raise wasmtime.WasmtimeError._from_ptr(ctypes.cast(error, ctypes.POINTER(ffi.wasmtime_error_t)))

    def read_blob(inst: WasmController, v) -> int:
        blob_id, dst, size = v[0], v[4], v[8] & 0xFFFFFFFF
        if blob_id == BLOB_TRIE:
            data = tok.trie_blob
        elif blob_id == BLOB_MODULE_ARG:
            data = inst.host.request.module_arg
        elif blob_id == BLOB_PROCESS_ARG:
            data = inst.blob_process_arg
        elif blob_id == BLOB_TOKENIZE:
            data = inst.blob_tokenize
        elif blob_id == BLOB_STORAGE:
            data = inst.blob_storage
        else:
            raise HostError(f"unknown blob id {blob_id}")
        n = min(size, len(data))
        if n:
            memmove(inst.guest_address(dst, n), data, n)
        return len(data)

    max_tokenize = settings.max_tokenize_bytes

    def tokenize(inst: WasmController, v) -> int:
        if (size := v[4] & 0xFFFFFFFF) > max_tokenize:
            raise HostError(f"{size} bytes to tokenize in one call, past the {max_tokenize} allowed "
                            "(controllers.max_tokenize_bytes)")
        tokens = tok.tokenize(inst.read(v[0], v[4]))
        inst.blob_tokenize = struct.pack(f"<{len(tokens)}I", *tokens)
        return BLOB_TOKENIZE

    def storage_cmd(inst: WasmController, v) -> int:
        inst.blob_storage = inst.host.storage_cmd_json(inst.read(v[0], v[4]))
        return BLOB_STORAGE

    mask_bytes = tok.mask_words * 4

    # the two host calls of nearly every step, with guest_address / read and SeqHost's setters inlined (a
    # Python call less or two: ~0.2 µs of a step's 15)
    def return_logit_bias(inst: WasmController, v) -> None:
        ptr = v[0] & 0xFFFFFFFF
        if ptr + mask_bytes > inst._size:
            inst._grown(ptr, ptr + mask_bytes)
        memmove(inst.host.mask_target(), inst._base + ptr, mask_bytes)

    def return_result(inst: WasmController, v) -> None:
        ptr = v[0] & 0xFFFFFFFF
        end = ptr + (v[4] & 0xFFFFFFFF)
        if end > inst._size:
            inst._grown(ptr, end)
        inst.host.result = inst._view[ptr:end].tobytes()

    def get_config(inst: WasmController, v) -> int:
        return int(inst.host.get_config(inst.read(v[0], v[4]).decode("utf-8", "replace")))

    def stop(inst: WasmController, v) -> None:
        raise HostError("*** aici_host_stop()")

    def constraint_new(inst: WasmController, v) -> int:
        source = inst.read(v[4], v[8]).decode("utf-8", "replace")
        return inst.host.constraint_new(v[0], source)

    def constraint_commit(inst: WasmController, v) -> int:
        tokens = inst.view(v[4], 4 * (v[8] & 0xFFFFFFFF)).cast("I").tolist()
        return inst.host.constraint(v[0]).commit(tokens)

    def constraint_return_bias(inst: WasmController, v) -> int:
        return inst.host.constraint_return_bias(v[0])

    def constraint_mask(inst: WasmController, v) -> int:
        nbytes = tok.mask_words * 4
        return inst.host.constraint(v[0]).fill_mask(inst.guest_address(v[4], nbytes), nbytes)

    def constraint_ff_tokens(inst: WasmController, v) -> int:
        tokens = inst.host.constraint(v[0]).ff_tokens(v[8] & 0xFFFFFFFF)
        if tokens:
            data = struct.pack(f"<{len(tokens)}I", *tokens)
            memmove(inst.guest_address(v[4], len(data)), data, len(data))
        return len(tokens)

    def constraint_rollback(inst: WasmController, v) -> int:
        return inst.host.constraint(v[0]).rollback(v[4] & 0xFFFFFFFF)

    def constraint_free(inst: WasmController, v) -> None:
        inst.host.constraint_free(v[0])

    def steer(inst: WasmController, v) -> int:
        return inst.host.steer(inst.read(v[0], v[4]))

    def copy_out(inst: WasmController, v, data: bytes) -> int:
        """Write at most ``cap`` (v[4]) bytes of ``data`` at ``dst`` (v[0]); returns its whole length."""
        n = min(v[4] & 0xFFFFFFFF, len(data))
        if n:
            memmove(inst.guest_address(v[0], n), data, n)
        return len(data)

    def readout(inst: WasmController, v) -> int:
        return copy_out(inst, v, inst.host.readout())

    def readout_info(inst: WasmController, v) -> int:
        info = inst.host.readout_info()
        if info is None:
            inst.host.log(b"readout error: the readout is known from the sequence's first pre_process on\n")
            return -1
        return copy_out(inst, v, json.dumps(info, separators=(",", ":")).encode())

    env = [
        ("aici_host_read_blob", 3, 1, read_blob),
        ("aici_host_module_arg", 0, 1, lambda i, v: BLOB_MODULE_ARG),
        ("aici_host_process_arg", 0, 1, lambda i, v: BLOB_PROCESS_ARG),
        ("aici_host_token_trie", 0, 1, lambda i, v: BLOB_TRIE),
        ("aici_host_tokenize", 2, 1, tokenize),
        ("aici_host_storage_cmd", 2, 1, storage_cmd),
        ("aici_host_return_logit_bias", 1, 0, return_logit_bias),
        ("aici_host_return_process_result", 2, 0, return_result),
        ("aici_host_self_seq_id", 0, 1, lambda i, v: i.host.seq_id),
        ("aici_host_eos_token", 0, 1, lambda i, v: tok.eos_token),
        ("aici_host_vocab_size", 0, 1, lambda i, v: tok.vocab_size),
        ("aici_host_get_config", 2, 1, get_config),
        ("aici_host_stop", 0, 0, stop),
        ("tiller_constraint_new", 3, 1, constraint_new),
        ("tiller_constraint_commit", 3, 1, constraint_commit),
        ("tiller_constraint_return_bias", 1, 1, constraint_return_bias),
        ("tiller_constraint_mask", 2, 1, constraint_mask),
        ("tiller_constraint_ff_tokens", 3, 1, constraint_ff_tokens),
        ("tiller_constraint_rollback", 2, 1, constraint_rollback),
        ("tiller_constraint_free", 1, 0, constraint_free),
        ("tiller_steer", 2, 1, steer),
        ("tiller_readout", 2, 1, readout),
        ("tiller_readout_info", 2, 1, readout_info),
    ]
    for name, nparams, nresults, fn in env:
        define("env", name, [I32] * nparams, [I32] * nresults, fn)
    _define_wasi(define, settings)


def _define_wasi(define: Callable, settings: Controllers) -> None:
    """WASI as AICI gives it (ABI.md): fd_write(1|2) captured into logs; clock only monotonic and always 0; the rest stubbed."""

    def fd_write(inst: WasmController, v) -> int:
        fd, iovs, n, nwritten = v[0], v[4], v[8] & 0xFFFFFFFF, v[12]
        if fd not in (1, 2):
            return WASI_BADF
        total = 0
        for i in range(min(n, 1024)):
            ptr, length = struct.unpack("<II", inst.read(iovs + 8 * i, 8))
            inst.host.log(inst.read(ptr, length))
            total += length
        inst.write(nwritten, struct.pack("<I", total))
        return 0

    def fdstat_get(inst: WasmController, v) -> int:
        if v[0] not in (0, 1, 2):
            return WASI_BADF
        inst.write(v[4], struct.pack("<BxHxxxxQQ", 2, 0, 0, 0))  # character device
        return 0

    def clock_time_get(inst: WasmController, v) -> int:
        if v[0] != 1:
            return WASI_PERM
        inst.write(v[8], struct.pack("<Q", 0))
        return 0

    def zero_pair(inst: WasmController, v) -> int:
        inst.write(v[0], b"\0\0\0\0")
        inst.write(v[4], b"\0\0\0\0")
        return 0

    def proc_exit(inst: WasmController, v) -> None:
        raise HostError(f"proc_exit({v[0]})")

    wasi = "wasi_snapshot_preview1"
    ok = lambda i, v: 0  # noqa: E731
    badf = lambda i, v: WASI_BADF  # noqa: E731
    funcs = [
        ("fd_write", [I32] * 4, fd_write), ("fd_fdstat_get", [I32] * 2, fdstat_get),
        ("clock_time_get", [I32, I64, I32], clock_time_get), ("random_get", [I32] * 2, ok),
        ("args_sizes_get", [I32] * 2, zero_pair), ("environ_sizes_get", [I32] * 2, zero_pair),
        ("args_get", [I32] * 2, ok), ("environ_get", [I32] * 2, ok), ("sched_yield", [], ok),
        ("fd_sync", [I32], ok), ("fd_close", [I32], badf), ("fd_seek", [I32, I64, I32, I32], badf),
        ("fd_read", [I32] * 4, badf), ("fd_readdir", [I32, I32, I32, I64, I32], badf),
        ("fd_filestat_get", [I32] * 2, badf), ("fd_filestat_set_size", [I32, I64], badf),
        ("fd_prestat_get", [I32] * 2, badf), ("fd_prestat_dir_name", [I32] * 3, badf),
        ("fd_fdstat_set_flags", [I32] * 2, badf), ("poll_oneoff", [I32] * 4, badf),
        ("path_open", [I32, I32, I32, I32, I32, I64, I64, I32, I32], badf),
        ("path_filestat_get", [I32] * 5, badf), ("path_create_directory", [I32] * 3, badf),
        ("path_unlink_file", [I32] * 3, badf), ("path_remove_directory", [I32] * 3, badf),
        ("path_rename", [I32] * 6, badf), ("path_readlink", [I32] * 6, badf),
    ]
    for name, params, fn in funcs:
        define(wasi, name, params, [I32], fn)
    define(wasi, "proc_exit", [I32], [], proc_exit)
