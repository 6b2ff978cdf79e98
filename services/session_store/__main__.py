"""``python -m services.session_store``"""

import asyncio

from common.config import get_settings
from common.logging import configure_logging
from services.session_store.service import SessionStore


async def _run() -> None:
    await SessionStore(get_settings()).run()


def main() -> None:
    configure_logging("session_store", get_settings().log_level)
    asyncio.run(_run())


if __name__ == "__main__":
    main()
