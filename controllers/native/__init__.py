"""Trusted native (Python) controllers: same callbacks and host facilities as Wasm controllers, loaded
by the operator from ``settings.controllers.native`` and instantiated as module id ``native:<name>``."""

from controllers.native.base import Host, NativeController
from controllers.native.loader import NativeLoadError, load_native_controllers

__all__ = ["Host", "NativeController", "NativeLoadError", "load_native_controllers"]
