"""The stall sampler (`controller/health/stalls.py`): a slice that holds the event loop is named by its function, with
the real lag probe (`looplag.LoopLag`) as its clock; a controller started with `$ROLLOUTD_STALL_SAMPLES` writes its
report there."""
from __future__ import annotations

import asyncio
import collections
import json
import threading
import time

from prometheus_client import CollectorRegistry

from rolloutd.controller.health.looplag import LoopLag
from rolloutd.controller.health.stalls import KEEP_LONGEST, LONGEST_SPAN, MOSTLY, StallSampler, _cause
from support.controller_process import ControllerProcess
from support.waiting import wait_until


def hold_the_loop() -> None:
    time.sleep(0.3)  # the stall under test: a synchronous slice on the loop, as a blocking call would be


def work_on_the_loop() -> None:
    end = time.thread_time() + 0.3  # 300 ms of the loop thread's own CPU
    while time.thread_time() < end:
        pass


def quick_step() -> None:
    sum(range(1000))


async def _scenario(path, hold=hold_the_loop) -> StallSampler:
    probe = LoopLag(CollectorRegistry())
    task = asyncio.create_task(probe.run())
    await asyncio.sleep(0.1)  # the probe ticks
    sampler = StallSampler(path, lambda: probe.ticked, threading.get_ident()).start()
    for _ in range(20):
        quick_step()
        await asyncio.sleep(0.01)
    hold()
    await asyncio.sleep(0.1)  # the probe ticks again: the stall is closed
    sampler.stop()
    task.cancel()
    return sampler


def test_a_slice_that_holds_the_loop_is_named_with_its_length(tmp_path):
    path = tmp_path / "stalls.json"
    asyncio.run(_scenario(path))
    report = json.loads(path.read_text())
    assert report["stalls"] >= 1
    assert report["longest_ms"] >= 250
    inclusive = report["inclusive_ms"]
    holder = next(f for f in inclusive if f.startswith("hold_the_loop "))
    assert inclusive[holder] >= 200  # most of the 300 ms (the first 20 ms are the threshold)
    assert not any(f.startswith("quick_step ") for f in inclusive)
    assert any(frame.startswith("hold_the_loop ") for frame in report["longest"][0]["stack"])
    assert report["longest"][0]["cause"] == "not running"  # a blocking call: the loop used no CPU meanwhile
    assert report["longest"][0]["loop_cpu_ms"] < 100


def test_a_stall_says_the_loop_spent_it_working(tmp_path):
    path = tmp_path / "stalls.json"
    asyncio.run(_scenario(path, work_on_the_loop))
    longest = json.loads(path.read_text())["longest"][0]
    assert any(frame.startswith("work_on_the_loop ") for frame in longest["stack"])
    assert longest["loop_cpu_ms"] >= 150 and longest["looks"] >= 1
    # "loop" when the loop thread had a core for most of the stall; a box too loaded to give it one (CI, two workers
    # and an engine on 2 cores: seen once) makes it "not running", and then its CPU was under MOSTLY of the stall
    assert longest["cause"] == "loop" or (longest["cause"] == "not running"
                                          and longest["loop_cpu_ms"] < MOSTLY * longest["ms"])
    assert abs(longest["at"] - time.time()) < 60  # when it began, wall clock: to match with the logs


def test_the_controller_reports_its_stalls_to_the_file_its_setting_names(tmp_path):
    path = tmp_path / "stalls.json"
    c = ControllerProcess(tmp_path / "data", env={"ROLLOUTD_STALL_SAMPLES": str(path)}).start()
    try:
        report = wait_until(lambda: path.exists() and json.loads(path.read_text()), 30, "the sampler's report")
        assert {"stalls", "stalled_ms", "inclusive_ms", "top_ms", "longest"} <= set(report)
    finally:
        c.stop()


def test_a_stall_is_the_thread_s_whose_cpu_covered_most_of_it():
    assert _cause(0.3, {"loop_cpu_ms": 290, "other_threads_cpu_ms": 0}) == "loop"
    assert _cause(0.3, {"loop_cpu_ms": 10, "other_threads_cpu_ms": 280}) == "other threads"
    assert _cause(1.0, {"loop_cpu_ms": 300, "other_threads_cpu_ms": 100}) == "not running"  # no core for the loop


def test_the_longest_stalls_are_those_of_the_last_span_not_the_start_up_s(tmp_path):
    """A start-up's long stall (the first fill) is counted but no longer listed once LONGEST_SPAN has passed: the
    list names a later window's own stalls, however much shorter (`bench scale` reads it at a window's end)."""
    sampler = StallSampler(tmp_path / "stalls.json", time.monotonic, threading.get_ident())
    now = time.time()
    sampler._close(1.5, 1.5, collections.Counter({("start_up (x.py:1)",): 1.5}),
                   {"at": now - LONGEST_SPAN - 5, "loop_cpu_ms": 1400.0, "other_threads_cpu_ms": 0.0, "looks": 9})
    for i in range(KEEP_LONGEST):
        sampler._close(0.1, 0.1, collections.Counter({(f"window_{i} (x.py:1)",): 0.1}),
                       {"at": now - 1, "loop_cpu_ms": 90.0, "other_threads_cpu_ms": 0.0, "looks": 2})
    report = sampler.report()
    assert report["stalls"] == KEEP_LONGEST + 1 and report["longest_ms"] == 1500.0
    assert len(report["longest"]) == KEEP_LONGEST
    assert all(x["stack"][0].startswith("window_") for x in report["longest"])
