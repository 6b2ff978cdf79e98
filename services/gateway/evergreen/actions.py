"""Action signatures, and GENERATE: from a flattened input to a streamed output node.

Actions (each input and output is a (name, node id) pair; names are checked, ids are free):

==========  =================================  ====================================  =====================
action      inputs (exactly one)               outputs                               config (Struct)
==========  =================================  ====================================  =====================
GENERATE    ``prompt`` or ``text``             ``response`` or ``text``              sampling parameters
TRY_GEN...  as GENERATE                        as GENERATE; ``error``                sampling parameters
DROP        ``node``                           none                                  none
SET_TTL     ``node``                           none                                  ``ttl_s`` (required)
CANCEL      ``output`` (a GENERATE's output)   none                                  none
==========  =================================  ====================================  =====================

TRY_GENERATE is GENERATE with per-action failure reporting: a failure of that action ends its
output node and writes ``{"status", "message"}`` (``application/json``) into its ``error`` output
node, when it names one (as the spec allows any output to be left out), instead of aborting the
session. Plain GENERATE keeps the spec's rule: any failure aborts, and an ``error`` output is an
unknown output name.
"""

from __future__ import annotations

import asyncio
import enum
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog

from common.protos.evergreen.v2 import evergreen_pb2 as eg
from services.gateway.deps import Gateway, new_request_id
from services.gateway.driver import Generation
from services.gateway.evergreen.config import GenerateParams
from services.gateway.evergreen.errors import SessionAbort
from services.gateway.evergreen.graph import Leaf
from services.gateway.evergreen.refs import read_ref
from services.gateway.evergreen.turns import to_turns
from services.gateway.protocol import CompletionMsg, ErrorMsg, GatewayError, TokenMsg
from services.gateway.tenants import Tenant
from services.gateway.validation import GenerationRequest

log = structlog.get_logger()

ERROR_OUTPUT = "error"
OUTPUT_MIMETYPE = "text/plain"
OUTPUT_ROLE = "assistant"
ERROR_MIMETYPE = "application/json"

Emit = Callable[[eg.NodeFragment], None]


@dataclass(frozen=True)
class Signature:
    inputs: tuple[str, ...]  # exactly one of these
    outputs: tuple[str, ...] = ()  # at most one of these
    error_output: bool = False


SIGNATURES: dict[str, Signature] = {
    "GENERATE": Signature(inputs=("prompt", "text"), outputs=("response", "text")),
    "TRY_GENERATE": Signature(inputs=("prompt", "text"), outputs=("response", "text"), error_output=True),
    "DROP": Signature(inputs=("node",)),
    "SET_TTL": Signature(inputs=("node",)),
    "CANCEL": Signature(inputs=("output",)),
}


@dataclass(frozen=True)
class Bound:
    """An action whose parameter names passed its signature."""

    action: eg.Action
    input_id: str
    output_id: str | None
    error_id: str | None

    @property
    def label(self) -> str:
        return f"{self.action.name}({self.input_id!r} → {self.output_id!r})"


def _unique(params: list[eg.NamedParameter], what: str, action: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for p in params:
        if p.name in out:
            raise SessionAbort.invalid(f"{action}: {what} {p.name!r} is given twice")
        out[p.name] = p.id
    return out


def bind(action: eg.Action) -> Bound:
    """Check an action's name and parameter names; any mismatch aborts the session."""
    sig = SIGNATURES.get(action.name)
    if sig is None:
        raise SessionAbort.invalid(f"unknown action {action.name!r}; this server provides {', '.join(SIGNATURES)}")
    name = action.name
    inputs = _unique(list(action.inputs), "input", name)
    outputs = _unique(list(action.outputs), "output", name)
    allowed_out = sig.outputs + ((ERROR_OUTPUT,) if sig.error_output else ())
    for given, allowed, what in ((inputs, sig.inputs, "input"), (outputs, allowed_out, "output")):
        for param in given:
            if param not in allowed:
                takes = " or ".join(repr(a) for a in allowed) or "none"
                raise SessionAbort.invalid(f"{name}: unknown {what} {param!r} (takes {takes})")
    if len(inputs) != 1:
        raise SessionAbort.invalid(f"{name}: give exactly one input, {' or '.join(map(repr, sig.inputs))}")
    results = [outputs[o] for o in sig.outputs if o in outputs]
    if len(results) > 1:
        raise SessionAbort.invalid(f"{name}: give at most one of the outputs {' or '.join(map(repr, sig.outputs))}")
    [input_id] = inputs.values()
    if not input_id:
        raise SessionAbort.invalid(f"{name}: input {next(iter(inputs))!r} names no node")
    return Bound(action, input_id, results[0] if results else None, outputs.get(ERROR_OUTPUT))


class OutputWriter:
    """Streams one leaf output node: seq 0 carries the metadata, every fragment but the last is ``continued``."""

    def __init__(self, node_id: str, emit: Emit, mimetype: str, role: str = "") -> None:
        self.node_id = node_id
        self.finished = False
        self._emit = emit
        self._metadata = eg.ChunkMetadata(mimetype=mimetype, role=role)
        self._seq = 0

    def write(self, data: bytes, *, final: bool) -> None:
        if self.finished:
            return
        chunk = eg.Chunk(data=data)
        if self._seq == 0:
            chunk.metadata.CopyFrom(self._metadata)
        self._emit(eg.NodeFragment(id=self.node_id, seq=self._seq, continued=not final, chunk_fragment=chunk))
        self._seq += 1
        self.finished = final


class Phase(enum.Enum):
    PENDING = "pending"  # waiting for its input
    RUNNING = "running"
    DONE = "done"


class GenerateRun:
    """One GENERATE action: waits for its input, then streams the model's answer into its output node."""

    def __init__(self, gw: Gateway, bound: Bound, params: GenerateParams, emit: Emit, *, client: str,
                 tenant: Tenant) -> None:
        self.bound = bound
        self.phase = Phase.PENDING
        self.waiting_for: frozenset[str] = frozenset()  # the input's nodes missing at the last look
        self.task: asyncio.Task[None] | None = None
        self._gw = gw
        self._params = params
        self._emit = emit
        self._client = client
        self._tenant = tenant
        self._gen: Generation | None = None
        self._output = (
            OutputWriter(bound.output_id, emit, OUTPUT_MIMETYPE, OUTPUT_ROLE) if bound.output_id is not None else None
        )
        self._sent = 0  # characters of generated text written so far

    async def run(self, leaves: list[Leaf]) -> None:
        """Generate; a failure aborts the session, or is reported when the action has an ``error`` output.

        The phase stays RUNNING when this returns: the session marks the run DONE once it has seen
        the task's outcome, so that a failure is never overtaken by the session's normal end."""
        try:
            await self._generate(leaves)
        except SessionAbort as exc:
            self.fail(exc)
        except asyncio.CancelledError:
            self._finish_output()
            raise

    def fail(self, exc: SessionAbort) -> None:
        """End this action with ``exc``: a TRY_GENERATE's output ends (and its ``error`` node, if it
        names one, says why); a GENERATE's failure is re-raised, to abort the session."""
        if not SIGNATURES[self.bound.action.name].error_output:
            raise exc
        log.info("evergreen.action_failed", action=self.bound.label, status=exc.status.name, error=exc.message)
        self._finish_output()
        if self.bound.error_id is not None:
            body = json.dumps({"status": exc.status.name, "message": exc.message}).encode()
            OutputWriter(self.bound.error_id, self._emit, ERROR_MIMETYPE).write(body, final=True)

    def _finish_output(self) -> None:
        if self._output is not None:
            self._output.write(b"", final=True)

    async def cancel(self) -> None:
        """Stop it: the output node ends with what was generated so far."""
        if self.phase is Phase.PENDING:
            self.phase = Phase.DONE
            self._finish_output()
        elif self._gen is not None:
            try:
                await self._gen.stop()
            except GatewayError:  # it had just finished
                pass
        elif self.task is not None:
            self.task.cancel()

    async def _generate(self, leaves: list[Leaf]) -> None:
        chunks = [(leaf.node_id, leaf.metadata, await self._payload(leaf)) for leaf in leaves]
        request = GenerationRequest(messages=to_turns(chunks), **self._params.request_fields())
        self._gen = Generation(self._gw, request, rid=new_request_id("eg_"), surface="evergreen", client=self._client,
                               tenant=self._tenant)
        async for msg in self._gen.stream():
            if isinstance(msg, TokenMsg) and msg.finish_reason is None and msg.token:
                self._write(msg.token, final=False)
            elif isinstance(msg, CompletionMsg):
                self._write(msg.generated_text[self._sent :], final=True)
            elif isinstance(msg, ErrorMsg):
                raise SessionAbort.from_code(msg.code, f"{self.bound.label}: {msg.message}")

    def _write(self, text: str, *, final: bool) -> None:
        self._sent += len(text)
        if self._output is not None:
            self._output.write(text.encode(), final=final)

    async def _payload(self, leaf: Leaf) -> bytes:
        limits = self._gw.settings.evergreen
        root: Path = self._gw.settings.evergreen_ref_root
        parts = []
        for part in leaf.parts:
            if isinstance(part, str):
                part = await asyncio.to_thread(read_ref, part, root, limits.max_session_bytes)
            parts.append(part)
        return b"".join(parts)


def target_check(action: eg.Action, served: str) -> None:
    """An unknown target is NOT_FOUND (the spec's TargetSpec rule)."""
    target = action.target_spec.id
    if target and target != served:
        raise SessionAbort(grpc.StatusCode.NOT_FOUND, f"{action.name}: target {target!r} not found; this server serves {served!r}")
