from __future__ import annotations

import asyncio
import inspect
import sys
from pathlib import Path

import pytest

from support.client_fake import FakeController, transport

from rolloutd.client import AsyncRolloutClient, Connection, RolloutClient  # noqa: E402

CONN = Connection("http://controller.test", "t0ken")


class Driver:
    """Calls a method of the sync or the async client and returns a plain value (async iterators
    and sync iterators are collected into lists), so one test checks both clients."""

    def __init__(self, kind: str, fake: FakeController):
        self.kind, self.fake = kind, fake
        if kind == "sync":
            self.client = RolloutClient(connection=CONN, transport=transport(fake))
        else:
            self.client = AsyncRolloutClient(connection=CONN, transport=transport(fake))
        self.client.retry_backoff = 0.0
        self.client.retry_for = 2.0  # a scripted failure is retried at once, for 2 s at most

    def __call__(self, method: str, *args, **kw):
        fn = getattr(self.client, method)
        if self.kind == "sync":
            out = fn(*args, **kw)
            return list(out) if inspect.isgenerator(out) else out

        async def go():
            out = fn(*args, **kw)
            if inspect.isasyncgen(out):
                return [x async for x in out]
            return await out
        return asyncio.run(go())


@pytest.fixture
def fake() -> FakeController:
    return FakeController()


@pytest.fixture(params=["sync", "async"])
def api(request, fake) -> Driver:
    return Driver(request.param, fake)

