"""Concept readouts (Salience): per-position projections of chosen layers' hidden states.

The default concepts are words read out by the *logit lens*: a layer's hidden state, put through
the model's final norm, projected onto the unembedding row of the word's first token. A concepts
file (JSON ``{"concepts": {name: [hidden_size floats]}}``) replaces the words with its own vectors,
applied the same way (after the final norm). A position's readout is float32
``[len(layers)][len(concepts)]``, row-major.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from common.config import Sessions
from services.worker.transfer import to_device


def default_layers(num_layers: int) -> list[int]:
    """Four evenly spaced decoder layers, the last one included."""
    return sorted({max(round(num_layers * k / 4) - 1, 0) for k in range(1, 5)})


@dataclass
class Readouts:
    concepts: list[str]
    layers: list[int]
    matrix: torch.Tensor  # [concepts, hidden], in the activations' dtype and on the model's device

    @classmethod
    def build(
        cls,
        config: Sessions,
        *,
        num_layers: int,
        unembedding: torch.Tensor,
        tokenizer: PreTrainedTokenizerBase,
        dtype: torch.dtype,
    ) -> Readouts:
        """Readouts from the settings; raises ValueError on a bad layer, word or concepts file."""
        layers = sorted(set(config.readout_layers)) if config.readout_layers else default_layers(num_layers)
        bad = [layer for layer in layers if not 0 <= layer < num_layers]
        if bad:
            raise ValueError(f"readout layers {bad} are outside the model's {num_layers} decoder layers")
        if config.concepts_file is not None:
            names, matrix = _load_concepts(config.concepts_file, unembedding.shape[1])
        else:
            names = list(config.readout_concepts)
            rows = []
            for word in names:
                ids = tokenizer.encode(word, add_special_tokens=False)
                if not ids:
                    raise ValueError(f"readout concept {word!r} encodes to no token")
                rows.append(ids[0])
            matrix = unembedding[to_device(rows, unembedding.device)]
        return cls(concepts=names, layers=layers, matrix=matrix.to(unembedding.device, dtype))

    def project(self, hidden: Sequence[torch.Tensor], final_norm: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``hidden[i]``: ``[positions, hidden]`` after layer ``self.layers[i]`` ->
        float32 ``[positions, layers, concepts]``."""
        return torch.stack([(final_norm(h) @ self.matrix.T).float() for h in hidden], dim=1)


def _load_concepts(path: Path, hidden_size: int) -> tuple[list[str], torch.Tensor]:
    try:
        concepts = json.loads(Path(path).read_text())["concepts"]
        names = list(concepts)
        matrix = torch.tensor([concepts[n] for n in names], dtype=torch.float32)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"cannot read the concepts file {path}: {exc}") from exc
    if not names or matrix.shape != (len(names), hidden_size):
        raise ValueError(f"the concepts file {path} must map names to {hidden_size} floats each")
    return names, matrix
