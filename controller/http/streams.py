"""Every long-lived answer of a scoped token — a watch, `trajectories?follow`, `batches/{k}?wait`, `logs?follow`,
the web UI's live pages — holds one of its namespace's watch slots (quotas.watches), ends at a server-side deadline
and ends soon after its token is revoked.

Called by the routes that stream or long-poll (`kube/rolloutjobs.py`, `http/trainer.py`, `http/logs.py`,
`ui/app.py`) through the root's `Streams`; the counts are `tenancy.Policies`'. The admin's streams are not counted.
"""
from __future__ import annotations

import asyncio
import time
import weakref
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from rolloutd.crds.tenancy import RESTRICTED

from ..access.auth import ScopedToken, TokenBook
from ..errors import TooManyRequests
from ..kube.admit import scoped_token
from ..access.tenancy import Policies, describe

STREAM_MAX_SECONDS = 3600.0  # a scoped token's stream ends after this long whatever it asked (clients reconnect)
CHECK_SECONDS = 5.0  # how often an idle stream looks whether its token is still valid
T = TypeVar("T")


class Slot:
    """One taken watch slot of a namespace: given back once (`release`), however the stream ends."""

    def __init__(self, policies: Policies, token: ScopedToken, namespace: str | None,
                 still_valid: Callable[[], bool]):
        if namespace is None and len(token.namespaces) == 1:  # a UI page of a one-namespace token
            namespace = token.namespaces[0]
        self.key = namespace or ""
        policy, name = policies.for_namespace(self.key) if self.key else (RESTRICTED, None)
        open_now = policies.take_watch(self.key, policy.quotas.watches)
        if open_now is not None:
            raise TooManyRequests(
                f"namespace {self.key or '(all)'!r} has {open_now} open watches and streams, its quota "
                f"(quotas.watches) is {policy.quotas.watches} ({describe(name)}); close one or ask the admin for "
                "more", causes=[{"field": "watch", "reason": "FieldValueForbidden", "message": "over quota"}])
        self.still_valid = still_valid
        self.deadline = time.monotonic() + STREAM_MAX_SECONDS
        self.release = weakref.finalize(self, policies.give_back_watch, self.key)

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline or not self.still_valid()


class Streams:
    """The watch slots of the scoped tokens' streams: their namespaces' quotas (`policies`), ended once their token
    is no longer in `tokens` (revoked)."""

    def __init__(self, policies: Policies, tokens: TokenBook) -> None:
        self.policies, self.tokens = policies, tokens

    def take(self, request: Request, namespace: str | None) -> Slot | None:
        """A slot for the request's scoped token (429 past the quota); None for the admin."""
        token = scoped_token(request)
        if token is None:
            return None
        return Slot(self.policies, token, namespace, lambda: self.tokens.find(f"Bearer {token.token}") is not None)

    def take_for(self, token: ScopedToken | None, namespace: str | None,
                 still_valid: Callable[[], bool]) -> Slot | None:
        """A slot for a web UI stream of a scoped token's session (None for the admin's)."""
        return None if token is None else Slot(self.policies, token, namespace, still_valid)


async def _guarded(inner: AsyncIterator[bytes], slot: Slot) -> AsyncIterator[bytes]:
    """`inner`'s chunks until it ends, its deadline passes or its token is revoked (checked while it idles too)."""
    nxt: asyncio.Future | None = None
    try:
        while not slot.expired():
            if nxt is None:
                nxt = asyncio.ensure_future(inner.__anext__())
            done, _ = await asyncio.wait({nxt}, timeout=CHECK_SECONDS)
            if not done:
                continue
            try:
                chunk = nxt.result()
            except StopAsyncIteration:
                return
            nxt = None
            yield chunk
    finally:
        if nxt is not None:
            nxt.cancel()
            await asyncio.gather(nxt, return_exceptions=True)
        aclose = getattr(inner, "aclose", None)
        if aclose is not None:
            try:
                await aclose()
            except RuntimeError:  # still running in the cancelled step: it ends with it
                pass
        slot.release()


def guard(slot: Slot | None, response: StreamingResponse) -> StreamingResponse:
    """`response` bounded by `slot` (as it is for the admin's None)."""
    if slot is not None:
        response.body_iterator = _guarded(response.body_iterator, slot)
    return response


async def long_poll(slot: Slot | None, answer: Awaitable[T]) -> T:
    """`answer` awaited while holding `slot` (given back when it is done, whichever way)."""
    try:
        return await answer
    finally:
        if slot is not None:
            slot.release()

