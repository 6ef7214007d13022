"""The change log polled: another process's job writes drop this process's cached jobs and wake its watchers.
Run by each controller replica (`ha/replicas.py`) on its store; what wakes: the watches (`kube/watch.py`), the operator.

On SQLite this is how a write of another replica reaches this one (PostgreSQL also announces each write: `listen.py`);
what it does with a changed job is what a write of this process does, without announcing it (`Store.changed_elsewhere`).
"""
from __future__ import annotations

import asyncio
import logging

from ..errors import Gone
from . import Store

log = logging.getLogger("rolloutd.replicas")

POLL_SECONDS = 0.1  # a write on another replica reaches this one's watches within this


class ChangePoller:
    """The change log read every POLL_SECONDS: a change written by another process drops this store's cached job and
    wakes its watchers (`StoreDB.subscribe`), as a write of this process does."""

    def __init__(self, store: Store) -> None:
        self.store, self.stopped = store, False

    async def run(self) -> None:
        store = self.store
        last = await asyncio.to_thread(store.current_rv)
        while not self.stopped:
            await asyncio.sleep(POLL_SECONDS)
            try:
                rv = await asyncio.to_thread(store.current_rv)
                if rv <= last:
                    continue
                try:
                    names: set[str] | None = {c.name for c in await asyncio.to_thread(store.changes_since, last,
                                                                                       None, 100_000)}
                except Gone:  # more changed than the log keeps: any job may have
                    names = None
                store.changed_elsewhere(names)
                last = rv
            except Exception as e:  # noqa: BLE001 - the database away a moment: the next poll tries again
                log.warning("change log poll: %s", e)
