"""The common entry point of the asyncio services: settings, JSON logging, then the service's loop."""

from __future__ import annotations

import asyncio
import ctypes
import gc
from collections.abc import Awaitable, Callable
from typing import Protocol

from common.config import Settings, get_settings
from common.logging import configure_logging


class Service(Protocol):
    def run(self) -> Awaitable[None]: ...


def run_service(name: str, factory: Callable[[Settings], Service], young_gc: bool = False) -> None:
    """Build the service inside the event loop (its sockets bind there) and run it until killed.
    ``young_gc``: collect the youngest generation every ``Settings.gc_young_threshold`` allocations
    (the scheduler, whose per-step objects it was measured on), else at Python's default. With the
    raised threshold in the session store and the controller runtime, a gateway's gRPC calls refused
    for a missing token came back as "Internal error from Core" (tests/e2e/test_admission.py); the
    cause is not known, so the threshold stays where it was measured to pay."""
    settings = get_settings()
    configure_logging(name, settings.log_level)

    async def main() -> None:
        service = factory(settings)
        release_freed_memory()
        freeze_startup_heap(settings.gc_young_threshold if young_gc else None)
        await service.run()

    try:  # uvloop's event loop cuts the per-message overhead of every hop (pyzmq supports it)
        import uvloop
    except ImportError:  # pragma: no cover - platforms without uvloop
        asyncio.run(main())
    else:
        uvloop.run(main())


def release_freed_memory() -> None:
    """Give the heap memory freed while starting (tokenizer files parsed, vocabulary tables built) back
    to the OS: glibc's allocator keeps it otherwise, and it counts in the process's RSS for good (30-40
    MB in a process holding a tokenizer). Does nothing where the C library has no ``malloc_trim``."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        return
    trim(0)


def freeze_startup_heap(young_threshold: int | None = None) -> None:
    """Move every object alive after start-up (modules, tokenizer tables, settings) out of the cyclic
    garbage collector's reach: they live as long as the process, and a full collection would walk
    them all again each time the per-request objects churned enough to trigger one. Then collect the
    youngest generation every ``young_threshold`` allocations (``Settings.gc_young_threshold``): the
    per-step objects (events, step entries) die young by reference counting, and collecting them every
    700 allocations, Python's default, costs more than the work that makes them. ``None`` keeps
    Python's threshold."""
    gc.collect()
    gc.freeze()
    if young_threshold is not None:
        _, older, oldest = gc.get_threshold()
        gc.set_threshold(young_threshold, older, oldest)
