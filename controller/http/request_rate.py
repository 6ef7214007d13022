"""The namespace tokens' API request rates (#36): a token bucket per token; a request over it waits its turn and,
past a few waiting, is answered 429 with Retry-After at once (API Priority and Fairness in spirit, kept simple).

Called by the API middleware (`middleware.py`) for scoped tokens only, after the token check and before the route reads
the body: never for the admin token, a token of every namespace, node credentials (the node protocol), the probes
or the web UI (its logins and sessions are `login_limit.py`'s). The rates are the namespaces' TenantPolicies' (`quotas.requestsPerSecond`,
`quotas.requestBurst`); the buckets are `login_limit._Buckets`. Next step: a weight per route (a list costs more).
"""
from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily

from rolloutd.crds.tenancy import RESTRICTED

from ..access.auth import ScopedToken
from ..errors import TooManyRequests
from ..access.tenancy import Policies
from .login_limit import _Buckets

# What a namespace without its own setting gets (TenantQuotas' defaults): 100 at once, then 50 a second. A trainer
# or kubectl makes a few calls a step (a watch or follow is one, when it opens); a UI page is not counted. On the
# 2-core machines of bench/ one API call holds the loop 1-3 ms, so a token at 50/s holds at most ~10% of it.
DEFAULT_RPS = RESTRICTED.quotas.requests_per_second
DEFAULT_BURST = RESTRICTED.quotas.request_burst
# Requests of one token that may wait for their turn at once; one more is 429 at once. A client that sends
# sequentially never has more than one waiting, so it is only slowed; a concurrent flood queues at most this many
# (each an open connection and a sleeping task, nothing more) and waits at most MAX_WAITING / rate seconds.
MAX_WAITING = 8


class RequestRates:
    """The buckets of the scoped tokens (keyed by token name) and how many of each token's requests wait now."""

    def __init__(self, policies: Policies, clock: Callable[[], float] = time.monotonic):
        self.policies, self.clock = policies, clock
        self.buckets = _Buckets(DEFAULT_BURST, 1 / DEFAULT_RPS, clock)
        self.waiting: dict[str, int] = {}
        self.delayed = self.refused = 0  # requests that waited their turn / were answered 429, since the start

    def rate(self, token: ScopedToken) -> tuple[int, float] | None:
        """(burst, requests per second) of `token`: its namespace's policy; a token of several namespaces is held to
        the smallest of theirs. None for a token of every namespace: no tenant's but the admin's own reach (the
        operator's in a Kubernetes cluster, a monitor's), not metered."""
        quotas = [self.policies.for_namespace(ns)[0].quotas for ns in token.namespaces]
        return (min(q.request_burst for q in quotas), min(q.requests_per_second for q in quotas)) if quotas else None

    def admit(self, token: ScopedToken) -> tuple[float, int]:
        """(seconds this request must wait for its turn, 0 now; Retry-After seconds when it is refused, else 0)."""
        if (rate := self.rate(token)) is None:
            return 0.0, 0
        key, (burst, rps) = token.name, rate
        refill = 1 / rps
        level = self.buckets.level(key, burst, refill)
        if level < 1 and self.waiting.get(key, 0) >= MAX_WAITING:
            self.refused += 1
            return 0.0, max(1, math.ceil((1 - level) * refill))  # when the queue has drained and a token is back
        return self.buckets.reserve(key, burst, refill), 0

    async def turn(self, token: ScopedToken) -> int:
        """Wait for `token`'s turn (asyncio.sleep: the loop serves others meanwhile). 0 once it may go on, else the
        Retry-After seconds of a 429 (its queue is full; nothing was waited)."""
        wait, retry_after = self.admit(token)
        if retry_after or wait <= 0:
            return retry_after
        key = token.name
        self.delayed += 1
        self.waiting[key] = self.waiting.get(key, 0) + 1
        try:
            await asyncio.sleep(wait)
        finally:
            left = self.waiting[key] - 1
            if left:
                self.waiting[key] = left
            else:
                del self.waiting[key]
        return 0

    async def refusal(self, token: ScopedToken) -> TooManyRequests | None:
        """`turn`, as the API answers it: None once the request may go on, else the 429 (Retry-After set)."""
        if not (retry_after := await self.turn(token)):
            return None
        err = TooManyRequests(f"token {token.name!r} is over its request rate (quotas.requestsPerSecond of its "
                              f"namespace's TenantPolicy) with {MAX_WAITING} requests waiting; retry in {retry_after} s")
        err.headers = {"Retry-After": str(retry_after)}
        return err

    def collect(self):  # /metrics (registered by `api.create_app`)
        yield CounterMetricFamily("rolloutd_api_requests_delayed", "Requests of namespace tokens that waited their "
                                  "turn: over quotas.requestsPerSecond", value=self.delayed)
        yield CounterMetricFamily("rolloutd_api_requests_rate_refused", "Requests of namespace tokens answered 429: "
                                  "over their request rate with MAX_WAITING of theirs already waiting",
                                  value=self.refused)
