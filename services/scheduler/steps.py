"""Building steps: one ``Step`` per worker with work and room in its pipeline, its followers packed, then
its other sequences' SeqSteps (decoding ones first, then prompt chunks within the worker's token budget),
the controlled plan's part, and the frees owed to it."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field

from common import wire
from services.scheduler.batch import WorkerBatch
from services.scheduler.controlled import Branch, ControlledSteps, Plan
from services.scheduler.requests import LiveRequest, State
from services.scheduler.state import CoreState
from services.scheduler.workers import WorkerInfo

Item = tuple[LiveRequest | Branch, wire.SeqStep]


@dataclass
class Dispatch:
    """One worker's step, and what its result is applied to (opaque to the shell): the requests of its
    slots, ``followers`` (``Step.follows``) then ``batch`` (``Step.seqs``)."""

    worker: bytes
    info: WorkerInfo  # the worker's life it went to
    step: wire.Step
    followers: list[LiveRequest]
    batch: list[Item]
    frames: list[bytes] = field(default_factory=list)  # the mask frame, when the masks go with the step


class StepBuilder:
    """Builds the steps of ``state``'s workers, with ``controlled``'s part in them."""

    def __init__(self, state: CoreState, controlled: ControlledSteps) -> None:
        self.state = state
        self.controlled = controlled

    def build_steps(self, controlled: Plan | None = None, workers: Collection[bytes] | None = None) -> list[Dispatch]:
        """The next step for each worker (of ``workers``; None: all) that has sequences to run or to
        free and fewer than ``limits.pipeline_depth`` steps in flight. The workers of a ``controlled``
        plan must be among ``workers``. Only the workers with work are visited (``CoreState.busy_workers``)."""
        state = self.state
        if controlled is None:
            controlled = Plan()
        else:
            self.controlled.built()
        per_worker: dict[bytes, list[Item]] = defaultdict(list)
        for identity, items in controlled.per_worker.items():
            per_worker[identity] += [(b, s) for b, s in items if b.finished is None and b.request.state is State.RUNNING]
        # limits.step_token_budget is per worker (each runs its own forward pass)
        full = state.limits.step_token_budget
        budget = {identity: full - sum(max(len(s.tokens), 1) for _, s in items)
                  for identity, items in per_worker.items()}
        depth = state.limits.pipeline_depth
        steps = []
        # a controlled plan's workers get a step whatever it holds; the others only where there is work
        for identity in {i for i in state.busy_workers() if workers is None or i in workers} | per_worker.keys():
            worker = state.pool.workers.get(identity)
            if worker is None:
                continue
            roomy = worker.steps_out < depth and (workers is None or identity in workers)
            batch = per_worker.get(identity, [])
            followers: list[LiveRequest] = []
            ids = b""
            if roomy and (plain := state.batches.get(identity)) is not None:
                followers, ids = plain.follows()
                for request in followers:
                    request.in_flight += 1
                batch += self._build_batch(plain, budget.get(identity, full) - len(followers))
            if not (identity in per_worker or batch or followers or (roomy and state.to_free.get(identity))):
                continue
            free = state.to_free.pop(identity, [])
            step = wire.Step(step_id=next(state.step_ids), seqs=[s for _, s in batch], follows=ids, free=free,
                             free_all=worker.fresh)
            step.masks_follow = self.controlled.awaits_masks(step)
            worker.fresh = False
            worker.steps_out += 1
            steps.append(Dispatch(identity, worker, step, followers, batch, self.controlled.masks_with(step)))
        return steps

    def _build_batch(self, batch: WorkerBatch, left: int) -> list[Item]:
        """A worker's SeqSteps for its plain requests that do not follow, within ``left`` tokens:
        decoding sequences first (one token each), then prompt chunks, each in priority then arrival
        order."""
        items: list[Item] = []
        prefilling: list[LiveRequest] = []
        for request in batch.order():
            if left <= 0:
                break
            if request.paused:
                continue
            if request.fed < len(request.prompt):
                prefilling.append(request)
                continue
            if request.in_flight:  # decoding in the step in flight: feed its sample
                if not self._may_follow(request):
                    continue
                seq = wire.SeqStep(seq_id=request.seq_id, tokens=[], follow=True)
            else:  # decoding: feed the token sampled last
                seq = wire.SeqStep(seq_id=request.seq_id, tokens=[request.generated[-1]])
                self._session_feed(request, seq)
            left -= 1
            self._add(batch, items, request, seq)
        chunk = self.state.limits.prefill_chunk_tokens
        for request in prefilling:
            if left <= 0:
                break
            if request.in_flight and (request.in_flight > 1 or request.last_sample):
                continue  # a chunk goes while the one before it runs, unless that one samples
            tokens, sample = request.next_chunk(min(chunk, left))
            left -= len(tokens)
            seq = wire.SeqStep(seq_id=request.seq_id, tokens=tokens, sample=sample, images=request.images_in(tokens))
            self._session_feed(request, seq)
            request.fed += len(tokens)
            self._add(batch, items, request, seq)
        return items

    def _add(self, batch: WorkerBatch, items: list[Item], request: LiveRequest, seq: wire.SeqStep) -> None:
        """``seq`` goes into the step, with ``request``'s sampling parameters when they changed; the
        request joins the followers when the step after may follow this one."""
        if request.sampling_dirty:  # (on its first step among others: the worker creates the sequence then)
            seq.sampling = request.submit.sampling
            seq.cache_domain = request.submit.cache_domain
            request.sampling_dirty = False
        request.steering_step(seq)
        request.in_flight += 1
        request.last_sample = seq.sample
        items.append((request, seq))
        if self._may_follow(request):
            batch.join(request)

    @staticmethod
    def _may_follow(request: LiveRequest) -> bool:
        """Whether a step built now may ``follow`` the steps sent with ``request``: the last of them
        samples it, the tokens they sample leave room for one more, and it reads out no decoded
        position (the step feeding a position reads it out; a follow asks for none)."""
        return (request.last_sample and len(request.generated) + request.in_flight < request.limit
                and not request.readout_positions)

    def _session_feed(self, request: LiveRequest, seq: wire.SeqStep) -> None:
        """Session-turn parts of a SeqStep: the first one's fork/backtrack of a parked sequence,
        the per-position outputs of the prompt positions it feeds; and what the sequence will hold."""
        if request.fork_of is not None or request.backtrack:
            seq.fork_of, seq.backtrack = request.fork_of, request.backtrack
            request.fork_of, request.backtrack = None, 0
        if seq.backtrack:
            del request.kv_tokens[len(request.kv_tokens) - seq.backtrack :]
        request.on_worker = True
        if request.fed >= len(request.prompt):  # decoding: the token fed is the last one sampled
            if request.readout_positions:
                position = len(request.prompt) + len(request.generated) - 1
                if position in request.readout_positions:
                    seq.readouts = [position]
            return
        request.kv_tokens.extend(seq.tokens)
        if not request.has_prompt_outputs:
            return
        prompt, start = request.prompt, request.fed
        fed = range(start, start + len(seq.tokens))
        seq.scores = [wire.ScoreQuery(q, prompt[q + 1]) for q in fed if q + 1 in request.logprob_positions
                      and q + 1 < len(prompt)]
        seq.readouts = [p for p in fed if p in request.readout_positions]
        seq.residuals = [p for p in fed if p in request.residual_positions]
        if seq.residuals and request.submit.outputs is not None:
            seq.residual_layers = list(request.submit.outputs.residual_layers)
        if request.pooled is not None:
            pooled = request.pooled.positions
            seq.pool = list(range(max(fed.start, pooled.start), min(fed.stop, pooled.stop)))
        if seq.scores and request.submit.outputs is not None:
            seq.top_logprobs = request.submit.outputs.top_logprobs
