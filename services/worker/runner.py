"""What a forward-pass backend takes and gives: the engine talks to either implementation through it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from services.worker.layers.steering import Deltas


@dataclass(frozen=True)
class SeqInput:
    """Feed ``tokens`` to ``seq_id`` at positions ``start ..``; ``logits``: return the logits of
    its last token. The engine has already reserved KV blocks for ``start + len(tokens)`` tokens.
    ``capture``: positions (among those fed) whose hidden states the runner keeps in ``captured``, after the
    runner's own tapped layers and after ``layers`` too. ``steering``: what the sequence adds to the residual
    stream after each layer (:mod:`services.worker.layers.steering`), positions before ``output_start``
    being its prompt's."""

    seq_id: int
    tokens: list[int]
    start: int
    logits: bool
    capture: tuple[int, ...] = ()
    layers: tuple[int, ...] = ()
    steering: Deltas | None = None
    output_start: int = 0


@dataclass(frozen=True)
class Captured:
    """Hidden states of the captured positions of a forward pass, rows in input order then
    ``capture`` order: ``final`` after the last decoder layer (before the final norm), ``layers``
    after each tapped decoder layer."""

    final: torch.Tensor
    layers: dict[int, torch.Tensor]


class Runner(Protocol):
    def forward(self, inputs: list[SeqInput]) -> torch.Tensor:
        """Run one batched forward pass; float32 logits ``[n, vocab]``, one row per input with
        ``logits`` set, in input order."""
        ...

    def release(self, seq_id: int) -> None:
        """Drop whatever the backend keeps for a sequence besides its KV blocks."""
        ...

    def fork(self, parent: int, child: int) -> None:
        """Give ``child`` (new) a copy of what the backend keeps for ``parent`` besides KV blocks."""
        ...

    def truncate(self, seq_id: int, length: int) -> None:
        """Keep only the first ``length`` tokens of what the backend keeps for a sequence."""
        ...
