"""Gemma 2: Gemma 3's layers (:mod:`services.worker.models.gemma3`) without the per-head q/k norms, one
rotary base for every layer, and its attention logits soft-capped (``attn_logit_softcapping``: that attention
runs as its own matmuls on torch's ops, as transformers' eager attention does it), its logits too."""

from __future__ import annotations

from functools import partial

from services.worker.models import gemma3
from services.worker.models.family import Family

FAMILY = Family(model_types=("gemma2",), build=partial(gemma3.build, qk_norms=False, rope_by_layer_type=False),
                unsupported=gemma3.unsupported)
