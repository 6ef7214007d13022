"""Two controllers on one PostgreSQL database: a job written by one wakes the other's watchers and leaves its
cache (LISTEN/NOTIFY, `controller/store/listen.py`); SQLite has one process per file and needs none of this."""
from __future__ import annotations

import asyncio

import yaml

from rolloutd.controller.store import Store
from rolloutd.crds.rolloutjob import RolloutJob

from .test_list_snapshot import EXAMPLE


def job(name: str, team: str) -> RolloutJob:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"].update(name=name, labels={"team": team})
    return RolloutJob.model_validate(doc)


def test_a_write_by_another_controller_wakes_the_watchers_and_refreshes_the_cached_job(pg_server):
    url = pg_server.create_database()
    writer, reader = Store(url), Store(url)
    writer.apply(job("first", "a"))
    before = reader.get("first")  # cached by the reader now
    reader.listen()
    try:
        assert reader._listener.ready.wait(30)

        async def watch() -> None:
            woke = reader.subscribe()
            await asyncio.to_thread(writer.apply, job("first", "b"))
            await asyncio.wait_for(woke.wait(), 30)  # the other process's NOTIFY, heard by the listener thread

        mark = reader.mark_of("first")
        asyncio.run(watch())
        after = reader.get("first")
        assert (before.metadata.labels, after.metadata.labels) == ({"team": "a"}, {"team": "b"})
        assert int(after.metadata.resource_version) > int(before.metadata.resource_version)
        assert reader.mark_of("first") > mark
    finally:
        reader._listener.stop()
