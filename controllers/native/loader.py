"""Resolve the operator's ``name -> "module:Class"`` map into NativeController subclasses."""

from __future__ import annotations

import importlib

from controllers.native.base import NativeController


class NativeLoadError(RuntimeError):
    pass


def load_native_controllers(mapping: dict[str, str]) -> dict[str, type[NativeController]]:
    classes: dict[str, type[NativeController]] = {}
    for name, target in mapping.items():
        module_name, _, class_name = target.partition(":")
        if not module_name or not class_name:
            raise NativeLoadError(f"native controller {name!r}: expected 'module:Class', got {target!r}")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as exc:
            raise NativeLoadError(f"native controller {name!r}: cannot load {target!r}: {exc}") from exc
        if not (isinstance(cls, type) and issubclass(cls, NativeController)):
            raise NativeLoadError(f"native controller {name!r}: {target!r} is not a NativeController subclass")
        classes[name] = cls
    return classes
