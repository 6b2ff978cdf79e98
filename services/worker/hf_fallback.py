"""The fallback runner for architectures without a native forward: the transformers model itself,
one sequence at a time, each with its own DynamicCache. Correct for any causal LM, but slower.

KV memory is still accounted in the engine's block tables, so capacity and pool-exhaustion
failures behave as with the paged runner. Prefix reuse is off (the tables name no blocks); forks
deep-copy the parent's cache and backtracks crop it.
"""

from __future__ import annotations

import copy

import torch
from transformers import DynamicCache, PreTrainedModel

from services.worker.runner import SeqInput


class HFFallback:
    """Implements :class:`services.worker.runner.Runner` with per-sequence transformers calls."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.caches: dict[int, DynamicCache] = {}

    def release(self, seq_id: int) -> None:
        self.caches.pop(seq_id, None)

    def fork(self, parent: int, child: int) -> None:
        """A deep copy of the parent's cache (the fallback shares nothing, forks cost memory)."""
        if parent in self.caches:
            self.caches[child] = copy.deepcopy(self.caches[parent])

    def truncate(self, seq_id: int, length: int) -> None:
        cache = self.caches.get(seq_id)
        if cache is not None:
            if length == 0:
                del self.caches[seq_id]
            elif length < cache.get_seq_length():
                cache.crop(length - cache.get_seq_length())  # a negative count: tokens to remove

    def model_inputs(self, item: SeqInput) -> dict[str, torch.Tensor]:
        """The model's inputs for one sequence's fed tokens (besides its cache)."""
        n = len(item.tokens)
        return {
            "input_ids": torch.tensor([item.tokens], device=self.device),
            "position_ids": torch.arange(item.start, item.start + n, device=self.device).unsqueeze(0),
        }

    def forward(self, inputs: list[SeqInput]) -> torch.Tensor:
        rows: list[torch.Tensor] = []
        for item in inputs:
            cache = self.caches.setdefault(item.seq_id, DynamicCache(config=self.model.config))
            out = self.model(**self.model_inputs(item), past_key_values=cache, use_cache=True, logits_to_keep=1)
            if item.logits:
                rows.append(out.logits[0, -1].float())
        if not rows:
            vocab = self.model.get_output_embeddings().weight.shape[0]
            return torch.empty(0, vocab, dtype=torch.float32, device=self.device)
        return torch.stack(rows)
