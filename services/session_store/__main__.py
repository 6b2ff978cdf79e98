"""``python -m services.session_store``"""

from common.service import run_service
from services.session_store.service import SessionStore

if __name__ == "__main__":
    run_service("session_store", SessionStore)
