"""The fallback runner for architectures without a native forward: the transformers model itself,
one sequence at a time, each with its own DynamicCache. Correct for any causal LM, but slower.

KV memory is still accounted in the engine's block tables, so capacity and pool-exhaustion
failures behave as with the paged runner. Prefix reuse is off (the tables name no blocks); forks
deep-copy the parent's cache and backtracks crop it.

Captures (per-position logprobs, readouts and residuals) work as with the paged runner for decoders with
``layers`` and a final ``norm`` (Llama-like and vision-language text models): forward hooks on the
decoder layers keep the asked-about rows. The same hooks add a sequence's steering to each steered layer's
output (the residual stream after it), so any decoder with ``layers`` can be steered; one without
(``can_steer`` False) cannot, and the engine fails its steered sequences.
"""

from __future__ import annotations

import copy

import torch
from transformers import DynamicCache, PreTrainedModel

from services.worker.layers.steering import LayerAdds, plan_rows
from services.worker.runner import Captured, SeqInput
from services.worker.transfer import to_device


class HFFallback:
    """Implements :class:`services.worker.runner.Runner` with per-sequence transformers calls."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.caches: dict[int, DynamicCache] = {}
        decoder = model.get_decoder()
        layers, norm = getattr(decoder, "layers", None), getattr(decoder, "norm", None)
        self.can_capture = layers is not None and norm is not None
        self.can_steer = layers is not None
        self.tap_layers: frozenset[int] = frozenset()  # decoder layers whose hidden states captures keep
        self.captured: Captured | None = None  # the last forward's captures (None: none asked)
        self._recording: dict[int, torch.Tensor] | None = None  # layer -> output, while a capture runs
        self._adding: LayerAdds = {}  # what the running sequence's steering adds after each layer
        if layers is not None:
            self._norm = norm
            self._last = len(layers) - 1
            for index, layer in enumerate(layers):
                layer.register_forward_hook(self._tap(index))

    def _tap(self, index: int):
        def hook(module: torch.nn.Module, args: object, output: object) -> object:
            hidden = output[0] if isinstance(output, tuple) else output
            add = self._adding.get(index)
            if add is not None:
                hidden = hidden.clone()
                add.apply(hidden[0])  # a batch of one
                output = (hidden, *output[1:]) if isinstance(output, tuple) else hidden
            if self._recording is not None:
                self._recording[index] = hidden
            return output

        return hook

    def final_norm_of(self, h: torch.Tensor) -> torch.Tensor:
        return self._norm(h)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits of final hidden states (before the final norm)."""
        return self.model.get_output_embeddings()(self._norm(h)).float()

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
            "input_ids": to_device([item.tokens], self.device),
            "position_ids": torch.arange(item.start, item.start + n, device=self.device).unsqueeze(0),
        }

    def forward(self, inputs: list[SeqInput]) -> torch.Tensor:
        rows: list[torch.Tensor] = []
        kept: dict[int, list[torch.Tensor]] = {}  # layer -> captured rows per input
        tapped = self.tap_layers.union(*(item.layers for item in inputs))
        for item in inputs:
            cache = self.caches.setdefault(item.seq_id, DynamicCache(config=self.model.config))
            self._recording = {} if item.capture else None
            self._adding = plan_rows([item], [0], self.device)
            try:
                out = self.model(**self.model_inputs(item), past_key_values=cache, use_cache=True, logits_to_keep=1)
            finally:
                recorded, self._recording, self._adding = self._recording, None, {}
            if recorded:
                index = to_device([p - item.start for p in item.capture], self.device)
                for layer in tapped | {self._last}:
                    kept.setdefault(layer, []).append(recorded[layer][0, index])
            if item.logits:
                rows.append(out.logits[0, -1].float())
        self.captured = None
        if kept:
            final = torch.cat(kept[self._last])
            self.captured = Captured(final=final, layers={layer: torch.cat(kept[layer]) for layer in tapped})
        if not rows:
            vocab = self.model.get_output_embeddings().weight.shape[0]
            return torch.empty(0, vocab, dtype=torch.float32, device=self.device)
        return torch.stack(rows)
