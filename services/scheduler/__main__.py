"""``python -m services.scheduler``"""

from common.service import run_service
from services.scheduler.service import Scheduler

if __name__ == "__main__":
    run_service("scheduler", Scheduler, young_gc=True)
