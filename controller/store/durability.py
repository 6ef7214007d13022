"""What a 2xx answer to a write promises: the write is on the disk. The store runs SQLite's WAL with
synchronous=NORMAL (a commit is written, not synced; the WAL is synced at each checkpoint), which keeps the node
protocol's hot path (beats, leases) free of an fsync each; `Durable.settle()` syncs the WAL before the API answers a
client's write, and before a node is told its results are stored. Concurrent callers share one fsync: a caller
waits for the first sync that starts after its commit (group sync). PostgreSQL commits are durable on the server:
nothing to do. Called by `middleware.py` (the API's, writes other than the node protocol's) and
`http/node_protocol.py` (results, alone or riding on a beat). Next step: none planned.
"""
from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


class Durable:
    """The SQLite store at `path` (None: a server's store, always durable) made durable on demand."""

    def __init__(self, path: Path | None) -> None:
        self.path = None if path is None else Path(path)
        self.syncs = self.settled = 0  # fsync rounds run, callers they answered (/metrics, tests, the bench)
        self.sync_seconds = self.wait_seconds = 0.0  # in the fsyncs; callers' time in `settle`, summed
        self._asked = self._done = 0
        self._lock: asyncio.Lock | None = None
        self._dir_synced = False
        # a thread of its own: in the loop's shared executor a sync would queue behind the store calls it waits on
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="store-sync") if path is not None else None

    def sync_now(self) -> None:
        """fsync the WAL (every commit written before this call is then on the disk: a frame that is no longer in
        the WAL was copied into the database file by a checkpoint, which synced that file before the WAL could
        start over); without a WAL (not in WAL mode, or closed), the database file. Once, the folder too (its
        entry for a WAL created since the start). Raises OSError (EIO, EROFS…) when the disk refuses."""
        if self.path is None:
            return
        wal = self.path.with_name(self.path.name + "-wal")
        try:
            fd = os.open(wal, os.O_RDONLY)
        except FileNotFoundError:
            fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if not self._dir_synced:
            fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            self._dir_synced = True

    async def settle(self) -> None:
        """Return once every commit made before this call is on the disk (an fsync in a thread, shared by the
        callers waiting meanwhile)."""
        if self.path is None:
            return
        self._asked += 1
        ticket, began = self._asked, time.perf_counter()
        try:
            await self._settle(ticket)
        finally:
            self.wait_seconds += time.perf_counter() - began

    async def _settle(self, ticket: int) -> None:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._done >= ticket:  # a sync that started after our commit has finished
                self.settled += 1
                return
            upto = self._asked  # every caller counted so far committed before this sync starts
            began = time.perf_counter()
            await asyncio.get_running_loop().run_in_executor(self._thread, self.sync_now)
            self.sync_seconds += time.perf_counter() - began
            self.syncs += 1
            self._done = upto
            self.settled += 1
