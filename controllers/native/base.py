"""The class native controllers implement, and the host facilities they get (the Wasm ABI's imports
as Python methods)."""

from __future__ import annotations

import copy
from typing import Any, Protocol

# A grammar's forced tokens worth a Splice (fast forward): a single one costs a step either way, sampled under
# a mask that allows only it, and a Splice costs the step that found it.
FF_MIN = 2


class Constraint(Protocol):
    def commit(self, tokens: list[int]) -> int: ...  # 0 ok, 1 finished, < 0 rejected (state unchanged)
    def rollback(self, n: int) -> int: ...
    def is_accepting(self) -> bool: ...
    def ff_tokens(self, limit: int | None = None) -> list[int]: ...  # forced next (at most limit), none from EOS


class Host(Protocol):
    """Per-sequence facilities (services/controller_runtime/host.py SeqHost implements this)."""

    seq_id: int
    vocab_size: int
    eos_token: int

    def tokenize(self, data: bytes) -> list[int]: ...
    def get_config(self, name: str) -> bool: ...  # "fork", "backtrack", "ff_tokens"
    def log(self, data: bytes) -> None: ...  # captured like a Wasm guest's stdout
    def storage_cmd(self, cmd: dict) -> dict: ...  # ABI.md §4: StorageCmd -> StorageResp
    def get_var(self, name: str) -> bytes | None: ...
    def set_var(self, name: str, value: bytes, *, append: bool = False) -> None: ...
    def constraint_new(self, kind: int, source: str) -> int: ...  # 0 regex, 1 JSON schema, 2 Lark, 3 yacc; -1 error
    def constraint(self, handle: int) -> Constraint: ...
    def constraint_return_bias(self, handle: int) -> int: ...  # mask of this mid_process; 0 ok, 1 finished
    def constraint_free(self, handle: int) -> None: ...
    def return_logit_bias(self, bitset: bytes) -> None: ...  # ceil(vocab/32) LE u32 words, bit = allowed
    # steering and readouts (ABI.md "Steering and readouts"), from the sequence's first pre_process on:
    # the sequence's whole steering from its next fed token on ([{"vector", "scale", "layers"?, "positions"?}]);
    # 0, or -1 with the reason in the logs
    def steer(self, terms: list[dict[str, Any]]) -> int: ...
    # the last fed position's readout, float32 [layers][concepts] little-endian (b"": none yet); the first call
    # asks for one at every step
    def readout(self) -> bytes: ...
    def readout_info(self) -> dict[str, list] | None: ...  # {"concepts": [...], "layers": [...]}; None: not bound


class NativeController:
    """Override the callbacks; results are the same JSON shapes a Wasm controller returns.

    ``module_arg`` is the instantiate request's module_arg as bytes (JSON non-strings serialized).
    Native controllers are trusted: they run in the runtime's process and their deadline is checked
    after the call returns, not enforced by preemption.
    """

    def __init__(self, host: Host, module_arg: bytes) -> None:
        self.host = host
        self.module_arg = module_arg

    def init_prompt(self, prompt: list[int]) -> None:
        pass

    def pre_process(self) -> dict[str, Any]:
        return {"num_forks": 1, "suspend": False, "ff_tokens": []}

    def pre_is_default(self) -> bool:
        """True when pre_process would now return the default above and change nothing: the runtime then does
        not call it (as a Wasm guest's I/O-area flag), and the scheduler may send the step ahead."""
        return False

    def mid_process(self, fork_group: list[int]) -> str | dict[str, Any]:
        """"Stop" | {"SampleWithBias": {}} (after host.return_logit_bias / constraint_return_bias) |
        {"Splice": {"backtrack": n, "ff_tokens": [...]}}"""
        return "Stop"

    def post_process(self, tokens: list[int], backtrack: int) -> dict[str, Any]:
        return {"stop": False}

    def fork(self, host: Host) -> NativeController:
        """The controller of a new fork: a deep copy bound to the fork's host (constraint handles stay
        valid: the host copies its constraints)."""
        return copy.deepcopy(self, {id(self.host): host})
