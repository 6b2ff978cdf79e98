"""Applying step results: each worker's figures (free KV, the decode batch's pace), then what its slots say
(prompt outputs and readouts, forks, failures, controlled branches) and every sampled token, which may
end its request (a stop token, its length) and whose text is worked out inline or deferred
(:mod:`.endings`)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import structlog

from common import wire
from common.errors import INTERNAL_ERROR
from common.pooling import vector_bytes
from services.scheduler.batch_ceiling import BatchCeiling
from services.scheduler.controlled import Branch, ControlledSteps
from services.scheduler.endings import Endings
from services.scheduler.requests import LiveRequest, State
from services.scheduler.state import CoreState
from services.scheduler.steps import Dispatch

log = structlog.get_logger()


def _check_result(tokens: list[int], slots: int, top: dict[int, list[wire.TokenLogprob]], vocab_size: int) -> None:
    """ValueError: a step result's tokens are not one per slot of its step, each a token id of the vocabulary or
    -1 (none), or its top alternatives name tokens outside the vocabulary."""
    if len(tokens) != slots:
        raise ValueError(f"{len(tokens)} slots, the step has {slots}")
    if tokens and (min(tokens) < -1 or max(tokens) >= vocab_size):
        bad = sorted({t for t in tokens if not -1 <= t < vocab_size})
        raise ValueError(f"sampled token ids {bad[:8]} outside the vocabulary of {vocab_size}")
    for alternatives in top.values():
        if any(not 0 <= alt.token_id < vocab_size for alt in alternatives):
            raise ValueError(f"top alternatives outside the vocabulary of {vocab_size}")



class Results:
    """Applies results to ``state``; a result that does not fit its step drops its worker (``lose_worker``)."""

    def __init__(self, state: CoreState, endings: Endings, controlled: ControlledSteps,
                 lose_worker: Callable[[bytes, str], None]) -> None:
        self.state = state
        self.endings = endings
        self.controlled = controlled
        self.lose_worker = lose_worker

    def _observe_batch(self, dispatch: Dispatch, slots: int, forward_ms: float) -> None:
        """A decode-only step's time, for its worker's batch ceiling (a step with a prompt chunk says nothing
        about the decode batch)."""
        if any(len(seq.tokens) > 1 for seq in dispatch.step.seqs):
            return
        info = dispatch.info
        if info.batch is None:
            info.batch = BatchCeiling(self.state.limits.max_batch_size)
        before = info.batch.ceiling
        info.batch.observe(slots, forward_ms)
        if info.batch.ceiling != before:
            log.info("scheduler.batch_ceiling", worker=dispatch.worker.decode(errors="replace"),
                     ceiling=info.batch.ceiling, was=before, **info.batch.figures())

    def step_done(self, worker: bytes, result: wire.StepResult) -> None:
        """Note what a step result says about its worker (before :meth:`apply`)."""
        info = self.state.pool.workers.get(worker)
        if info is not None and result.kv_free_tokens >= 0:
            info.kv_free_tokens = result.kv_free_tokens
            info.kv_cached_tokens = max(result.kv_cached_tokens, 0)

    def apply(self, dispatch: Dispatch, result: wire.StepResult) -> None:
        """Apply one worker's step result: its SeqSteps' parts (prompt outputs, forks, failures,
        readouts, controlled branches), then every sampled token, followers' first. A token is a
        handful of operations inline (this runs for every token): a request without stop strings
        has its text and event made here, one with them defers its text (``Endings.emit_deferred``)."""
        state = self.state
        dispatch.info.steps_out -= 1
        followers = dispatch.followers
        failures = {f.seq_id: f.message for f in result.failures}
        slots = len(followers) + len(dispatch.batch)
        try:
            tokens, logprobs = result.slots()
            _check_result(tokens, slots, result.top, dispatch.info.hello.vocab_size)
        except ValueError as exc:  # a broken worker, or one that does not speak this wire: it is dropped
            log.error("scheduler.malformed_result", worker=dispatch.worker.decode(errors="replace"), error=str(exc))
            if state.pool.workers.get(dispatch.worker) is dispatch.info:
                self.lose_worker(dispatch.worker, f"its step result does not fit the step: {exc}")
            return
        top = result.top
        if state.limits.adaptive_batch:
            self._observe_batch(dispatch, slots, result.forward_ms)

        def sampled(slot: int) -> wire.SampledToken:  # a slot's token as events carry it (made only for those)
            return wire.SampledToken(tokens[slot], logprobs[slot], top.get(slot) or [])

        for request in followers:
            request.in_flight -= 1
        if failures:
            for request in followers:
                if request.seq_id in failures:
                    self._seq_failed(request, request.seq_id, failures[request.seq_id])
        taken = self._apply_seqs(dispatch, len(followers), tokens, sampled, failures, result)
        deferred, finished, events, packed = state.deferred, State.FINISHED, state.outbox.by_gateway, state.outbox.packed
        for request, slot in itertools.chain(zip(followers, range(len(followers))), taken):
            if request.state is finished:  # cancelled while its step ran (or failed above)
                continue
            token = tokens[slot]
            if token < 0:
                self.endings.fail(request, INTERNAL_ERROR, "the worker returned no token for this sequence")
                continue
            generated = request.generated
            generated.append(token)
            n = len(generated)
            if token in request.stop_ids:  # requests.stop_token, its set made at admission
                self.endings.finish(request, "stop", wire.TokenEvent(rid=request.rid, tokens=[sampled(slot)]),
                                    stop_reason=token)
                continue
            if n >= request.limit:  # requests.length_reached
                self.endings.emit_text(request, wire.TokenEvent(rid=request.rid, tokens=[sampled(slot)]), last=True)
                continue
            if request.follower and n + request.in_flight >= request.limit:
                state.batches[request.worker].leave(request)  # a token in flight may be its last
            text = request.text
            if text is None:  # the gateway works out its text (common.event_text)
                if request.packed:
                    plain = packed[request.gateway]
                    plain.rids.append(request.rid)
                    plain.tokens.append(token)
                    plain.logprobs.append(logprobs[slot])
                else:
                    events[request.gateway].append(wire.TokenEvent(rid=request.rid, tokens=[sampled(slot)]))
            elif text.stop:
                # Its text may complete a stop string: it is worked out once the next step is on its
                # way (the scan costs more than the lookup of a token's text). A stop string found
                # then ends the request, and the token that step samples for it is dropped.
                if not request.deferred:
                    deferred.append(request)
                request.deferred.append(wire.TokenEvent(rid=request.rid, tokens=[sampled(slot)]))
            elif request.deferred:  # its stop strings were taken away (a Modify) with text still to work out
                self.endings.emit_text(request, wire.TokenEvent(rid=request.rid, tokens=[sampled(slot)]), last=False)
            else:  # Endings.emit_text inline: without stop strings nothing ends it here
                events[request.gateway].append(
                    wire.TokenEvent(rid=request.rid, tokens=[sampled(slot)], text=text.push_one(token)))

    def _apply_seqs(self, dispatch: Dispatch, first: int, tokens: list[int],
                    sampled: Callable[[int], wire.SampledToken], failures: dict[int, str],
                    result: wire.StepResult) -> list[tuple[LiveRequest, int]]:
        """The parts of a result that answer the step's SeqSteps (their slots from ``first`` on), but the
        plain sequences' tokens: returns those, each request with its slot."""
        max_len = self.state.max_model_len()
        taken: list[tuple[LiveRequest, int]] = []
        for slot, (request, seq) in enumerate(dispatch.batch, first):
            if isinstance(request, Branch):
                self.controlled.apply(request, seq, sampled(slot) if tokens[slot] >= 0 else None,
                                      failures.get(seq.seq_id), max_len, result.readouts.get(seq.seq_id))
                continue
            request.in_flight -= 1
            if seq.fork_of is not None:
                self.state.sessions.forked(seq.fork_of)
            if seq.seq_id in failures:
                self._seq_failed(request, seq.seq_id, failures[seq.seq_id])
                continue
            if request.state is State.FINISHED:  # cancelled while its step ran
                continue
            prompt = request.prompt
            if request.applied < len(prompt):
                self._prompt_outputs(request, seq, result)
                request.cached_tokens += result.cached_tokens.get(seq.seq_id, 0)
                request.applied += len(seq.tokens)
                if request.submit.max_tokens == 0 and request.applied == len(prompt):
                    self._finish_prefill(request)
            elif result.readouts:
                self._decoded_readouts(request, seq, result)
            if seq.sample:
                taken.append((request, slot))
        return taken

    def _finish_prefill(self, request: LiveRequest) -> None:
        """End a prefill-only request once its whole prompt ran: its last event carries its embedding, when asked."""
        pooled = request.pooled
        if pooled is None:
            self.endings.finish(request, "length")
        elif not pooled.complete:
            self.endings.fail(request, INTERNAL_ERROR, f"the worker reported {pooled.seen} of the "
                      f"{len(pooled.positions)} pooled positions of this embedding")
        else:
            self.endings.finish(request, "length", wire.TokenEvent(rid=request.rid, embedding=vector_bytes(pooled.vector())))

    def _seq_failed(self, request: LiveRequest, seq_id: int, message: str) -> None:
        """The worker failed ``request``'s sequence (and released it)."""
        if request.state is State.FINISHED:  # a sequence parked while its last step ran: it is gone
            self.state.sessions.failed(seq_id)
        else:
            self.endings.fail(request, INTERNAL_ERROR, f"the worker failed this sequence: {message}")

    def _prompt_outputs(self, request: LiveRequest, seq: wire.SeqStep, result: wire.StepResult) -> None:
        """One event with the outputs of the prompt positions this step fed and were asked about (the
        embedding's partial sum is kept for the last event)."""
        if not request.has_prompt_outputs:
            return
        if seq.pool and request.pooled is not None:
            try:
                request.pooled.add(result.pooled.get(seq.seq_id, b""), len(seq.pool))
            except ValueError as exc:
                self.endings.fail(request, INTERNAL_ERROR, f"the worker's pooled hidden states are malformed: {exc}")
                return
        for score in result.scores.get(seq.seq_id, []):
            request.scored[score.position + 1] = score
        readouts = {r.position: r.values for r in result.readouts.get(seq.seq_id, [])}
        residuals = {r.position: r.values for r in result.residuals.get(seq.seq_id, [])}
        outputs = []
        for p in range(request.applied, request.applied + len(seq.tokens)):
            if p not in request.logprob_positions and p not in request.readout_positions and p not in residuals:
                continue
            out = wire.PositionOutput(position=p, token_id=request.prompt[p], readout=readouts.get(p, b""),
                                      residual=residuals.get(p, b""))
            score = request.scored.pop(p, None)
            if score is not None:
                out.logprob, out.top = score.logprob, score.top
            outputs.append(out)
        if outputs:
            self.state.outbox.event(request.gateway, wire.TokenEvent(rid=request.rid, prompt_outputs=outputs))

    def _decoded_readouts(self, request: LiveRequest, seq: wire.SeqStep, result: wire.StepResult) -> None:
        """The readout of a decoded token, computed by the step that fed it (the one after its sampling),
        as an event of its own (a ``PositionOutput`` past the prompt)."""
        outputs = [wire.PositionOutput(position=r.position, token_id=seq.tokens[0], readout=r.values)
                   for r in result.readouts.get(seq.seq_id, [])]
        if outputs:
            self.state.outbox.event(request.gateway, wire.TokenEvent(rid=request.rid, prompt_outputs=outputs))
