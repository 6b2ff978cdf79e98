"""A controller's steering and readouts through the scheduler (controllers/ABI.md "Steering and readouts"): a
reply's steering reaches its branch's next SeqStep (with the request's vectors it names), forks inherit it, and the
readouts a controller asked for are read out and handed back with the next post_pre_process."""

from __future__ import annotations

import numpy as np

from common import aici_wire, wire
from common.steering import SteeringVector, encode
from services.scheduler.controlled import MainReply
from tests.scheduler.harness import HE, LLO, WOR, Harness, seqs_of
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


def test_a_controllers_steering_goes_with_its_branchs_next_seqstep_with_the_vectors_it_names():
    h, _ = controlled(steering=WITH_V1, steering_vectors={"v1": VECTOR})
    rt = EffectsRuntime()
    seq_id = next_seq_id(h)
    steps, _ = step(h, rt, {"c": HE})
    (first,) = seqs_of(steps, "c")
    assert first.steering == WITH_V1 and first.vectors == {"v1": VECTOR}  # the request's own, with its prompt
    assert rt.requests[0].pre_ops[0].vectors == {"v1": [2]}  # what the controller may steer with
    rt.steering[seq_id] = AWAY
    steps, _ = step(h, rt, {"c": LLO})  # set in this step's post_pre_process: from its fed token on
    (seq,) = seqs_of(steps, "c")
    assert seq.steering == AWAY and seq.vectors == {} and seq.tokens == [HE]
    steps, _ = step(h, rt, {"c": WOR})
    assert seqs_of(steps, "c")[0].steering is None  # unchanged: not sent again
    rt.steering[seq_id] = [*AWAY, *WITH_V1]
    steps, _ = step(h, rt)
    (seq,) = seqs_of(steps, "c")
    assert seq.steering == [*AWAY, *WITH_V1] and seq.vectors == {"v1": VECTOR}


def test_a_fork_inherits_its_parents_steering_and_readouts():
    h, _ = controlled()
    rt = EffectsRuntime()
    parent = next_seq_id(h)
    rt.steering[parent], rt.readouts_on = AWAY, [parent]
    step(h, rt, {"c": HE})
    rt.pre[parent] = {"num_forks": 2}
    steps, _ = step(h, rt, {"c": LLO, "c/1": WOR})
    mother, child = seqs_of(steps, "c")
    assert child.fork_of == parent and child.steering is None  # the worker's copy is steered as its parent is
    assert mother.readouts == child.readouts == [3]
    fork = h.core.controlled.requests["c"].branches[1]
    assert fork.steering == AWAY and fork.readouts
    # a change in the call that forks goes with both SeqSteps
    rt.pre[parent], rt.steering[parent] = {"num_forks": 2}, []
    steps, _ = step(h, rt)
    seqs = seqs_of(steps, "c")
    assert len(seqs) == 3 and [s.steering for s in seqs if s.seq_id != fork.seq_id] == [[], []]


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
