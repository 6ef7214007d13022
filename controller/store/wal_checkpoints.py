"""The store's WAL checkpoints, copied to the database file by a thread of their own instead of inside a commit
on the event loop.

SQLite copies the WAL's frames back into the database file (a checkpoint: two fsyncs and the copy) inside the
commit that grows the WAL past `wal_autocheckpoint` pages; at a thousand nodes that commit is a group of node
calls on the event loop (`work/group_commit.GroupCommit`), and every call behind it waited. `Checkpointer` runs
PASSIVE checkpoints every EVERY seconds on a connection of its own, in a thread: sqlite3 releases the GIL while it
copies and syncs, and a PASSIVE checkpoint takes no lock a writer waits for. While it runs the connections of the
store checkpoint inline only past BACKSTOP_PAGES (`StoreDB.autocheckpoint`), which then finds nearly everything
copied already; that inline pass is also what lets the WAL start over from its beginning (a PASSIVE pass that
writers keep appending behind never ends with every frame copied). Started and stopped by `server.py`.
Next step: none planned; a store without the thread (tools, tests) keeps SQLite's inline checkpoints.
"""
from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

EVERY = 0.05
BACKSTOP_PAGES = 4000  # 16 MB of WAL at SQLite's 4 KiB pages


class Checkpointer:
    """PASSIVE checkpoints of the database at `path` every `every` seconds, in a daemon thread."""

    def __init__(self, path: Path, every: float = EVERY) -> None:
        self.path, self.every = Path(path), every
        self.passes = self.copied = 0  # for the tests: checkpoints run, frames they copied
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wal-checkpoints", daemon=True)

    def start(self) -> "Checkpointer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA synchronous=NORMAL")  # a checkpoint syncs the WAL and the file, as the store's do
            while not self._stop.wait(self.every):
                try:
                    _busy, _frames, copied = db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                except sqlite3.Error:
                    continue  # a pass missed (e.g. the file being replaced): the next one, or the inline backstop
                self.passes += 1
                self.copied += max(copied, 0)
        finally:
            db.close()
