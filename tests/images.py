"""Test images: deterministic random PNGs."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def png(seed: int, size: tuple[int, int] = (224, 224)) -> bytes:
    """A ``size`` (width, height) PNG of random pixels, the same for the same seed."""
    pixels = np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()
