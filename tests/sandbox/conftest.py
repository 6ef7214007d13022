"""Fixtures for the sandbox tests: real bwrap, real bash, real kernels.

Sandboxes are asyncio objects; pytest here has no asyncio plugin, so one event
loop runs in a background thread for the whole session and `run(coro)`
executes a coroutine on it. Module-scoped sandboxes (one per test module)
keep the suite fast: a sandbox starts in ~50 ms, a kernel in ~1 s.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, Callable, TypeVar

import pytest

from support.sandbox_checks import require_bwrap

from rolloutd.sandbox import Sandbox, SandboxLimits, SandboxSpec, get_runtime

T = TypeVar("T")


@pytest.fixture(scope="session")
def run() -> Callable[..., Any]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="sandbox-tests-loop", daemon=True)
    thread.start()

    def _run(coro: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    yield _run
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def spec_of(**fields: Any) -> SandboxSpec:
    """A spec from flat fields: `SandboxLimits`' (memory_mb, wall_seconds, ...) go to its ``limits``."""
    limits = {k: fields.pop(k) for k in list(fields) if k in SandboxLimits.model_fields}
    return SandboxSpec(limits=limits, **fields)


@pytest.fixture
def make_sandbox(run):
    """Create sandboxes from specs; every one is closed at the end of the test."""
    require_bwrap()
    made: list[Sandbox] = []

    def _make(**fields: Any) -> Sandbox:
        spec = spec_of(**fields)
        sb = run(get_runtime(spec.runtime).create(spec))
        made.append(sb)
        return sb

    yield _make
    for sb in made:
        run(sb.close())


@pytest.fixture(scope="module")
def sandbox(run):
    """One default bwrap sandbox shared by a module's tests."""
    require_bwrap()
    sb = run(get_runtime("bwrap").create(SandboxSpec()))
    yield sb
    run(sb.close())
