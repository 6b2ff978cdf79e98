"""A controller's steering and readouts through the scheduler (controllers/ABI.md "Steering and readouts"): a
reply's steering reaches its branch's next SeqStep (with the request's vectors it names), forks inherit it, and the
readouts a controller asked for are read out and handed back with the next post_pre_process."""

from __future__ import annotations

import numpy as np
import pytest

from common import aici_wire, wire
from common.steering import SteeringVector, encode
from services.scheduler.controlled import MainReply
from tests.scheduler.harness import BANG, HE, LLO, WOR, Harness, seqs_of
from tests.scheduler.test_controlled import (  # noqa: F401
    FakeRuntime, controlled, next_seq_id, runtime_kind, send, step,
)

VECTOR = encode(SteeringVector.of({2: np.ones(4)}))
AWAY = [wire.SteeringTerm(vector="concept:happy", scale=-4.0)]
WITH_V1 = [wire.SteeringTerm(vector="v1", scale=2.0, positions="generated")]


class EffectsRuntime(FakeRuntime):
    """The fake runtime, its next post_pre_process reply carrying ``steering`` and ``readouts_on`` (then cleared)."""

    def __init__(self) -> None:
        super().__init__()
        self.steering: dict[int, list[wire.SteeringTerm]] = {}
        self.readouts_on: list[int] = []

    def post_pre_process(self, h: Harness, request: aici_wire.PostPreProcess) -> MainReply:
        answer = super().post_pre_process(h, request)
        if answer.data is not None:
            answer.data.steering = [aici_wire.SeqSteering(id=i, terms=t) for i, t in self.steering.items()]
            answer.data.readouts_on = self.readouts_on
        self.steering, self.readouts_on = {}, []
        return answer


def test_a_controllers_steering_goes_with_its_branchs_seqstep_after_the_calls_with_the_vectors_it_names():
    h, _ = controlled(steering=WITH_V1, steering_vectors={"v1": VECTOR})
    rt = EffectsRuntime()
    seq_id = next_seq_id(h)
    steps, _ = step(h, rt, {"c": HE})
    (first,) = seqs_of(steps, "c")
    assert first.steering == WITH_V1 and first.vectors == {"v1": VECTOR}  # the request's own, with its prompt
    assert rt.requests[0].pre_ops[0].vectors == {"v1": [2]}  # what the controller may steer with
    rt.steering[seq_id] = AWAY  # set hearing of HE: from the token this step samples (LLO) on
    steps, _ = step(h, rt, {"c": LLO})
    assert [(s.tokens, s.steering) for s in seqs_of(steps, "c")] == [([HE], None)]
    steps, _ = step(h, rt, {"c": WOR})
    (seq,) = seqs_of(steps, "c")
    assert (seq.tokens, seq.steering, seq.vectors) == ([LLO], AWAY, {})
    rt.steering[seq_id] = [*AWAY, *WITH_V1]
    steps, _ = step(h, rt)
    assert seqs_of(steps, "c")[0].steering is None  # unchanged until the calls' step is planned
    steps, _ = step(h, rt)
    (seq,) = seqs_of(steps, "c")
    assert seq.steering == [*AWAY, *WITH_V1] and seq.vectors == {"v1": VECTOR}


@pytest.mark.parametrize("ahead", [False, True], ids=["planned after its calls", "sent ahead of its calls"])
def test_a_steering_and_readouts_start_at_the_same_token_whether_the_step_went_ahead_or_not(ahead):
    h, _ = controlled()
    rt = EffectsRuntime()
    rt.pre_default = ahead
    seq_id = next_seq_id(h)
    step(h, rt, {"c": HE})
    rt.steering[seq_id], rt.readouts_on = AWAY, [seq_id]
    fed = []
    for token in (LLO, WOR, BANG):
        steps, _ = step(h, rt, {"c": token})
        fed += [(s.tokens, s.steering, s.readouts) for s in seqs_of(steps, "c")]
    assert fed == [([HE], None, []), ([LLO], AWAY, [4]), ([WOR], None, [5])]
    assert any(isinstance(r, aici_wire.PostPreProcess) and r.ahead for r in rt.requests) == ahead
    assert h.core.controlled.requests["c"].branches[0].steering == AWAY


def test_a_fork_inherits_its_parents_steering_and_readouts():
    h, _ = controlled()
    rt = EffectsRuntime()
    parent = next_seq_id(h)
    rt.steering[parent], rt.readouts_on = AWAY, [parent]
    step(h, rt, {"c": HE})
    steps, _ = step(h, rt, {"c": LLO})
    assert seqs_of(steps, "c")[0].steering == AWAY
    rt.pre[parent] = {"num_forks": 2}
    steps, _ = step(h, rt, {"c": WOR, "c/1": WOR})
    mother, child = seqs_of(steps, "c")
    assert child.fork_of == parent and child.steering is None  # the worker's copy is steered as its parent is
    assert mother.readouts == child.readouts == [4]
    fork = h.core.controlled.requests["c"].branches[1]
    assert fork.steering == AWAY and fork.readouts
    # a change in the call that forks again: the new fork takes it too, with the next SeqSteps
    rt.pre[parent], rt.steering[parent] = {"num_forks": 2}, []
    steps, _ = step(h, rt)
    assert [s.steering for s in seqs_of(steps, "c")] == [None, None, None]
    steps, _ = step(h, rt)
    newest = h.core.controlled.requests["c"].branches[2].seq_id
    assert {s.seq_id: s.steering for s in seqs_of(steps, "c")} == {parent: [], fork.seq_id: None, newest: []}


def test_readouts_a_controller_asks_for_are_read_out_and_handed_back_with_the_next_call():
    h, _ = controlled(n=3)
    rt = EffectsRuntime()
    seq_id = next_seq_id(h)
    rt.readouts_on = [seq_id]  # asked for in init_prompt: reported by its binding, before the step is planned
    for position, token, values in ((2, HE, b"R2"), (3, LLO, b"R3")):
        steps, _ = send(h, rt)
        (seq,) = seqs_of(steps, "c")
        assert seq.readouts == [position]  # the last position the step feeds
        h.apply(steps, {"c": token}, readouts={seq_id: [wire.ReadoutResult(position, values)]})
    steps, _ = send(h, rt)
    posts = [r for r in rt.requests if isinstance(r, aici_wire.PostPreProcess)]
    assert [p.readouts for p in posts] == [[], [aici_wire.SeqReadout(id=seq_id, values=b"R2")],
                                           [aici_wire.SeqReadout(id=seq_id, values=b"R3")]]
