"""The runner for vision-language models (transformers' Qwen2-VL family): the transformers fallback
with images and 3D rotary positions.

An image block in a sequence is ``<|vision_start|>``, N ``<|image_pad|>`` tokens and
``<|vision_end|>``. When a chunk holding blocks is computed, each image goes through the model's
own processor and vision encoder (``get_image_features``), and the encoder's N features replace
the pad tokens' embeddings; the chunk's positions come from the model's own ``get_rope_index``
(M-RoPE: an image's tokens take (t, h, w) grid positions, and text after it continues from the
largest of them). KV stays in the per-sequence cache as for any fallback model, so decoding goes on
after the image without seeing it again.

Text positions after an image are ``index + delta``; each sequence keeps the deltas at which they
change, so decode steps, forks and truncations position later tokens exactly as one forward
over the whole sequence would.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from common import wire
from common.vision import ImageDecodeError, ProcessedImage, VisionSpec
from services.worker.hf_fallback import HFFallback
from services.worker.runner import SeqInput
from services.worker.transfer import to_device


@dataclass(frozen=True)
class _Staged:
    """An image whose block is in the tokens the sequence's next forward computes."""

    start: int  # <|vision_start|>
    end: int  # one past <|vision_end|>
    image: ProcessedImage


class VisionFallback(HFFallback):
    """:class:`HFFallback` for a vision-language model (see the module docstring)."""

    def __init__(self, model: PreTrainedModel, spec: VisionSpec) -> None:
        super().__init__(model)
        self.spec = spec
        self.staged: dict[int, list[_Staged]] = {}
        # seq_id -> [(index, delta)], ascending: tokens at index >= that index sit at index + delta
        self.deltas: dict[int, list[tuple[int, int]]] = {}

    def stage_images(self, seq_id: int, tokens: list[int], start: int, images: list[wire.ImageInput]) -> None:
        """Check and preprocess the images of ``tokens`` (the whole sequence) whose pad tokens lie
        in the part its next forward computes, ``tokens[start:]``; images whose pads are before
        ``start`` are in the KV cache already. Raises ValueError (with the reason) for a pad run
        cut by ``start`` or a block that is not valid for its image."""
        staged: list[_Staged] = []
        for image in sorted(images, key=lambda im: im.start):
            if image.end - 1 <= start:
                continue  # its pad tokens are computed (a re-fed <|vision_end|> is text)
            where = f"image [{image.start}, {image.end})"
            if image.start + 1 < start:
                raise ValueError(f"{where} is split: its pad tokens before {start} were computed without it")
            if staged and image.start < staged[-1].end:
                raise ValueError(f"{where} overlaps image [{staged[-1].start}, {staged[-1].end})")
            problem = self.spec.block_problem(tokens, image.start, image.end)
            if problem is not None:
                raise ValueError(f"{where}: {problem}")
            try:
                processed = self.spec.process(self.spec.decode(image.data))
            except ImageDecodeError as exc:
                raise ValueError(f"{where}: {exc}") from exc
            count = self.spec.feature_count(processed.grid_thw)
            if count != image.end - image.start - 2:
                pads = image.end - image.start - 2
                raise ValueError(f"{where} holds {pads} pad tokens; the image has {count} features")
            staged.append(_Staged(start=image.start, end=image.end, image=processed))
        if staged:
            self.staged[seq_id] = staged
        else:
            self.staged.pop(seq_id, None)

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        self.staged.pop(seq_id, None)
        self.deltas.pop(seq_id, None)

    def fork(self, parent: int, child: int) -> None:
        super().fork(parent, child)
        if parent in self.deltas:
            self.deltas[child] = list(self.deltas[parent])

    def truncate(self, seq_id: int, length: int) -> None:
        super().truncate(seq_id, length)
        deltas = self.deltas.get(seq_id)
        if deltas is not None:
            # an entry at `length` still applies: it starts after a block that is kept whole
            del deltas[bisect.bisect_right(deltas, (length, float("inf"))) :]

    def _delta_at(self, seq_id: int, index: int) -> int:
        deltas = self.deltas.get(seq_id, [])
        i = bisect.bisect_right(deltas, (index, float("inf")))
        return deltas[i - 1][1] if i else 0

    def model_inputs(self, item: SeqInput) -> dict[str, torch.Tensor]:
        n = len(item.tokens)
        ids = to_device([item.tokens], self.device)
        offset = item.start + self._delta_at(item.seq_id, item.start)  # the position of the first fed token
        staged = self.staged.pop(item.seq_id, [])
        if not staged:
            positions = torch.arange(offset, offset + n, device=self.device).view(1, 1, n).expand(3, 1, n)
            return {"input_ids": ids, "position_ids": positions}

        kinds = torch.zeros(1, n, dtype=torch.int, device=self.device)  # mm_token_type_ids: 1 = image feature
        for block in staged:
            kinds[0, block.start + 1 - item.start : block.end - 1 - item.start] = 1
        grids = to_device([block.image.grid_thw for block in staged], self.device)
        inner = self.model.model  # Qwen2VLModel: the encoder and the rope index
        positions, _ = inner.get_rope_index(ids, mm_token_type_ids=kinds, image_grid_thw=grids)
        positions = positions + offset
        deltas = self.deltas.setdefault(item.seq_id, [])
        for block in staged:
            after = block.end - 1  # <|vision_end|>: text, positioned after the image's grid
            deltas.append((after, int(positions[0, 0, after - item.start]) - after))

        pixels = torch.cat([block.image.pixel_values for block in staged]).to(self.device)
        features = torch.cat(inner.get_image_features(pixels, grids).pooler_output)
        embeds = self.model.get_input_embeddings()(ids)
        embeds[kinds.bool()] = features.to(embeds.dtype)
        return {"inputs_embeds": embeds, "position_ids": positions}
