"""How the trainer clients ride through a controller restart: which failures earn another try, and how long to
wait before it (exponential back-off with jitter, bounded by the client's `retry_for` and by the call's deadline).

Both clients (`sync`, `aio`) hold one `Retry` per call or stream and ask `after(error)` for the delay; the
next step is their `_do` / `_stream` loops.
"""
from __future__ import annotations

import logging
import ssl
import time

import httpx

from rolloutd.crds.kit.aiokit import Backoff

from .errors import ClientError, ConnectionFailed, unreachable

RETRY_FOR_SECONDS = 120.0  # the clients' default: a controller restart here takes ~10 s, an upgrade longer
# a stopping controller (503 + Retry-After), a proxy in front of one, and 429 + Retry-After: a token over its request
# rate with its queue full, or a watch quota (refused before any work, so even a POST is safe to send again; client-go
# retries it too)
RETRY_STATUS = frozenset({429, 502, 503, 504})
NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout)  # the request never reached the controller
INITIAL_DELAY, MAX_DELAY = 0.2, 5.0  # seconds

log = logging.getLogger("rolloutd.client")


class Retry:
    """The retries of one call (or one stream): `after(error)` is the delay before the next try, or raises the
    error when it is not worth retrying or the budget is spent; `ok()` after every success resets the budget.

    Retried: a request that never reached the controller (any call), a connection lost mid-answer or a torn line
    (idempotent calls and the resumable streams), and 429/502/503/504 answers. The budget is `retry_for` seconds from
    the first failure in a row (None: no limit), and never beyond `deadline` (a `time.monotonic()` instant)."""

    def __init__(self, server: str, retry_for: float | None, deadline: float | None = None,
                 initial: float = INITIAL_DELAY):
        self.server, self.retry_for, self.deadline = server, retry_for, deadline
        self.backoff = Backoff(initial=initial, maximum=MAX_DELAY)
        self.since: float | None = None

    def ok(self) -> None:
        self.since = None
        self.backoff.reset()

    def after(self, error: Exception, idempotent: bool = True, retry_after: str | None = None) -> float:
        now = time.monotonic()
        if self.since is None:
            self.since = now
        if self.retry_for == 0 or not retryable(error, idempotent):
            raise final(self.server, error, 0.0)
        delay = self.backoff.next()
        if retry_after and retry_after.strip().isdigit():
            delay = max(delay, float(retry_after))
        delay = min(delay, MAX_DELAY)
        end = None if self.retry_for is None else self.since + self.retry_for
        if self.deadline is not None:
            end = self.deadline if end is None else min(end, self.deadline)
        if end is not None and now + delay > end:
            raise final(self.server, error, now - self.since)
        log.warning("controller at %s: %s; retrying in %.1fs", self.server, describe(error), delay)
        return delay


def retryable(error: Exception, idempotent: bool) -> bool:
    if isinstance(error, ClientError):
        return error.code in RETRY_STATUS
    if refused_certificate(error):  # not a restart: every try would be refused the same way
        return False
    if isinstance(error, NOT_SENT):
        return True
    return idempotent and isinstance(error, (httpx.TransportError, ValueError))


def refused_certificate(error: BaseException) -> bool:
    """The TLS handshake failed because this client does not trust the controller's certificate (no CA file, the
    wrong one, another host's name): httpx raises it as a ConnectError caused by ssl's verification error."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        if isinstance(e, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(e):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def describe(error: Exception) -> str:
    return str(error) or type(error).__name__


def final(server: str, error: Exception, tried: float) -> Exception:
    """The error the caller gets once retrying ends (`ConnectionFailed` for a transport error)."""
    if isinstance(error, ClientError):
        return error
    if refused_certificate(error):
        return ConnectionFailed(f"the controller at {server} has a certificate this client does not trust: "
                                f"{describe(error)} (see ca_file= / ROLLOUTD_CA_FILE)")
    if tried <= 0:
        return unreachable(server, error)
    return ConnectionFailed(f"cannot reach the controller at {server} after retrying for {tried:.0f}s: "
                            f"{describe(error)} (see retry_for= / rolloutctl --retry-for)")
