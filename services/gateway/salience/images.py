"""Images attached to a Salience Generate call: checked against the served model's own processor.

The client writes each image's block (``<|vision_start|>``, N ``<|image_pad|>``, ``<|vision_end|>``)
into ``append_tokens`` and declares its range in an ``ImageAttachment``. Here each attachment is
decoded and run through the model's image processor, which gives the vision encoder's feature
count N for that image; the range must lie in the appended tokens, hold exactly that block, and
overlap no other, and no vision token may stand in the appended tokens outside a declared block.
Any mismatch is INVALID_ARGUMENT with a message naming the image and the problem. A text-only
model takes no images at all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from common import wire
from common.config import Settings
from common.model_source import resolve_model
from common.protos.salience.v1 import salience_pb2
from common.vision import VL_MODEL_TYPES, ImageDecodeError, VisionSpec, read_model_config


class ImageError(Exception):
    """An attachment the server refuses; ``code`` and ``message`` are the gRPC status to abort with."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class ImageSupport:
    """What the served model does with images: ``spec`` None means none (``refusal`` says why)."""

    model_name: str
    spec: VisionSpec | None
    max_image_bytes: int
    max_images: int
    refusal: str = ""

    @classmethod
    def load(cls, settings: Settings) -> ImageSupport:
        """Read the served model's config (the image processor loads with the first image); blocking."""
        directory = resolve_model(settings).directory
        config = read_model_config(directory)
        name = settings.served_model_name
        spec = VisionSpec.load(directory, settings.images.max_image_pixels)
        if spec is not None:
            refusal = ""
        elif config.get("vision_config") is not None:
            refusal = (f"the served model {name} is a {config.get('model_type')} vision-language model, whose "
                       f"images this server does not handle (supported: {', '.join(sorted(VL_MODEL_TYPES))})")
        else:
            refusal = f"the served model {name} is text-only: it takes no images"
        return cls(
            model_name=name,
            spec=spec,
            max_image_bytes=settings.images.max_image_bytes,
            max_images=settings.images.max_images_per_request,
            refusal=refusal,
        )


async def prepare_images(
    support: ImageSupport,
    tokens: Sequence[int],
    images: Sequence[salience_pb2.ImageAttachment],
    appended_from: int = 0,
) -> list[wire.ImageInput]:
    """Validate a Generate call's attachments; returns them as wire images, in position order.

    ``tokens`` is the session's whole token list after ``append_tokens`` is applied, and
    ``appended_from`` the index where the appended tokens begin. Raises :class:`ImageError`."""
    if images:  # decoding and processing images is CPU work: off the event loop
        return await asyncio.to_thread(_prepare, support, list(tokens), list(images), appended_from)
    check_unattached(support, tokens[appended_from:], appended_from)
    return []


def check_unattached(support: ImageSupport, append_tokens: Sequence[int], offset: int) -> None:
    """For a call without images: its appended tokens (placed from position ``offset``) must hold
    no vision token. Raises :class:`ImageError`."""
    if support.spec is not None:
        _check_stray_vision_tokens(support.spec, append_tokens, offset, [])


def _prepare(
    support: ImageSupport, tokens: list[int], images: list[salience_pb2.ImageAttachment], appended_from: int
) -> list[wire.ImageInput]:
    spec = support.spec
    if spec is None:
        raise ImageError(f"{support.refusal} ({len(images)} attached); send text tokens only")
    if len(images) > support.max_images:
        raise ImageError(f"{len(images)} images attached; at most {support.max_images} per call")
    order = sorted(range(len(images)), key=lambda i: images[i].pad_range_start)
    result: list[wire.ImageInput] = []
    previous: tuple[int, int, int] | None = None  # (index, start, end) of the block before
    for i in order:
        image = images[i]
        start, end = image.pad_range_start, image.pad_range_end
        name = f"images[{i}] (range [{start}, {end}))"
        if not appended_from <= start < end <= len(tokens):
            raise ImageError(
                f"{name}: the range must lie within this call's appended tokens, positions "
                f"[{appended_from}, {len(tokens)}) of the session after the append"
            )
        if previous is not None and start < previous[2]:
            raise ImageError(f"{name} overlaps images[{previous[0]}] (range [{previous[1]}, {previous[2]}))")
        previous = (i, start, end)
        if len(image.bytes) > support.max_image_bytes:
            raise ImageError(f"{name}: {len(image.bytes)} bytes, over the limit of {support.max_image_bytes}")
        if image.mime and not image.mime.startswith("image/"):
            raise ImageError(f"{name}: mime {image.mime!r} is not an image type")
        try:
            grid = spec.process(spec.decode(image.bytes)).grid_thw
        except ImageDecodeError as exc:
            raise ImageError(f"{name}: {exc}") from exc
        count = spec.feature_count(grid)
        if end - start != count + 2:
            raise ImageError(
                f"{name} spans {end - start} tokens, but the vision encoder makes {count} features of this image "
                f"(patch grid {grid[0]}x{grid[1]}x{grid[2]}, merged {spec.merge_size}x{spec.merge_size}): its block "
                f"must be <|vision_start|> + {count} x <|image_pad|> + <|vision_end|>, {count + 2} tokens"
            )
        problem = spec.block_problem(tokens, start, end)
        if problem is not None:
            raise ImageError(f"{name}: {problem}")
        result.append(wire.ImageInput(start=start, end=end, data=image.bytes, mime=image.mime))
    _check_stray_vision_tokens(spec, tokens[appended_from:], appended_from, result)
    return result


def _check_stray_vision_tokens(
    spec: VisionSpec, appended: Sequence[int], offset: int, blocks: list[wire.ImageInput]
) -> None:
    """Every vision token of ``appended`` (placed from position ``offset``) must lie in one of
    ``blocks`` (sorted by position)."""
    vision = {spec.vision_start_id: "<|vision_start|>", spec.vision_end_id: "<|vision_end|>",
              spec.image_pad_id: "<|image_pad|>"}
    covered = iter(blocks)
    block = next(covered, None)
    for i, token in enumerate(appended):
        if token not in vision:
            continue
        position = offset + i
        while block is not None and block.end <= position:
            block = next(covered, None)
        if block is None or position < block.start:
            raise ImageError(
                f"append_tokens holds {vision[token]} at position {position}, outside every attached "
                "image's range: each vision block needs a matching ImageAttachment"
            )
