"""Shared pytest configuration. Part-specific fixtures live in tests/<part>/conftest.py.

pytest imports test modules with --import-mode=importlib; the helpers every part shares are the package
tests/support (`from support.waiting import wait_until`), importable because pyproject's pytest settings
put tests/ on sys.path (`pythonpath`). tests/README.md says where a test goes. `store_location` runs a test once per store (SQLite, PostgreSQL).

`make test` runs the suite on two pytest-xdist workers: the tests that use a real engine, the Slurm
cluster or a whole job of processes form one group that runs in order on one worker (one engine, one cluster, and no
second job to compete with their timing); every other file is a group of its own, so its module fixtures and order hold."""
from __future__ import annotations

import pytest

SERIAL_FIXTURES = {"tiny_engine", "smollm2_engine", "engine_pool"}
SERIAL_FOLDERS = ("tests/e2e/", "tests/faults/", "tests/slurm/", "tests/rl/")
# files with a test that uses the session's engine or starts engines of its own (a test that asks for an engine fixture
# outside these is refused at collection), and files whose bounds (a CPU share, a build's time) are held to the clock
SERIAL_FILES = {
    "tests/agents/daemon/test_fit.py", "tests/agents/daemon/test_prefill_gate_engine.py",
    "tests/agents/daemon/test_token_share_engine.py", "tests/agents/daemon/test_work_share_engine.py",
    "tests/agents/test_engine_unit.py", "tests/agents/test_engine_vllm.py", "tests/agents/test_gateway.py",
    "tests/agents/test_gateway_budget.py", "tests/agents/test_gateway_engine.py", "tests/agents/test_gateway_harnesses.py",
    "tests/agents/test_gateway_policy.py", "tests/agents/test_gateway_tracing.py", "tests/agents/test_llm_stamps.py",
    "tests/agents/test_llm_vllm.py", "tests/agents/test_smollm2_rollout.py", "tests/controller/client/test_e2e_client.py",
    "tests/ui/test_first_token.py", "tests/tenancy/test_sandbox_tenant.py", "tests/tenancy/test_build_bounds.py",
}


def group_of(nodeid: str) -> str:
    """The worker group of a test: "serial", or its own file."""
    path = nodeid.split("::")[0]
    return "serial" if path.startswith(SERIAL_FOLDERS) or path in SERIAL_FILES else path


def pytest_collection_modifyitems(config, items):
    strays = sorted({item.nodeid.split("::")[0] for item in items
                     if SERIAL_FIXTURES & set(getattr(item, "fixturenames", ())) and group_of(item.nodeid) != "serial"})
    if strays:
        raise pytest.UsageError(f"tests/conftest.py: {', '.join(strays)} use(s) a real engine: add to SERIAL_FILES")


@pytest.hookimpl(optionalhook=True)  # xdist's hook: a run without pytest-xdist installed never calls it
def pytest_xdist_make_scheduler(config, log):
    """xdist's own `loadgroup` cannot rename a test's id under pytest 9, so the groups are the scheduler's scopes."""
    from xdist.scheduler import LoadScopeScheduling

    class Groups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return Groups(config, log)


@pytest.fixture(scope="session")
def pg_server():
    """The session's PostgreSQL server (tests/support/postgres.py), started on first use, stopped at the end."""
    from support.postgres import start_server

    server = start_server()
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_kind(request) -> str:
    return request.param


@pytest.fixture
def new_store_location(request, store_kind, tmp_path):
    """Makes a fresh store location of this run's kind: an SQLite file, or a new database on the session's server."""
    made = iter(range(1, 1000))

    def new():
        if store_kind == "sqlite":
            return tmp_path / f"rolloutd-{next(made)}.db"
        return request.getfixturevalue("pg_server").create_database()
    return new


@pytest.fixture
def store_location(new_store_location):
    """Where a test's store lives, once per store: an SQLite file, then a fresh database on the session's server."""
    return new_store_location()
