"""Host facilities of one controlled sequence, shared by Wasm and native controllers: variable
storage (per request, shared by forks), tokenizer access, constraints, steering and readouts, the logit-bias
row of the current mid_process, captured logs, and the per-call result."""

from __future__ import annotations

import contextlib
import ctypes
import json
from collections.abc import Iterator
from dataclasses import dataclass, field

from services.controller_runtime.constraints import Constraint, ConstraintError
from services.controller_runtime.steering import Effects, SteeringRefused, SteerScope
from services.controller_runtime.tokenizer import TokenizerInfo

# ctypes.memmove without releasing the GIL: the copies are a few KB, and a release hands the GIL to the
# epoch ticker's thread, which costs more than the copy
memmove = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(ctypes._memmove_addr)


class HostError(Exception):
    """A controller misused the host (bad pointer, bad JSON, wrong phase); ends that sequence."""


@dataclass
class VariableStore:
    """Versioned variables of one request (ABI.md §4): first write is version 1, each write +1. They hold at most
    ``max_bytes`` (names and values): a write past it is the controller's error."""

    max_bytes: int = 16 << 20
    vars: dict[str, tuple[int, bytes]] = field(default_factory=dict)
    size: int = 0  # bytes held: every variable's name and value

    def execute(self, cmd: dict) -> tuple[dict, dict | None]:
        """Run a StorageCmd; returns (StorageResp, the command to log if it wrote)."""
        if not isinstance(cmd, dict) or len(cmd) != 1:
            raise HostError(f"storage command must be {{\"ReadVar\"|\"WriteVar\": ...}}, got {cmd!r:.200}")
        (kind, body), = cmd.items()
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            raise HostError(f"storage command {kind} needs a string name")
        name = body["name"]
        current = self.vars.get(name)
        if kind == "ReadVar":
            return (_read_resp(current), None)
        if kind != "WriteVar":
            raise HostError(f"unknown storage command {kind!r}")
        try:
            value = bytes.fromhex(body.get("value", ""))
        except (TypeError, ValueError) as exc:
            raise HostError(f"WriteVar value must be hex: {exc}") from exc
        op = body.get("op", "Set")
        if op not in ("Set", "Append"):
            raise HostError(f"WriteVar op must be Set or Append, got {op!r}")
        when = body.get("when_version_is")
        if when is not None:
            if current is None:
                return ({"VariableMissing": {}}, None)
            if current[0] != when:
                return (_read_resp(current), None)
        version = (current[0] if current else 0) + 1
        new_value = (current[1] if current and op == "Append" else b"") + value
        size = self.size + len(new_value) - (len(current[1]) if current else -len(name))
        if size > self.max_bytes:
            raise HostError(f"WriteVar {name!r}: the request's variables would hold {size} bytes, past the "
                            f"{self.max_bytes} allowed (controllers.max_storage_bytes)")
        self.vars[name], self.size = (version, new_value), size
        logged = {"WriteVar": {"name": name, "value": value.hex(), "op": op, "when_version_is": when}}
        return ({"WriteVar": {"version": version}}, logged)


def _read_resp(current: tuple[int, bytes] | None) -> dict:
    if current is None:
        return {"VariableMissing": {}}
    return {"ReadVar": {"version": current[0], "value": current[1].hex()}}


@dataclass
class RequestState:
    """What all forks of one request share."""

    req_id: str
    module_arg: bytes
    storage: VariableStore = field(default_factory=VariableStore)
    live_seqs: int = 0
    user: str = "local"  # who instantiated it: its controller time is charged to them
    steering: SteerScope | None = None  # what its controllers may steer with and read out (None: not bound yet)
    effects: Effects = field(default_factory=Effects)  # the runtime's: what the call under way reports


class SeqHost:
    """Host state of one sequence; a fork gets a copy (constraints deep-copied, storage shared)."""

    def __init__(self, tokenizer: TokenizerInfo, request: RequestState, capabilities: dict[str, bool],
                 max_log_bytes: int, max_constraints: int = 64) -> None:
        self.tokenizer = tokenizer
        self.request = request
        self.capabilities = capabilities
        self.max_log_bytes = max_log_bytes
        self.max_constraints = max_constraints
        self.seq_id = 0
        self.constraints: dict[int, Constraint] = {}
        self._next_handle = 1
        self.logs = bytearray()
        self.storage_log: list[dict] = []
        self.readouts_wanted = False  # the controller asked for readouts (tiller_readout)
        self.last_readout = b""  # the last fed position's readout (b"": none yet)
        self.begin_call(None)

    # -- per call -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def keeping_effects(self) -> Iterator[None]:
        """What the calls so far logged and stored stays, ahead of what the call in the block adds (which
        begins afresh)."""
        logs, storage = bytes(self.logs), list(self.storage_log)
        try:
            yield
        finally:
            self.logs[:0] = logs
            self.storage_log[:0] = storage

    def begin_call(self, mask_address: int | None) -> None:
        if self.logs:  # fresh ones only when used: the last call's may have been handed on
            self.logs = bytearray()
        if self.storage_log:
            self.storage_log = []
        self.result: bytes | None = None
        self.mask_address = mask_address
        self.mask_set = False
        self.error = ""

    def log(self, data: bytes) -> None:
        """Append captured output, keeping the newest ``max_log_bytes`` (AICI drops the oldest quarter)."""
        self.logs += data
        if len(self.logs) > self.max_log_bytes:
            drop = max(len(self.logs) - self.max_log_bytes, self.max_log_bytes // 4)
            del self.logs[:drop]

    def logs_text(self) -> str:
        return self.logs.decode("utf-8", "replace") if self.logs else ""

    # -- facilities ------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def eos_token(self) -> int:
        return self.tokenizer.eos_token

    def tokenize(self, data: bytes) -> list[int]:
        return self.tokenizer.tokenize(data)

    def get_config(self, name: str) -> bool:
        return bool(self.capabilities.get(name, False))

    def storage_cmd(self, cmd: dict) -> dict:
        resp, logged = self.request.storage.execute(cmd)
        if logged is not None:
            self.storage_log.append(logged)
        return resp

    def get_var(self, name: str) -> bytes | None:
        resp = self.storage_cmd({"ReadVar": {"name": name}})
        return bytes.fromhex(resp["ReadVar"]["value"]) if "ReadVar" in resp else None

    def set_var(self, name: str, value: bytes, *, append: bool = False) -> None:
        self.storage_cmd({"WriteVar": {"name": name, "value": value.hex(), "op": "Append" if append else "Set"}})

    def storage_cmd_json(self, data: bytes) -> bytes:
        try:
            cmd = json.loads(data)
        except ValueError as exc:
            raise HostError(f"storage command is not JSON: {exc}") from exc
        return json.dumps(self.storage_cmd(cmd)).encode()

    # -- steering and readouts (ABI.md "Steering and readouts") ---------------------------------------------
    def steer(self, terms: bytes | list) -> int:
        """Replace this sequence's steering from its next fed token on: 0, or -1 with the reason in the logs."""
        scope = self.request.steering
        if scope is None:
            self.log(b"steering error: steering is set from the sequence's first pre_process on\n")
            return -1
        try:
            self.request.effects.steering[self.seq_id] = scope.terms(terms)
        except SteeringRefused as exc:
            self.log(f"steering error: {exc}\n".encode())
            return -1
        return 0

    def readout(self) -> bytes:
        """The last fed position's readout (float32 [layers][concepts], little-endian; b"" none yet: always, from a
        worker that reads none out). The first call asks the scheduler for the readout of the last position of every
        step that feeds this sequence."""
        if not self.readouts_wanted:
            self.readouts_wanted = True
            if self.request.steering is not None:  # (bound: else the binding reports it)
                self.readouts_on()
        return self.last_readout

    def readouts_on(self) -> None:
        """Ask the scheduler for this sequence's readouts (unless the worker reads none out)."""
        if self.request.steering.concepts:
            self.request.effects.readouts_on.append(self.seq_id)

    def readout_info(self) -> dict[str, list] | None:
        """``{"concepts": [names], "layers": [0-based decoder layers]}``, the readout's order; None before the
        sequence's first pre_process."""
        scope = self.request.steering
        return None if scope is None else scope.info()

    # -- masks -----------------------------------------------------------------------------------------
    def mask_target(self) -> int:
        """Where this op's mask row is (the logit bias is set from now on); HostError outside mid_process."""
        if self.mask_address is None:
            raise HostError("a logit bias can only be returned during mid_process")
        self.mask_set = True
        return self.mask_address

    def return_logit_bias(self, bitset: bytes) -> None:
        if len(bitset) != self.tokenizer.mask_words * 4:
            raise HostError(f"logit bias must be {self.tokenizer.mask_words * 4} bytes, got {len(bitset)}")
        memmove(self.mask_target(), bitset, len(bitset))

    # -- constraints -----------------------------------------------------------------------------------
    def constraint_new(self, kind: int, source: str) -> int:
        """A new constraint's handle (> 0), or -1 with the reason in the logs."""
        if len(self.constraints) >= self.max_constraints:
            self.log(f"constraint error: more than {self.max_constraints} live constraints\n".encode())
            return -1
        try:
            constraint = Constraint.create(self.tokenizer, kind, source)
        except ConstraintError as exc:
            self.log(f"constraint error: {exc}\n".encode())
            return -1
        handle = self._next_handle
        self._next_handle += 1
        self.constraints[handle] = constraint
        return handle

    def constraint(self, handle: int) -> Constraint:
        try:
            return self.constraints[handle]
        except KeyError:
            raise HostError(f"unknown constraint handle {handle}") from None

    def constraint_return_bias(self, handle: int) -> int:
        return self.constraint(handle).fill_mask(self.mask_target(), self.tokenizer.mask_words * 4)

    def constraint_free(self, handle: int) -> None:
        self.constraints.pop(handle, None)

    def fork(self, seq_id: int) -> SeqHost:
        child = SeqHost(self.tokenizer, self.request, self.capabilities, self.max_log_bytes, self.max_constraints)
        child.seq_id = seq_id
        child.constraints = {h: c.fork() for h, c in self.constraints.items()}
        child._next_handle = self._next_handle
        child.readouts_wanted, child.last_readout = self.readouts_wanted, self.last_readout
        return child
