"""Login rate limits: failed token checks per client address, UI logins per principal (429 with Retry-After).
Its token buckets (`_Buckets`) also meter the namespace tokens' API requests (`request_rate.py`).

Used by the API middleware (`middleware.py`, an invalid bearer token) and the UI's login (`ui/app.py`). The token is
always checked first: a valid token is never refused for what others did from its address (see `LoginLimits`).
"""
from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable

FAILURES_BURST = 20  # failed checks an address may make at once ...
FAILURE_REFILL_SECONDS = 3.0  # ... and one more every 3 s after that (20 a minute)
LOGINS_BURST = 64  # UI logins a principal may make at once (twice its sessions' cap) ...
LOGIN_REFILL_SECONDS = 2.0  # ... and one more every 2 s after that
MAX_KEYS = 65_536  # buckets kept; beyond it the least recently used is dropped (memory stays bounded)


class _Buckets:
    """Token buckets by key, least recently used first; a full bucket is the same as no entry."""

    def __init__(self, burst: int, refill: float, clock: Callable[[], float]):
        self.burst, self.refill, self.clock = burst, refill, clock
        self._level: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, at)

    def _now(self, key: str, burst: int | None = None, refill: float | None = None) -> float:
        burst, refill = burst or self.burst, refill or self.refill
        tokens, at = self._level.get(key, (float(burst), 0.0))
        return min(float(burst), tokens + (self.clock() - at) / refill)

    def wait(self, key: str) -> int:
        """0 when `key` has a token left, else whole seconds until it has one (at least 1)."""
        tokens = self._now(key)
        return 0 if tokens >= 1 else max(1, math.ceil((1 - tokens) * self.refill))

    def take(self, key: str) -> None:
        self._put(key, max(0.0, self._now(key) - 1))

    def level(self, key: str, burst: int, refill: float) -> float:
        """The tokens `key` holds now under its own `burst` and `refill` (negative: that many turns promised)."""
        return self._now(key, burst, refill)

    def reserve(self, key: str, burst: int, refill: float) -> float:
        """Take one token even when none is left (the level goes below 0: the turns promised to requests waiting):
        the seconds until that token exists, 0 when there was one. `burst`, `refill`: this key's own."""
        tokens = self._now(key, burst, refill) - 1
        self._put(key, tokens)
        return max(0.0, -tokens * refill)

    def _put(self, key: str, tokens: float) -> None:
        self._level[key] = (tokens, self.clock())
        self._level.move_to_end(key)
        while len(self._level) > MAX_KEYS:
            self._level.popitem(last=False)


class LoginLimits:
    """Failures per client address and UI logins per principal.

    The choice: a failed check names no principal (the token is the only credential, so a wrong one belongs to
    nobody), so failures are counted per client address; an address past its budget gets 429 with Retry-After
    instead of 401 for each further failure. The token is checked before the limit is applied, so a valid token
    always passes: refusing unchecked would let anyone behind the same address (every client through `kubectl
    port-forward` or one proxy is the same address) lock the admin out for as long as they keep failing. What that
    gives up is slowing guesses, which buys nothing against 256-bit random tokens (`auth.py` mints them; a
    hand-written short admin token is not protected by this). Per principal, what is limited is successful UI logins
    (each makes a session): only a holder of that token can spend its budget, so no third party can."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.failures = _Buckets(FAILURES_BURST, FAILURE_REFILL_SECONDS, clock)
        self.logins = _Buckets(LOGINS_BURST, LOGIN_REFILL_SECONDS, clock)

    def failed(self, address: str | None) -> int:
        """Count one failed check from `address`: 0 when it is within its budget (answer 401), else the seconds
        to send in Retry-After with a 429."""
        key = address or "-"
        if wait := self.failures.wait(key):
            return wait
        self.failures.take(key)
        return 0

    def login(self, principal: str) -> int:
        """Count one successful UI login of `principal`: 0 when allowed, else the seconds for Retry-After."""
        if wait := self.logins.wait(principal):
            return wait
        self.logins.take(principal)
        return 0
