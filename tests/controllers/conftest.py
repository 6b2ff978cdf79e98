from pathlib import Path

import pytest

from controllers import build
from tests.controllers.driver import Host

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def host() -> Host:
    return Host()


@pytest.fixture(scope="session")
def sdk_test_wasm(have_clang, tmp_path_factory) -> bytes:
    """The SDK test module (tests/controllers/sdk_test.c linked with the SDK), built fresh."""
    return build.build_one(HERE / "sdk_test.c", tmp_path_factory.mktemp("sdk_test")).read_bytes()
