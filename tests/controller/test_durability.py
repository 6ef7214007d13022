"""A 2xx answer to a write means the write is on the disk (`controller/store/durability.py`, #37): callers waiting
together share one fsync of the WAL, none returns before a sync that began after its call, and a disk that refuses
the sync turns the API's answer into a 503 naming it (the write is not reported as stored). Real SQLite store; the
disk's refusal is the one thing simulated (os.fsync raising EIO: the ext4 journal abort itself is
tests/faults/test_storage.py's)."""
from __future__ import annotations

import asyncio
import errno
import os

from fastapi.testclient import TestClient
from support.kube_helpers import job_doc

from rolloutd.controller.store import durability
from rolloutd.controller.api import create_app
from rolloutd.controller.root import assemble
from rolloutd.controller.store import Store

P = "/apis/rolloutd.io/v1alpha1/namespaces/default/rolloutjobs"


def test_callers_waiting_together_share_one_sync_and_none_returns_before_a_sync_that_began_after_it(tmp_path):
    store = Store(tmp_path / "rolloutd.db")
    d = store.durable
    began: list[int] = []  # per sync: how many callers had asked when it began
    real = d.sync_now

    def counted() -> None:
        began.append(d._asked)
        real()
    d.sync_now = counted

    async def scenario() -> list[tuple[int, int]]:
        async def one() -> tuple[int, int]:
            asked = d._asked + 1  # this caller's number
            await d.settle()
            return asked, len(began)
        return await asyncio.gather(*(one() for _ in range(50)))

    done = asyncio.run(scenario())
    assert d.settled == 50 and 1 <= d.syncs == len(began) < 50  # shared: far fewer fsyncs than callers
    for asked, syncs_then in done:  # a sync that began once this caller had asked ended before it returned
        assert any(n >= asked for n in began[:syncs_then]), (asked, began[:syncs_then])


def test_a_sync_the_disk_refuses_answers_503_and_reads_go_on(tmp_path, monkeypatch):
    app = create_app(assemble(Store(tmp_path / "rolloutd.db"), "admin"))
    with TestClient(app, headers={"Authorization": "Bearer admin"}) as api:
        assert api.post(P, json=job_doc("kept")).status_code == 201

        def refused(fd: int) -> None:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        monkeypatch.setattr(durability.os, "fsync", refused)
        r = api.post(P, json=job_doc("unsynced"))
        assert r.status_code == 503 and "cannot be written" in r.json()["message"], r.text
        assert int(r.headers["Retry-After"]) > 0
        assert api.get(f"{P}/kept").status_code == 200  # reads do not sync
        monkeypatch.undo()
        assert api.post(P, json=job_doc("after")).status_code == 201
