"""``python -m services.worker``: load the model and serve steps for the scheduler."""

from __future__ import annotations

import structlog

from common.config import get_settings
from common.logging import configure_logging
from services.worker.threads import apply_cpu_threads


def main() -> None:
    settings = get_settings()
    threads = apply_cpu_threads(settings)  # before anything imports torch
    from services.worker.service import WorkerService

    log = configure_logging("worker", settings.log_level)
    structlog.contextvars.bind_contextvars(service="worker")  # for module loggers too
    log.info("worker.cpu_threads", threads=threads)
    WorkerService(settings, log, threads).run()


if __name__ == "__main__":
    main()
