"""One StartSession stream: a reader task applies the client's messages to the node graph, actions
start as soon as their inputs are complete, and every produced fragment goes back on the stream.

The session ends with OK once the client has closed its side and no action is pending or running;
it aborts (a gRPC status, all nodes dropped) on the first protocol violation or action failure. An
aborted session stops its work at once, but its status waits up to ``evergreen.abort_grace_s`` for a
client still sending to close its side: grpc's asyncio client reports ``INTERNAL: Internal error
from Core`` instead of the server's status when one of its writes lands after that status
(grpc/grpc#36066), so a client that sends a batch with a bad message early in it would otherwise
sometimes never learn what was wrong.
The gateway holds the live graph; the session store mirrors it (fire-and-forget) until the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from functools import partial

import grpc
import structlog

from common import wire
from common.protos.evergreen.v2 import evergreen_pb2 as eg
from services.gateway.deps import Gateway
from services.gateway.evergreen.actions import Bound, GenerateRun, Phase, bind, target_check
from services.gateway.evergreen.config import GenerateParams, TtlParams, action_config
from services.gateway.evergreen.errors import SessionAbort
from services.gateway.evergreen.graph import NodeGraph
from services.gateway.evergreen.turns import check_media
from services.gateway.grpc_requests import Malformed
from services.gateway.tenants import Tenant

log = structlog.get_logger()

_END = object()  # the session ended normally


def new_session_id() -> str:
    return f"egs_{uuid.uuid4().hex}"


class Session:
    def __init__(self, gw: Gateway, *, client: str, tenant: Tenant) -> None:
        self.id = new_session_id()
        self._gw = gw
        self._client = client
        self._tenant = tenant  # the session is bound to its stream: no other call can name it
        limits = gw.settings.evergreen
        self.graph = NodeGraph(
            max_depth=limits.max_nesting_depth,
            max_nodes=limits.max_session_nodes,
            max_bytes=limits.max_session_bytes,
            ref_root=gw.settings.evergreen_ref_root,
        )
        self._out: asyncio.Queue[eg.SessionMessage | SessionAbort | object] = asyncio.Queue()
        self._runs: dict[str | int, GenerateRun] = {}  # by output node id (a number when it has none)
        self._background: set[asyncio.Task[None]] = set()
        self._ttls: dict[str, asyncio.TimerHandle] = {}
        self._client_done = False
        self._aborted = False  # the abort is queued: the client's further messages are read and dropped
        self._closed = False

    # -- the stream -----------------------------------------------------------------------

    async def run(self, requests: AsyncIterator[eg.SessionMessage | Malformed]) -> AsyncIterator[eg.SessionMessage]:
        """The server's side of the stream; raises :class:`SessionAbort` when the session aborts."""
        structlog.contextvars.bind_contextvars(session_id=self.id)
        log.info("evergreen.session_start", client=self._client)
        self._gw.store.holdings.evergreen.add(self.id)
        reader = asyncio.create_task(self._read(requests))
        outcome = "cancelled"
        try:
            while True:
                item = await self._out.get()
                if item is _END:
                    outcome = "ok"
                    return
                if isinstance(item, SessionAbort):
                    outcome = item.status.name
                    log.info("evergreen.session_abort", status=item.status.name, error=item.message)
                    self._stop()
                    with contextlib.suppress(TimeoutError):  # see the module docstring
                        async with asyncio.timeout(self._gw.settings.evergreen.abort_grace_s):
                            await asyncio.shield(reader)
                    raise item
                assert isinstance(item, eg.SessionMessage)
                yield item
        finally:
            self._stop()
            reader.cancel()
            self._gw.store.evergreen_close(self.id)
            self._gw.store.holdings.evergreen.discard(self.id)
            log.info("evergreen.session_end", outcome=outcome, nodes=len(self.graph.nodes))

    def _stop(self) -> None:
        """No more work or output: running actions are cancelled, TTL timers too."""
        self._closed = True
        for run in self._runs.values():
            if run.task is not None:
                run.task.cancel()
        for timer in self._ttls.values():
            timer.cancel()

    def _abort(self, exc: SessionAbort) -> None:
        if not self._aborted:  # the first reason is the one reported
            self._aborted = True
            self._out.put_nowait(exc)

    async def _read(self, requests: AsyncIterator[eg.SessionMessage | Malformed]) -> None:
        try:
            async for message in requests:
                if self._aborted:
                    continue  # read on only to see the client close its side
                try:
                    if isinstance(message, Malformed):
                        raise SessionAbort.invalid(message.message)
                    self._apply(message)
                except SessionAbort as exc:
                    self._abort(exc)
            self._client_done = True
            self._advance()
        except Exception as exc:  # a bug must end this session only, with a status the client can read
            log.exception("evergreen.session_failed")
            self._abort(SessionAbort(grpc.StatusCode.INTERNAL, f"the gateway failed this session: {exc}"))

    def _apply(self, message: eg.SessionMessage) -> None:
        """Fragments first, then actions; then start whatever became ready."""
        stored = [f for f in message.node_fragments if self.graph.add(f)]
        self._mirror(stored)
        for action in message.actions:
            self._on_action(action)
        self._advance()

    def _mirror(self, fragments: list[eg.NodeFragment]) -> None:
        if fragments and not self._closed:
            self._gw.store.evergreen_put(
                self.id, [wire.EvergreenFragment(node_id=f.id, seq=f.seq, fragment=f.SerializeToString()) for f in fragments]
            )

    def _emit(self, fragment: eg.NodeFragment) -> None:
        """A fragment the server produced: into the graph, the store and the stream."""
        if self._closed:
            return
        self.graph.add(fragment, from_server=True)
        self._mirror([fragment])
        self._out.put_nowait(eg.SessionMessage(node_fragments=[fragment]))
        if not fragment.continued:  # it may complete another action's input; looked at once this work is done,
            asyncio.get_running_loop().call_soon(self._advance)  # never inside it (a failing action's error node)

    # -- actions --------------------------------------------------------------------------

    def _on_action(self, action: eg.Action) -> None:
        bound = bind(action)
        for node_id in (bound.output_id, bound.error_id):
            if node_id is not None:
                self.graph.claim_output(node_id)
        log.info("evergreen.action", action=bound.label)
        if action.name in ("GENERATE", "TRY_GENERATE"):
            self._on_generate(bound)
        elif action.name == "DROP":
            self._drop(bound)
        elif action.name == "SET_TTL":
            self._set_ttl(bound)
        elif action.name == "CANCEL":
            self._cancel(bound)

    def _on_generate(self, bound: Bound) -> None:
        key: str | int = bound.output_id or len(self._runs)
        try:
            target_check(bound.action, self._gw.settings.served_model_name)
            params = action_config(bound.action, GenerateParams, self._gw.settings)
        except SessionAbort as exc:
            params, failure = GenerateParams(), exc
        else:
            failure = None
            if params.controller is not None or params.controller_arg is not None:
                failure = SessionAbort(
                    grpc.StatusCode.UNIMPLEMENTED,
                    "GENERATE: configs.controller / controller_arg: controllers are not supported on the "
                    "Evergreen surface yet",
                )
        run = GenerateRun(self._gw, bound, params, self._emit, client=self._client, tenant=self._tenant)
        self._runs[key] = run
        if failure is not None:
            self._fail(run, failure)

    def _fail(self, run: GenerateRun, exc: SessionAbort) -> None:
        """An action failed before or while starting: reported, or the session aborts."""
        run.phase = Phase.DONE
        try:
            run.fail(exc)
        except SessionAbort as abort:
            self._abort(abort)

    def _advance(self) -> None:
        """Start every pending GENERATE whose input is complete; fail those that can no longer start;
        end the session when nothing is left to do."""
        if self._closed or self._aborted:
            return
        for run in self._runs.values():
            if run.phase is Phase.PENDING:
                try:
                    self._try_start(run)
                except SessionAbort as exc:
                    self._fail(run, exc)
        if cycle := self._waiting_cycle():
            labels = " and ".join(run.bound.label for run in cycle)
            for run in cycle:
                self._fail(run, SessionAbort.invalid(f"the inputs of {labels} wait for each other's outputs"))
        if self._client_done and not any(r.phase is Phase.RUNNING for r in self._runs.values()):
            for run in self._runs.values():
                if run.phase is Phase.PENDING:
                    self._fail(run, SessionAbort.invalid(
                        f"{run.bound.label}: the client closed its stream before the action's input "
                        f"{run.bound.input_id!r} was complete"
                    ))
            if not any(r.phase is not Phase.DONE for r in self._runs.values()):
                self._out.put_nowait(_END)

    def _waiting_cycle(self) -> list[GenerateRun]:
        """Pending actions whose inputs wait for each other's outputs, in a ring (none can ever start); []
        when there is no such ring. The actions that could still start are peeled off first (those waiting
        for no other pending action's output, then those waiting only for theirs): every action left waits
        for another one left, so following that from any of them runs into a ring."""
        pending = [r for r in self._runs.values() if r.phase is Phase.PENDING]
        writer = {node: r for r in pending for node in (r.bound.output_id, r.bound.error_id) if node is not None}
        waits = {r: [writer[n] for n in r.waiting_for if n in writer] for r in pending}
        left = set(pending)
        while free := {r for r in left if not any(w in left for w in waits[r])}:
            left -= free
        if not left:
            return []
        seen: list[GenerateRun] = []
        run = next(r for r in pending if r in left)  # from the earliest action: the ring named in a fixed order
        while run not in seen:
            seen.append(run)
            run = next(w for w in waits[run] if w in left)
        return seen[seen.index(run):]

    def _try_start(self, run: GenerateRun) -> None:
        bound = run.bound
        flat = self.graph.flatten(bound.input_id, max_visits=self._gw.settings.evergreen.max_session_nodes)
        for leaf in flat.leaves:
            check_media(leaf.node_id, leaf.metadata, self._gw.settings.served_model_name)
        own = {bound.output_id, bound.error_id} & set(flat.missing)
        if own:
            raise SessionAbort.invalid(f"{bound.label}: the input contains the action's own output {own.pop()!r}")
        run.waiting_for = frozenset(flat.missing)
        if not flat.complete:
            return
        if bound.output_id is None and bound.error_id is None:
            run.phase = Phase.DONE  # the client wants no output: nothing to compute
            return
        run.phase = Phase.RUNNING
        run.task = asyncio.create_task(run.run(flat.leaves))
        run.task.add_done_callback(partial(self._on_run_done, run))

    def _on_run_done(self, run: GenerateRun, task: asyncio.Task[None]) -> None:
        """The run is DONE only now, its failure (if any) queued first: the session's end, which
        waits for every run to be DONE, can never overtake it."""
        run.phase = Phase.DONE
        if task.cancelled():
            exc: BaseException | None = None
        else:
            exc = task.exception()
        if isinstance(exc, SessionAbort):
            self._abort(exc)
        elif exc is not None:
            log.error("evergreen.action_crashed", error=repr(exc))
            self._abort(SessionAbort(grpc.StatusCode.INTERNAL, f"the gateway failed an action: {exc!r}"))
        else:
            self._advance()

    # -- session management actions (extensions beyond the spec's v1) --------------------

    def _busy(self) -> set[str | None]:
        """Output nodes that actions are still writing."""
        return {r.bound.output_id for r in self._runs.values() if r.phase is not Phase.DONE}

    def _drop(self, bound: Bound) -> None:
        node_id = bound.input_id
        if node_id in self._busy():
            raise SessionAbort(grpc.StatusCode.FAILED_PRECONDITION, f"DROP: node {node_id!r} is still being written")
        self._forget([node_id])

    def _forget(self, node_ids: list[str]) -> None:
        dropped = self.graph.drop(node_ids)
        if dropped and not self._closed:
            self._gw.store.evergreen_drop(self.id, dropped)

    def _set_ttl(self, bound: Bound) -> None:
        ttl = action_config(bound.action, TtlParams, self._gw.settings, required=True).ttl_s
        node_id = bound.input_id
        if node_id in self._ttls:
            self._ttls.pop(node_id).cancel()

        def expire() -> None:  # the node and its descendants, but not outputs still being written
            self._ttls.pop(node_id, None)
            busy = self._busy()
            self._forget([n for n in self.graph.descendants(node_id) if n not in busy])

        self._ttls[node_id] = asyncio.get_running_loop().call_later(ttl, expire)

    def _cancel(self, bound: Bound) -> None:
        run = self._runs.get(bound.input_id)
        if run is None:
            raise SessionAbort.invalid(f"CANCEL: node {bound.input_id!r} is not the output of a GENERATE action")
        if run.phase is not Phase.DONE:
            task = asyncio.create_task(run.cancel())
            self._background.add(task)
            task.add_done_callback(self._background.discard)
