"""The event loop's health as metrics: how late a timer fires (its lag) and how long the garbage collector stops it.

The controller is one asyncio process: every node call, the operator and the web UI share one loop, and any
synchronous slice (a summary built, a thread holding the GIL the loop waits for, a garbage collection) delays every
call queued behind it. `LoopLag.run` (a task `server.py` starts) sleeps PERIOD seconds again and again and observes
how much later than asked it woke: with a short period the largest lag approaches the longest slice. Exposed on
/metrics (`api.create_app` makes one per app, on its registry):
    rolloutd_event_loop_lag_seconds              histogram of the lags (one sample every PERIOD)
    rolloutd_event_loop_lag_max_seconds          the largest lag of the last 2 × WINDOW seconds at most
    rolloutd_gc_pause_seconds{generation}        each cyclic garbage collection, start to end
The cost: PERIOD = 10 ms is a hundred timer wake-ups a second (~0.3 % of a core). `bench ui_live` reads them; the
web UI (`ui/live.py`) refreshes its pages less often while `recent_max` is high.
Next step: `stalls.py` names what a long lag ran (a diagnostic, off by default); a per-route view of the lags.
"""
from __future__ import annotations

import asyncio
import gc
import threading
import time

from prometheus_client import CollectorRegistry, Gauge, Histogram

PERIOD = 0.010
WINDOW = 5.0
BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class LoopLag:
    """The lag probe and the garbage collector's pauses, observed into `registry`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.lag = Histogram("rolloutd_event_loop_lag_seconds", "How much later than asked a timer of the event loop "
                             f"fired (sampled every {PERIOD * 1e3:.0f} ms)", buckets=BUCKETS, registry=registry)
        self.max = Gauge("rolloutd_event_loop_lag_max_seconds", "The largest event loop lag of the last "
                         f"{WINDOW:.0f} to {2 * WINDOW:.0f} seconds", registry=registry)
        self.gc = Histogram("rolloutd_gc_pause_seconds", "Cyclic garbage collections, start to end",
                            ["generation"], buckets=BUCKETS, registry=registry)
        self._windows = [0.0, 0.0]  # the largest lag of the previous WINDOW and of the current one
        self._gc_start = 0.0
        self.ticked = time.monotonic()  # the probe's last wake (`stalls.StallSampler` watches it)
        self.thread_id = threading.get_ident()  # the loop's thread, once `run` runs

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        turn = loop.time() + WINDOW
        self.thread_id = threading.get_ident()
        gc.callbacks.append(self._on_gc)
        try:
            while True:
                asked = loop.time() + PERIOD
                await asyncio.sleep(PERIOD)
                now = loop.time()
                self.ticked = time.monotonic()
                late = max(0.0, now - asked)
                self.lag.observe(late)
                if now >= turn:
                    self._windows, turn = [self._windows[1], 0.0], now + WINDOW
                self._windows[1] = max(self._windows[1], late)
                self.max.set(max(self._windows))
        finally:
            gc.callbacks.remove(self._on_gc)

    def recent_max(self) -> float:
        """The largest lag of the last WINDOW to 2 × WINDOW seconds (0 before the probe runs): the web UI's `busy`."""
        return max(self._windows)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start:
            self.gc.labels(str(info.get("generation", "?"))).observe(time.perf_counter() - self._gc_start)
