"""Decoded tokens on their way to a Salience client: a token whose position ``readout_ranges`` cover
waits for its concept readout, which the worker computes when it feeds the token (the step after its
sampling), and the tokens after it wait in order behind it."""

from __future__ import annotations

import numpy as np

from common import wire
from common.protos.salience.v1 import salience_pb2 as pb


def covers(ranges: list[wire.PositionSpan], position: int) -> bool:
    return any(r.start <= position < r.end for r in ranges)


def readout_values(values: bytes) -> list[float]:
    """A readout as the worker sends it (little-endian float32) as the proto's floats."""
    return np.frombuffer(values, dtype="<f4").tolist()


class DecodedTokens:
    def __init__(self, readout_ranges: list[wire.PositionSpan]) -> None:
        self._ranges = readout_ranges
        self._queue: list[pb.Token] = []
        self._readouts: dict[int, bytes] = {}  # readouts that came before their token

    def add(self, token: pb.Token) -> list[pb.Token]:
        """A decoded token; the tokens ready to send, in order."""
        self._queue.append(token)
        return self._ready()

    def readout(self, position: int, values: bytes) -> list[pb.Token]:
        """The readout of a decoded position; the tokens ready to send, in order."""
        self._readouts[position] = values
        return self._ready()

    def waiting(self) -> list[int]:
        """The positions of held tokens still without their readout."""
        return [t.position for t in self._queue if covers(self._ranges, t.position) and t.position not in self._readouts]

    def _ready(self) -> list[pb.Token]:
        out = []
        while self._queue:
            token = self._queue[0]
            if covers(self._ranges, token.position):
                values = self._readouts.pop(token.position, None)
                if values is None:
                    break
                token.readout.extend(readout_values(values))
            out.append(self._queue.pop(0))
        return out
