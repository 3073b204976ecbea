"""
Shared test settings: no stray SB3 log directories, a single torch thread (2 shared cores), and a real PostgreSQL
server for the distributed tests (``postgres_server``).
"""

import importlib.util
import os

import pytest
import torch as th

os.environ.setdefault("SB3_LOGDIR", os.path.join(os.environ.get("TMPDIR", "/tmp"), "sb3_kl_test_logs"))
th.set_num_threads(1)


def _ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def postgres_server():
    """
    A real PostgreSQL server for the session (``tests/postgres_server.py``), stopped at the end. Skipped, with the
    install command, where the server binaries or the driver are missing; in CI (``CI=true``) a missing driver or a
    server that does not start fails the tests instead of skipping them.
    """
    from postgres_server import INSTALL_HINT, PostgresServer, find_bindir

    if importlib.util.find_spec("psycopg") is None:
        message = 'the PostgreSQL driver is missing: pip install -e ".[postgres]"'
        if _ci():
            pytest.fail(message)
        pytest.skip(message)
    if find_bindir() is None:
        pytest.skip(INSTALL_HINT)
    server = PostgresServer()
    try:
        server.start()
    except Exception as e:  # the binaries are there, so a server that does not start is a failure, never a skip
        server.stop()
        pytest.fail(f"the PostgreSQL test server did not start: {e}")
    yield server
    server.stop()
