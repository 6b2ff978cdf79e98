"""``python -m services.controller_runtime``"""

from common.service import run_service
from services.controller_runtime.service import ControllerRuntime

if __name__ == "__main__":
    run_service("controller_runtime", ControllerRuntime)
