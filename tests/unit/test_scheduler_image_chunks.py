"""The scheduler never ends a prompt chunk inside an image block, and sends each image with the
chunk that holds its block."""

from __future__ import annotations

from common import wire
from services.scheduler.requests import LiveRequest

IMAGES = [wire.ImageInput(start=5, end=71, data=b"a"), wire.ImageInput(start=80, end=100, data=b"b")]


def request(prompt_len: int = 120) -> LiveRequest:
    submit = wire.Submit(rid="r", prompt=wire.pack_tokens(range(prompt_len)), sampling=wire.SamplingParams(), max_tokens=4,
                         images=IMAGES)
    return LiveRequest(submit=submit, gateway=b"g", order=0, text=None, deadline=0.0)  # type: ignore[arg-type]


def chunks(live: LiveRequest, size: int) -> list[tuple[int, int, list[bytes]]]:
    """(start, end, image data) of each chunk the request is fed in."""
    out = []
    while live.fed < len(live.prompt):
        tokens, _ = live.next_chunk(size)
        out.append((live.fed, live.fed + len(tokens), [image.data for image in live.images_in(tokens)]))
        live.fed += len(tokens)
    return out


def test_chunks_stop_before_a_block_or_take_it_whole() -> None:
    assert chunks(request(), 48) == [
        (0, 5, []),  # would end inside the first block: stops before it
        (5, 71, [b"a"]),  # the block starts the chunk and is longer than it: taken whole
        (71, 119, [b"b"]),  # holds the second block whole
        (119, 120, []),
    ]
    assert chunks(request(), 16) == [(0, 5, []), (5, 71, [b"a"]), (71, 80, []), (80, 100, [b"b"]), (100, 116, []),
                                     (116, 120, [])]


def test_large_chunks_carry_every_image_they_hold() -> None:
    assert chunks(request(), 512) == [(0, 120, [b"a", b"b"])]
    assert chunks(request(), 75) == [(0, 75, [b"a"]), (75, 120, [b"b"])]


def test_no_images_no_change() -> None:
    live = request()
    live.submit.images = []
    assert chunks(live, 48) == [(0, 48, []), (48, 96, []), (96, 120, [])]
