"""The event loop lag probe (`controller/health/looplag.py`) on a real controller: its samples reach /metrics, and a
stall of the whole process (SIGSTOP, then SIGCONT: no line of the loop runs meanwhile) shows as a lag at least as long."""
from __future__ import annotations

import os
import signal
import time

from prometheus_client.parser import text_string_to_metric_families

from support.waiting import wait_until

STALL = 0.4


def read(api) -> dict[tuple[str, str | None], float]:
    out = {}
    for fam in text_string_to_metric_families(api.get("/metrics").text):
        for s in fam.samples:
            if s.name.startswith("rolloutd_event_loop_lag"):
                out[(s.name, s.labels.get("le"))] = s.value
    return out


def test_the_loop_lag_is_sampled_and_a_stopped_process_shows_as_a_lag_as_long(controller, api):
    first = read(api)
    assert ("rolloutd_event_loop_lag_max_seconds", None) in first
    count = ("rolloutd_event_loop_lag_seconds_count", None)
    wait_until(lambda: read(api)[count] > first[count] + 10, 30, "the probe's samples")
    before = read(api)
    over = lambda m: m[count] - m[("rolloutd_event_loop_lag_seconds_bucket", "0.2")]  # noqa: E731 - lags > 200 ms

    os.kill(controller.proc.pid, signal.SIGSTOP)
    time.sleep(STALL)  # the stall itself, not a wait for the product: nothing of it runs meanwhile
    os.kill(controller.proc.pid, signal.SIGCONT)

    after = wait_until(lambda: (m := read(api))[count] > before[count] and m, 30, "a sample after the stall")
    assert over(after) >= over(before) + 1
    assert after[("rolloutd_event_loop_lag_max_seconds", None)] >= STALL - 0.02
