"""The gateway's image checks (services/gateway/salience/images.py) with the real Qwen2-VL processor
of the tiny random model, and the text-only default model."""

from __future__ import annotations

import grpc
import pytest

from common.config import Images, Settings
from common.model_source import resolve_model
from common.protos.salience.v1.salience_pb2 import ImageAttachment
from services.gateway.salience.images import ImageError, ImageSupport, check_unattached, prepare_images
from tests.worker.test_vision import png


@pytest.fixture(scope="module")
def support() -> ImageSupport:
    return ImageSupport.load(Settings(model="random:qwen2-vl-tiny", served_model_name="tiny-vl"))


def run(support: ImageSupport, n: int) -> list[int]:
    assert support.spec is not None
    return [support.spec.vision_start_id] + [support.spec.image_pad_id] * n + [support.spec.vision_end_id]


def attach(data: bytes, start: int, end: int, mime: str = "image/png") -> ImageAttachment:
    return ImageAttachment(bytes=data, mime=mime, pad_range_start=start, pad_range_end=end)


async def refused(
    support: ImageSupport, tokens: list[int], images: list[ImageAttachment], appended_from: int = 0
) -> str:
    with pytest.raises(ImageError) as caught:
        await prepare_images(support, tokens, images, appended_from)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return caught.value.message


async def test_valid_blocks_become_wire_images(support: ImageSupport) -> None:
    old = [5, 6, 7]  # the session's tokens before this call
    wide = png(1, (280, 140))  # 10x20 patch grid: 50 features
    tokens = old + [8] + run(support, 64) + [9] + run(support, 50) + [10]
    images = [attach(wide, 71, 123), attach(png(0), 4, 70)]  # declared out of order
    result = await prepare_images(support, tokens, images, appended_from=3)
    assert [(i.start, i.end, i.data) for i in result] == [(4, 70, png(0)), (71, 123, wide)]
    assert all(i.mime == "image/png" for i in result)


async def test_no_images_and_no_vision_tokens_pass(support: ImageSupport) -> None:
    assert await prepare_images(support, [1, 2, 3], [], appended_from=1) == []


async def test_wrong_feature_count(support: ImageSupport) -> None:
    tokens = [1] + run(support, 63) + [2]
    message = await refused(support, tokens, [attach(png(0), 1, 66)])
    assert "images[0] (range [1, 66)) spans 65 tokens" in message
    assert "makes 64 features" in message and "66 tokens" in message


async def test_range_not_on_the_pad_run(support: ImageSupport) -> None:
    tokens = [1, 2] + run(support, 64) + [3]
    message = await refused(support, tokens, [attach(png(0), 1, 67)])  # right length, one position early
    assert "position 1 holds token 2, not <|vision_start|>" in message
    tokens = [1] + run(support, 64)[:-1] + [4, 5]  # the block's last token is not <|vision_end|>
    message = await refused(support, tokens, [attach(png(0), 1, 67)])
    assert "position 66 holds token 4, not <|vision_end|>" in message
    tokens = [1] + run(support, 64) + [2]
    tokens[30] = 7  # a hole in the pad run
    assert "position 30 holds token 7, not <|image_pad|>" in await refused(support, tokens, [attach(png(0), 1, 67)])


async def test_overlapping_ranges(support: ImageSupport) -> None:
    tokens = [1] + run(support, 64) + [2]
    message = await refused(support, tokens, [attach(png(0), 1, 67), attach(png(1), 1, 67)])
    assert "images[1] (range [1, 67)) overlaps images[0] (range [1, 67))" in message


async def test_out_of_bounds(support: ImageSupport) -> None:
    tokens = [1] + run(support, 64)[:-1]  # the block's end lies past the tokens
    message = await refused(support, tokens, [attach(png(0), 1, 67)])
    assert "must lie within this call's appended tokens, positions [0, 66)" in message
    tokens = [1] + run(support, 64) + [2]
    message = await refused(support, tokens, [attach(png(0), 1, 67)], appended_from=2)  # before this call's tokens
    assert "positions [2, 68)" in message
    assert "must lie within" in await refused(support, tokens, [attach(png(0), 5, 5)])  # empty range


async def test_vision_tokens_without_an_attachment(support: ImageSupport) -> None:
    tokens = [1] + run(support, 64) + [2]
    message = await refused(support, tokens, [], appended_from=0)
    assert "<|vision_start|> at position 1, outside every attached image's range" in message
    with pytest.raises(ImageError) as caught:
        check_unattached(support, tokens[-2:], 41)  # a call appending [<|vision_end|>, 2] at offset 41
    assert "append_tokens holds <|vision_end|> at position 41, outside" in caught.value.message
    check_unattached(support, [1, 2, 3], 41)
    stray = tokens + [support.spec.image_pad_id]  # type: ignore[union-attr]
    message = await refused(support, stray, [attach(png(0), 1, 67)])
    assert f"<|image_pad|> at position {len(tokens)}" in message


async def test_bad_bytes_mime_and_sizes(support: ImageSupport) -> None:
    tokens = [1] + run(support, 64) + [2]
    assert "not a readable image" in await refused(support, tokens, [attach(b"\x89PNG broken", 1, 67)])
    assert "has no bytes" in await refused(support, tokens, [attach(b"", 1, 67)])
    truncated = png(0)[: len(png(0)) // 2]
    assert "processor refuses this image: absolute aspect ratio" in await refused(
        support, tokens, [attach(png(0, (3000, 10)), 1, 67)]
    )
    assert "could not be decoded: image file is truncated" in await refused(support, tokens, [attach(truncated, 1, 67)])
    assert "is not an image type" in await refused(support, tokens, [attach(png(0), 1, 67, mime="text/plain")])
    settings = Settings(model="random:qwen2-vl-tiny", images=Images(max_image_pixels=100 * 100, max_image_bytes=10))
    small = ImageSupport.load(settings)
    assert "over the limit of 10" in await refused(small, tokens, [attach(png(0), 1, 67)])
    small = ImageSupport.load(Settings(model="random:qwen2-vl-tiny", images=Images(max_image_pixels=100 * 100)))
    assert "224x224 pixels, over the limit of 10000" in await refused(small, tokens, [attach(png(0), 1, 67)])
    one = ImageSupport.load(Settings(model="random:qwen2-vl-tiny", images=Images(max_images_per_request=1)))
    two = tokens + run(support, 64)
    message = await refused(one, two, [attach(png(0), 1, 67), attach(png(0), 68, 134)])
    assert "2 images attached; at most 1 per call" in message


async def test_text_only_model_refuses_every_image() -> None:
    text_only = ImageSupport.load(Settings(served_model_name="SmolLM2-135M-Instruct"))
    assert text_only.spec is None
    message = await refused(text_only, [1, 2, 3], [attach(png(0), 0, 3)])
    assert "the served model SmolLM2-135M-Instruct is text-only: it takes no images" in message
    assert await prepare_images(text_only, [1, 2, 3], [], appended_from=0) == []


async def test_the_default_model_is_text_only_before_the_worker_wrote_its_config(tmp_path) -> None:
    """On a fresh machine the gateway may start before the worker converted the embedded model's weights, which
    writes its config.json: the tokenizer the gateway converts is there, the config not yet."""
    settings = Settings(cache_dir=tmp_path, served_model_name="SmolLM2-135M-Instruct")
    support = ImageSupport.load(settings)
    directory = resolve_model(settings).directory
    assert (directory / "tokenizer.json").is_file() and not (directory / "config.json").exists()
    assert support.spec is None and "is text-only" in support.refusal


async def test_unsupported_vision_language_family_says_so(tmp_path) -> None:
    from transformers import Qwen2_5_VLConfig

    Qwen2_5_VLConfig().save_pretrained(tmp_path)
    other = ImageSupport.load(Settings(model=str(tmp_path), served_model_name="vl-other"))
    assert other.spec is None
    message = await refused(other, [1, 2, 3], [attach(png(0), 0, 3)])
    assert "vl-other is a qwen2_5_vl vision-language model, whose images this server does not handle" in message
