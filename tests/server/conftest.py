"""The server tests' session: the shared server (`test_server.shared_server`) is closed when the session ends, not at
interpreter exit. By then concurrent.futures' exit hook has shut down the pools of threads still running, and the
shared engine's background compiles (test_lifecycle warms it up "fast") stopped with a logged RuntimeError."""
from collections.abc import Iterator

import pytest
import test_server


@pytest.fixture(autouse=True, scope="session")
def _close_the_shared_server() -> Iterator[None]:
    yield
    if test_server.shared_server.cache_info().currsize:
        test_server.shared_server().close()
