"""Native twin of controllers/src/concept_guard.c: keeps a readout concept below a threshold by steering against it.

module_arg (JSON): {"concept": name, "threshold": t, "scale": s}. After every step it reads the last fed position's
readout of the concept (the mean over the readout layers); while that is above ``t`` it steers the sequence with the
concept's own direction at scale ``-|s|`` (``concept:<name>`` at the readout layers), and releases the steering once
the readout is back at or below ``t``. It logs ``concept_guard: <readout> on|off`` per step and stops at EOS; a
concept the worker does not read out stops the sequence before its first token.
"""

from __future__ import annotations

import json
import math

import numpy as np

from controllers.native.base import Host, NativeController


class ConceptGuard(NativeController):
    def __init__(self, host: Host, module_arg: bytes) -> None:
        super().__init__(host, module_arg)
        arg = json.loads(module_arg or b"{}")
        if not (isinstance(arg, dict) and isinstance(arg.get("concept"), str)
                and all(isinstance(arg.get(k), (int, float)) and math.isfinite(arg[k]) for k in ("threshold", "scale"))):
            raise ValueError('module_arg must be {"concept": name, "threshold": t, "scale": s}')
        self.concept, self.threshold, self.scale = arg["concept"], float(arg["threshold"]), -abs(float(arg["scale"]))
        self.index: int | None = None  # the concept's place in the readout, once looked up
        self.layers = 0
        self.steering = False
        self.all_allowed = b"\xff" * (-(-host.vocab_size // 32) * 4)
        host.readout()  # a readout at every step from the prompt's last one on

    def pre_is_default(self) -> bool:
        return True

    def mid_process(self, fork_group: list[int]) -> str | dict:
        if self.index is None:
            info = self.host.readout_info() or {"concepts": [], "layers": []}
            if self.concept not in info["concepts"]:
                self.host.log(f"readout error: no concept {self.concept!r} among {info}\n".encode())
                return "Stop"
            self.index, self.layers = info["concepts"].index(self.concept), len(info["layers"])
        self.host.return_logit_bias(self.all_allowed)
        return {"SampleWithBias": {}}

    def post_process(self, tokens: list[int], backtrack: int) -> dict:
        if self.host.eos_token in tokens:
            return {"stop": True}
        readout = np.frombuffer(self.host.readout(), dtype="<f4")
        if self.index is None or not readout.size:
            return {"stop": False}
        value = float(readout.reshape(self.layers, -1)[:, self.index].mean())
        over = value > self.threshold
        if over != self.steering:
            terms = [{"vector": f"concept:{self.concept}", "scale": self.scale}] if over else []
            if self.host.steer(terms) == 0:
                self.steering = over
        self.host.log(f"concept_guard: {value:.6f} {'on' if self.steering else 'off'}\n".encode())
        return {"stop": False}
