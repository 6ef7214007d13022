"""`bench scale`'s controller replicas: N `rolloutd controller` processes on one PostgreSQL database and one data dir
(ROLLOUTD_REPLICAS naming them all), each serving the node calls of the nodes it owns (controller/ha/shards.py).

`$ROLLOUTD_SCALE_REPLICAS` (`1,2`): the replica counts run at every N on PostgreSQL, side by side (1: the plain
controller, no replica machinery). The simulated nodes call the first replica and move to their owner when a
forwarded reply names it, as daemons do; the point's CPU is every replica's. Each replica paces the beats of the nodes
it serves to its own budget (`ROLLOUTD_NODE_CALLS_PER_SECOND`, 250 a second), so N replicas take N times the beats of
one controller for the same rollouts; `$ROLLOUTD_SCALE_SPLIT_BUDGET=1` gives each 1/N of it (the same beats as one).
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

from bench.bench_pipeline import _cpu_seconds, _port
from rolloutd.crds.node import NODE_CALLS_PER_SECOND


def counts() -> list[int]:
    return [int(x) for x in os.environ.get("ROLLOUTD_SCALE_REPLICAS", "1").split(",") if x.strip()]


def start(make: Callable[..., Any], root: Path, src: Path | None, url: str, n: int) -> list[Any]:
    """`n` replicas (`make`: bench_scale.Controller); the first leads (started alone, given the lease's time)."""
    ports = [_port() for _ in range(n)]
    env = {"ROLLOUTD_REPLICAS": ",".join(f"http://127.0.0.1:{p}" for p in ports), "ROLLOUTD_NODE_SHARDS": "1"}
    if os.environ.get("ROLLOUTD_SCALE_SPLIT_BUDGET") == "1":
        env["ROLLOUTD_NODE_CALLS_PER_SECOND"] = str(NODE_CALLS_PER_SECOND / n)
    made: list[Any] = []
    try:
        for i, port in enumerate(ports):
            (root / f"r{i}").mkdir(exist_ok=True)
            made.append(make(root / f"r{i}", src, url, data=root / "data", port=port, env=env))
            if i == 0:
                _wait_leader(made[0], url)
    except BaseException:
        for c in made:
            c.stop()
        raise
    return made


def _wait_leader(ctl: Any, store: str, timeout: float = 60.0) -> None:
    """The first replica holds the leader lease (the row: controller/ha/leadership.py)."""
    from sqlalchemy import create_engine

    from rolloutd.controller import dialects
    from rolloutd.controller.ha.leadership import current

    engine = create_engine(dialects.engine_url(store))
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                holder, _, _, url = current(engine)
            except Exception:  # noqa: BLE001 - no table yet
                holder, url = "", ""
            if holder and url.rstrip("/") == ctl.url:
                time.sleep(1.0)  # its scheduler built from the database
                return
            time.sleep(0.2)
    finally:
        engine.dispose()
    raise RuntimeError("the first replica did not lead")


def cpu(ctls: list[Any]) -> float:
    return sum(_cpu_seconds(c.proc.pid) for c in ctls)
