"""Two stores on one SQLite file: a job written through one reaches the other by its change log
(`controller/store/change_poll.py`): the cached job dropped, its mark moved, the watchers woken."""
from __future__ import annotations

import asyncio
import threading

from rolloutd.controller.store import Store
from rolloutd.controller.store.change_poll import ChangePoller

from .test_store_listen import job


def poll_until_woken(reader: Store, write) -> None:
    """Runs the reader's poller across `write` (done elsewhere, whole, between two of its polls); returns once the
    reader's watchers are woken."""
    real, started, written = reader.current_rv, threading.Event(), threading.Event()

    def current_rv() -> int:  # the first read is the poller's start; the next waits until the write is done
        if started.is_set():
            written.wait(30)
        rv = real()
        started.set()
        return rv

    reader.current_rv = current_rv

    async def go() -> None:
        poller = ChangePoller(reader)
        woke = reader.subscribe()
        task = asyncio.create_task(poller.run())
        assert await asyncio.to_thread(started.wait, 30)
        await asyncio.to_thread(write)
        written.set()
        try:
            await asyncio.wait_for(woke.wait(), 30)
        finally:
            poller.stopped = True
            await asyncio.wait_for(task, 5)
    asyncio.run(go())


def test_a_write_by_another_process_drops_the_cached_job_and_wakes_the_watchers(tmp_path):
    path = tmp_path / "jobs.db"
    writer, reader = Store(path), Store(path)
    writer.apply(job("first", "a"))
    writer.apply(job("second", "a"))
    before, untouched = reader.get("first"), reader.get("second")  # both cached by the reader
    mark, other = reader.mark_of("first"), reader.mark_of("second")
    poll_until_woken(reader, lambda: writer.apply(job("first", "b")))
    assert reader.get("first").metadata.labels == {"team": "b"}
    assert before.metadata.labels == {"team": "a"}
    assert reader.mark_of("first") > mark
    assert reader.get("second") is untouched and reader.mark_of("second") == other  # not written: still cached


def test_more_changes_than_the_log_keeps_drop_every_cached_job(tmp_path):
    path = tmp_path / "jobs.db"
    writer, reader = Store(path, watch_history=2), Store(path)
    writer.apply(job("first", "a"))
    writer.apply(job("second", "a"))
    reader.get("first"), reader.get("second")
    reader.changed_elsewhere(["second"])  # a mark to move
    mark = reader.mark_of("second")

    def many() -> None:  # the log keeps 2: the reader's place in it is gone
        for i in range(8):
            writer.apply(job("first", f"t{i}"))

    poll_until_woken(reader, many)
    assert reader.cached("first") is None and reader.cached("second") is None
    assert reader.mark_of("second") > mark  # not written, but the reader cannot know: read again
    assert reader.get("first").metadata.labels == {"team": "t7"}
