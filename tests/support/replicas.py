"""Controller replicas for the failover tests: N `rolloutd controller` processes (local executor) on one data dir
and one SQLite database (WAL lets several processes share it on one machine), ROLLOUTD_REPLICAS naming them all.

`Replicas.leader()` reads the lease row (controller/ha/leadership.py); `wait_leader` times a take-over."""
from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from support.cluster import Cluster, free_port


class Replicas:
    def __init__(self, root: Path, env: dict[str, str], n: int = 2, lease_seconds: float = 5.0,
                 store: str | None = None) -> None:
        """`store`: a postgresql:// URL (the replicas' ROLLOUTD_STORE), else the data dir's SQLite file."""
        ports = [free_port() for _ in range(n)]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        env = {**env, "ROLLOUTD_REPLICAS": ",".join(urls), "ROLLOUTD_LEADER_LEASE_SECONDS": str(lease_seconds)}
        if store:
            env["ROLLOUTD_STORE"] = store
        self.store = store
        self.root, self.data_dir = root, root / "data"
        self.members: list[Cluster] = []
        for i, port in enumerate(ports):
            (root / f"r{i}").mkdir(parents=True, exist_ok=True)
            c = Cluster(root / f"r{i}", env)
            c.data_dir, c.port = self.data_dir, port
            self.members.append(c)
        self.servers = ",".join(urls)

    def start(self, i: int) -> Cluster:
        return self.members[i].start()

    def lease(self) -> tuple[str, int, float, str]:
        """(holder, epoch, expires, url) of the lease row."""
        if self.store:
            from sqlalchemy import create_engine

            from rolloutd.controller import dialects
            from rolloutd.controller.ha.leadership import current

            engine = create_engine(dialects.engine_url(self.store))
            try:
                return current(engine)
            finally:
                engine.dispose()
        with sqlite3.connect(f"file:{self.data_dir / 'rolloutd.db'}?mode=ro", uri=True, timeout=10) as db:
            row = db.execute("SELECT holder, epoch, expires, url FROM leader_lease WHERE id = 1").fetchone()
        return row or ("", 0, 0.0, "")

    def write_locked(self) -> bool:
        """SQLite: whether some process holds the database's write lock now (a leader paused inside a commit holds
        it until it wakes or dies). Always False on PostgreSQL."""
        if self.store:
            return False
        db = sqlite3.connect(self.data_dir / "rolloutd.db", timeout=2, isolation_level=None)
        try:
            db.execute("BEGIN IMMEDIATE")
            db.execute("ROLLBACK")
            return False
        except sqlite3.OperationalError as e:
            return "locked" in str(e)
        finally:
            db.close()

    def leader(self) -> Cluster | None:
        holder, _, expires, url = self.lease()
        if not holder or expires < time.time():
            return None
        return next((m for m in self.members if m.url == url), None)

    def wait_leader(self, timeout: float = 60, other_than: Cluster | None = None) -> tuple[Cluster, float]:
        """The replica that leads (not `other_than`), and how long it took from this call."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            try:
                m = self.leader()
            except Exception:  # noqa: BLE001 - no table yet
                m = None
            if m is not None and m is not other_than:
                return m, time.monotonic() - start
            time.sleep(0.05)
        raise TimeoutError(f"no replica led within {timeout:g} s; lease {self.lease()}")

    def stop(self) -> None:
        for m in self.members:
            m.stop()
