"""The trainer client through a real controller restart mid-call (SIGTERM, then kill -9): a batch long poll,
a trajectory follow stream and a watch ride through, resume where they were, and never see a 500. The
controller runs without executors (the job stays Pending), so every call is still waiting when it stops."""
from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest
from support.controller_process import ControllerProcess
from support.example_job import example_doc

from rolloutd.client import NotFound, RolloutClient


class Recorder:
    """Every answer the client saw (status codes by path) and the transport errors, from httpx's hooks."""

    def __init__(self, rc: RolloutClient):
        self.codes: list[tuple[str, int]] = []
        self.sent: list[str] = []
        rc.http.event_hooks["request"].append(lambda r: self.sent.append(r.url.path))
        rc.http.event_hooks["response"].append(lambda r: self.codes.append((r.url.path, r.status_code)))

    def asked(self, part: str) -> int:
        return sum(1 for p in self.sent if p.endswith(part))

    def until(self, what, limit: float = 30.0) -> None:
        end = time.monotonic() + limit
        while not what():
            assert time.monotonic() < end, "condition not reached"
            time.sleep(0.02)


class Background:
    def __init__(self, fn):
        self.result, self.error = None, None
        self.thread = threading.Thread(target=self.run, args=(fn,), daemon=True)
        self.thread.start()

    def run(self, fn):
        try:
            self.result = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            self.error = e

    def join(self):
        self.thread.join(60)
        assert not self.thread.is_alive()
        return self


@pytest.fixture
def controller(tmp_path):
    c = ControllerProcess(tmp_path / "data").start()
    yield c
    c.stop()


def test_long_polls_and_streams_ride_through_sigterm_and_kill(controller):
    doc = example_doc()
    doc["metadata"]["name"] = "restarted"
    doc["spec"]["batches"] = {"groups": 1}
    rc = RolloutClient(controller.url, token=controller.token, retry_for=60)
    rec = Recorder(rc)
    rc.apply(doc)
    batch = Background(lambda: rc.next_batch("restarted", timeout=600))
    follow_rc = RolloutClient(controller.url, token=controller.token, retry_for=60)
    frec = Recorder(follow_rc)
    follow = Background(lambda: list(follow_rc.trajectories("restarted", follow=True)))
    watch_rc = RolloutClient(controller.url, token=controller.token, retry_for=60)
    wrec = Recorder(watch_rc)
    watched: list[tuple[str, str]] = []

    def watch():
        for type_, obj, _ in watch_rc.watch("restarted"):
            watched.append((type_, (obj["metadata"].get("labels") or {}).get("step", "")))
            if type_ == "DELETED":
                return
    watcher = Background(watch)
    rec.until(lambda: rec.asked("/batches/1") == 1)      # the long poll, the stream and the watch are sent
    frec.until(lambda: frec.asked("/trajectories") == 1)
    wrec.until(lambda: wrec.asked("/rolloutjobs") == 1)

    controller.restart(signal.SIGTERM)
    frec.until(lambda: frec.asked("/trajectories") >= 2)  # resumed on the new controller
    controller.restart(signal.SIGKILL)
    rec.until(lambda: rec.asked("/batches/1") >= 3)
    frec.until(lambda: frec.asked("/trajectories") >= 3)

    rc.apply({**doc, "metadata": {**doc["metadata"], "labels": {"step": "after-restarts"}}})
    assert batch.thread.is_alive() and follow.thread.is_alive() and watcher.thread.is_alive()
    rc2 = RolloutClient(controller.url, token=controller.token)
    rc2.delete("restarted")
    assert isinstance(batch.join().error, NotFound)     # still polling the same batch when the job went
    assert follow.join().error is None and follow.result == []
    assert watcher.join().error is None and ("MODIFIED", "after-restarts") in watched
    codes = rec.codes + frec.codes + wrec.codes
    assert not [c for c in codes if c[1] >= 500 and c[1] != 503], codes
    for c in (rc, rc2, follow_rc, watch_rc):
        c.close()
