"""Qwen3: Llama-shaped layers whose attention norms each query and key head (RMS norm over head_dim)
before the rotation. Its GGUF-block layers run op by op: the whole-layer op has no per-head norms."""

from __future__ import annotations

from functools import partial

from services.worker.models import llama
from services.worker.models.family import Family

FAMILY = Family(model_types=("qwen3",), build=partial(llama.build, qk_norms=True))
