"""``python -m services.scheduler``"""

import asyncio

from common.config import get_settings
from common.logging import configure_logging
from services.scheduler.service import Scheduler


async def _run() -> None:
    await Scheduler(get_settings()).run()


def main() -> None:
    configure_logging("scheduler", get_settings().log_level)
    asyncio.run(_run())


if __name__ == "__main__":
    main()
