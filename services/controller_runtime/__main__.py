"""``python -m services.controller_runtime``"""

import asyncio

from common.config import get_settings
from common.logging import configure_logging
from services.controller_runtime.service import ControllerRuntime


async def _run() -> None:
    await ControllerRuntime(get_settings()).run()


def main() -> None:
    configure_logging("controller_runtime", get_settings().log_level)
    asyncio.run(_run())


if __name__ == "__main__":
    main()
