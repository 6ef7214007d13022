"""Waiting on a condition with a deadline, for every test folder: poll, never sleep-and-hope."""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

# `alive(pid)`, for the tests that wait on a process: defined beside the stand-ins (support.sim imports nothing else
# of support/, so the one definition lives there)
from support.sim import alive  # noqa: F401


def _check(predicate: Callable[[], Any], deadline: float, timeout: float, what: str) -> Any:
    value = predicate()
    if not value and time.monotonic() > deadline:
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")
    return value


def wait_until(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition",
               every: float = 0.005) -> Any:
    """Poll `predicate()` every `every` s until it is truthy (returned), or fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not (value := _check(predicate, deadline, timeout, what)):
        time.sleep(every)
    return value


async def until(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """`wait_until` inside an event loop: other tasks run between the polls."""
    deadline = time.monotonic() + timeout
    while not (value := _check(predicate, deadline, timeout, what)):
        await asyncio.sleep(0.01)
    return value
