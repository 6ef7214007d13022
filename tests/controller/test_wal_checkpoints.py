"""The WAL copied back by a thread (`controller/store/wal_checkpoints.py`), on a real store: once handed to the thread, a
commit that grows the WAL past SQLite's usual threshold does not write the database file itself (no checkpoint
inside the commit); the thread copies the frames; and the inline backstop keeps the WAL from growing without
bound while writers keep appending."""
from __future__ import annotations

import os

import pytest

from rolloutd.controller.store import Store
from rolloutd.controller.store.db import AUTOCHECKPOINT_PAGES
from rolloutd.controller.store.wal_checkpoints import BACKSTOP_PAGES, Checkpointer
from support.waiting import wait_until

PAGE = 4096


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "db.sqlite")
    with s.engine.begin() as c:
        c.exec_driver_sql("CREATE TABLE blobs (id INTEGER PRIMARY KEY, data BLOB)")
    return s


def write(store: Store, pages: int, per_commit: int = 1000) -> None:
    while pages > 0:
        with store.engine.begin() as c:
            for _ in range(min(per_commit, pages)):
                c.exec_driver_sql("INSERT INTO blobs (data) VALUES (?)", (os.urandom(PAGE - 200),))
        pages -= per_commit


def db_file(store: Store) -> tuple[int, int]:
    st = os.stat(store.path)
    return st.st_size, st.st_mtime_ns


def test_a_commit_checkpoints_inline_unless_the_thread_has_the_wal(store, tmp_path):
    inline = Store(tmp_path / "inline.sqlite")  # the control: SQLite's inline checkpoint, as before
    with inline.engine.begin() as c:
        c.exec_driver_sql("CREATE TABLE blobs (id INTEGER PRIMARY KEY, data BLOB)")
    before = db_file(inline)
    write(inline, 2 * AUTOCHECKPOINT_PAGES)
    assert db_file(inline) != before  # the commit itself copied the WAL into the file

    store.checkpoint_aside(BACKSTOP_PAGES)
    before = db_file(store)
    write(store, 2 * AUTOCHECKPOINT_PAGES)
    assert db_file(store) == before  # nothing copied inside the commit
    with store.engine.connect() as c:
        assert c.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar() == BACKSTOP_PAGES

    thread = Checkpointer(store.path, every=0.05).start()
    try:
        wait_until(lambda: thread.copied >= 2 * AUTOCHECKPOINT_PAGES, 30, "the thread's checkpoint")
    finally:
        thread.stop()
    assert db_file(store)[0] > before[0]  # the rows reached the database file
    with store.engine.connect() as c:
        assert c.exec_driver_sql("SELECT count(*) FROM blobs").scalar() == 2 * AUTOCHECKPOINT_PAGES


def test_the_wal_stays_bounded_while_writers_keep_appending(store):
    store.checkpoint_aside(BACKSTOP_PAGES)
    thread = Checkpointer(store.path, every=0.01).start()
    try:
        write(store, 3 * BACKSTOP_PAGES, per_commit=20)  # commits keep coming while the thread copies
    finally:
        thread.stop()
    assert thread.passes > 0
    wal = os.stat(f"{store.path}-wal").st_size
    assert wal < 2 * BACKSTOP_PAGES * PAGE, f"the WAL grew to {wal / 2**20:.0f} MB"
