"""The native model families, one file each, and the registry the engine asks for a runner.

A family file is a module of this package that defines ``FAMILY`` (a :class:`~services.worker.models.family.Family`):
the transformers ``model_type`` values it serves, a builder that makes a
:class:`~services.worker.models.paged.PagedModel` from the shared layers (:mod:`services.worker.layers`),
and which configurations it cannot serve. The registry finds every such module by itself: adding a
family is adding its file. A model type no family serves, or a configuration its family refuses, runs on
the transformers fallback (:mod:`services.worker.hf_fallback`), and the engine says why.
"""

from __future__ import annotations

import importlib
import pkgutil

from transformers import PretrainedConfig

from services.worker.models.family import Family


def _families() -> dict[str, Family]:
    found: dict[str, Family] = {}
    for module in pkgutil.iter_modules(__path__):
        family = getattr(importlib.import_module(f"{__name__}.{module.name}"), "FAMILY", None)
        if isinstance(family, Family):
            for model_type in family.model_types:
                assert model_type not in found, f"two families serve {model_type!r}"
                found[model_type] = family
    return found


FAMILIES = _families()


def family_of(config: PretrainedConfig) -> Family | None:
    return FAMILIES.get(config.model_type)


def unsupported_reason(config: PretrainedConfig, max_model_len: int) -> str | None:
    """Why the native forward cannot run this model (None: it can)."""
    family = family_of(config)
    if family is None:
        return f"model type {config.model_type!r} has no native forward (native: {', '.join(sorted(FAMILIES))})"
    return family.unsupported(config, max_model_len)
