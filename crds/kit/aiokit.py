"""Small waiting kits shared by the node side and the controller: one back-off, one wait-with-timeout.

Imports nothing of rolloutd, so the controller may use it (tests/test_structure.py allows it).
Callers: the node daemon's retries, the executors' restart and resubmit delays, the trainer clients.
"""
from __future__ import annotations

import asyncio
import random


def backoff_delay(failures: int, *, initial: float = 1.0, maximum: float = 30.0, factor: float = 2.0,
                  free: int = 0) -> float:
    """The delay before retry number `failures` (1 = after the first failure), without jitter.

    The first `free` failures retry at once; after that the delay starts at `initial` and grows by
    `factor` up to `maximum`. Deterministic, for callers that keep the failure count themselves.
    """
    paid = failures - free
    if paid <= 0:
        return 0.0
    return min(initial * factor ** (paid - 1), maximum)


class Backoff:
    """Exponential back-off with jitter: `next()` gives the next delay, `reset()` after a success."""

    def __init__(self, initial: float = 0.1, maximum: float = 5.0, factor: float = 2.0,
                 jitter: float = 0.25) -> None:
        self.initial, self.maximum, self.factor, self.jitter = initial, maximum, factor, jitter
        self.failures = 0

    def next(self) -> float:
        self.failures += 1
        delay = backoff_delay(self.failures, initial=self.initial, maximum=self.maximum, factor=self.factor)
        return delay * (1.0 - self.jitter + random.random() * 2 * self.jitter)

    def reset(self) -> None:
        self.failures = 0


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait until `event` is set or `timeout` seconds pass; True when it was set. Never raises on timeout."""
    if event.is_set():
        return True
    if timeout is not None and timeout <= 0:
        return False
    try:
        # not `asyncio.wait_for`: on 3.11 it can swallow a cancellation that arrives as the event
        # fires, and a loop that calls this would never stop
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        return False
    return True
