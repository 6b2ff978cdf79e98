"""What a vision-language model makes of images: its vision token ids, and its own image processor.

The gateway uses it to check that a client's ``<|vision_start|> + <|image_pad|>×N + <|vision_end|>``
runs match the vision encoder's feature count N for each image; the worker uses it to turn the
same image bytes into the pixel values its encoder takes. Both read the served model's directory,
so they agree. Only transformers' Qwen2-VL family layout (``vision_start_token_id``,
``image_token_id``, a processor returning ``image_grid_thw``) is understood; any other model is
treated as text-only.

The facts come from the model's JSON files; the image processor is loaded on the first image.
transformers' image modules import torch whenever it is installed (even for the PIL backend), and
only the worker should carry torch: a gateway serving a text-only model never loads it, and one
serving a vision-language model loads it with its first image.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# Model types whose forward the worker's vision runner drives (3D rotary positions, encoder
# features scattered over the pad tokens).
VL_MODEL_TYPES = frozenset({"qwen2_vl"})


class ImageDecodeError(ValueError):
    """The bytes are not an image Pillow can read, the image is too large, or the model's
    processor refuses it."""


@dataclass(frozen=True)
class ProcessedImage:
    """One image as the encoder takes it: ``pixel_values`` ``[patches, channels*t*p*p]`` and its
    ``grid_thw`` (temporal, height, width patch counts)."""

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]


@dataclass(frozen=True)
class VisionSpec:
    """The image facts of one vision-language model."""

    model_type: str
    vision_start_id: int
    vision_end_id: int
    image_pad_id: int
    merge_size: int
    directory: Path  # where the model's image processor config lies
    max_pixels: int  # larger images are refused before decoding (settings.images.max_image_pixels)

    @classmethod
    def load(cls, directory: Path, max_pixels: int) -> VisionSpec | None:
        """The spec of the model in ``directory``, or None when the model is text-only or of a
        vision-language family the server does not drive."""
        config = read_model_config(directory)
        vision = config.get("vision_config")
        if vision is None or config.get("model_type") not in VL_MODEL_TYPES:
            return None
        preprocessor = directory / "preprocessor_config.json"
        image_config = json.loads(preprocessor.read_text()) if preprocessor.is_file() else {}
        return cls(
            model_type=config["model_type"],
            vision_start_id=int(config["vision_start_token_id"]),
            vision_end_id=int(config["vision_end_token_id"]),
            image_pad_id=int(config["image_token_id"]),
            merge_size=int(image_config.get("merge_size", vision.get("spatial_merge_size", 2))),
            directory=directory,
            max_pixels=max_pixels,
        )

    @cached_property
    def processor(self) -> Any:
        """transformers' image processor (PIL backend) for this model; the first use imports torch."""
        from transformers import AutoImageProcessor

        # The PIL backend: the torchvision one does not import beside the CPU build of torch.
        return AutoImageProcessor.from_pretrained(self.directory, backend="pil")

    def decode(self, data: bytes) -> Any:
        return decode_image(data, self.max_pixels)

    def process(self, image: Any) -> ProcessedImage:
        """Run the model's image processor over one decoded image."""
        try:
            out = self.processor(images=[image], return_tensors="pt")
        except ValueError as exc:  # e.g. an aspect ratio the processor refuses
            raise ImageDecodeError(f"the model's image processor refuses this image: {exc}") from exc
        t, h, w = (int(v) for v in out["image_grid_thw"][0])
        return ProcessedImage(pixel_values=out["pixel_values"], grid_thw=(t, h, w))

    def block_problem(self, tokens: Sequence[int], start: int, end: int) -> str | None:
        """Why ``tokens[start:end]`` is not a vision block (``<|vision_start|>``, one or more
        ``<|image_pad|>``, ``<|vision_end|>``); None when it is one."""
        if not 0 <= start < end <= len(tokens):
            return f"range [{start}, {end}) does not lie within the {len(tokens)} tokens of the session"
        if end - start < 3:
            return f"range [{start}, {end}) is too short for <|vision_start|>, pad tokens and <|vision_end|>"
        if tokens[start] != self.vision_start_id:
            return f"position {start} holds token {tokens[start]}, not <|vision_start|> ({self.vision_start_id})"
        if tokens[end - 1] != self.vision_end_id:
            return f"position {end - 1} holds token {tokens[end - 1]}, not <|vision_end|> ({self.vision_end_id})"
        for position in range(start + 1, end - 1):
            if tokens[position] != self.image_pad_id:
                return f"position {position} holds token {tokens[position]}, not <|image_pad|> ({self.image_pad_id})"
        return None

    def feature_count(self, grid_thw: tuple[int, int, int]) -> int:
        """How many ``<|image_pad|>`` tokens (encoder output features) an image of this grid becomes."""
        t, h, w = grid_thw
        return t * h * w // (self.merge_size**2)


def decode_image(data: bytes, max_pixels: int) -> Any:
    """Decode image bytes (any format Pillow reads) to an RGB ``PIL.Image``; refuses images with
    more than ``max_pixels`` pixels before decoding them (decompression bombs)."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ImageDecodeError("the image has no bytes")
    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
    except UnidentifiedImageError as exc:
        raise ImageDecodeError("the bytes are not a readable image (PNG, JPEG, WebP, GIF, ...)") from exc
    except Image.DecompressionBombError as exc:
        raise ImageDecodeError(f"the image is too large: {exc}") from exc
    width, height = image.size
    if width * height > max_pixels:
        raise ImageDecodeError(f"the image is {width}x{height} pixels, over the limit of {max_pixels}")
    try:
        image.load()
        return image.convert("RGB")
    except (OSError, ValueError, SyntaxError) as exc:  # truncated or corrupt data
        raise ImageDecodeError(f"the image could not be decoded: {exc}") from exc


def read_model_config(directory: Path) -> dict[str, Any]:
    """A model directory's config.json as plain data (transformers' config classes import torch); {} when it has
    none yet: the embedded GGUF model's (a text-only model) is written with its weights, by the worker's first
    load, which the other processes do not wait for (a local model directory without one is refused earlier)."""
    path = directory / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}
