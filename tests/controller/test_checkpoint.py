"""The store's WAL is copied into the database by a thread of its own (`StoreDB.checkpoint_in_background`),
not by whichever commit fills it on the controller's event loop."""
import sqlite3
import time

from rolloutd.controller.store import Store


def _autocheckpoint(store: Store) -> int:
    with store.engine.connect() as c:
        return c.exec_driver_sql("PRAGMA wal_autocheckpoint").scalar()


def _write(store: Store, rows: int) -> None:
    with store.engine.begin() as c:
        c.exec_driver_sql("CREATE TABLE IF NOT EXISTS filler (x TEXT)")
        c.exec_driver_sql("INSERT INTO filler VALUES " + ",".join(["(?)"] * rows), tuple("x" * 1000 for _ in range(rows)))


def test_the_background_thread_copies_the_wal_while_commits_do_not(tmp_path):
    store = Store(tmp_path / "db.sqlite")
    db_file = tmp_path / "db.sqlite"
    assert _autocheckpoint(store) == 1000
    stop = store.checkpoint_in_background(interval=0.05)
    try:
        assert _autocheckpoint(store) == 0  # commits never checkpoint on their caller's thread
        before = db_file.stat().st_size
        _write(store, 500)  # ~0.5 MB: only a checkpoint moves it from the WAL into the database file
        deadline = time.monotonic() + 30
        while db_file.stat().st_size <= before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert db_file.stat().st_size > before + 400_000
    finally:
        stop()
    assert _autocheckpoint(store) == 1000  # stopped: commits checkpoint again, as SQLite does by default
    raw = sqlite3.connect(db_file)
    assert raw.execute("SELECT count(*) FROM filler").fetchone()[0] == 500

