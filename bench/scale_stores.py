"""`bench scale`'s stores: the controller's SQLite file (the default) or a PostgreSQL server the bench starts
for the point (`tests/support/sim/pgserver.py`, Debian's binaries, a data directory of its own), and the server's
CPU and writes, read from /proc over the postmaster and its backends.

`$ROLLOUTD_SCALE_STORES` (`python -m bench scale --store sqlite,postgresql`): the stores to run at every N,
side by side. `$ROLLOUTD_SCALE_PG_STATEMENTS=1`: the server's statements over the window (pg_stat_statements:
calls, time, rows of the costliest) in the JSON's `statements`. The server runs with fsync on and
`synchronous_commit=off`: a commit returns before its WAL is flushed, as SQLite's WAL with `synchronous=NORMAL`
does (a power loss may lose the last commits, never corrupt).
"""
from __future__ import annotations

import os
from pathlib import Path

from support.sim.pgserver import PgServer, binaries

PG_SETTINGS = {"synchronous_commit": "off", "shared_buffers": "256MB", "max_wal_size": "2GB",
               "checkpoint_timeout": "15min"}


def stores() -> list[str]:
    wanted = [s.strip() for s in os.environ.get("ROLLOUTD_SCALE_STORES", "sqlite").split(",") if s.strip()]
    bad = set(wanted) - {"sqlite", "postgresql"}
    if bad:
        raise SystemExit(f"ROLLOUTD_SCALE_STORES: unknown store(s) {sorted(bad)} (sqlite, postgresql)")
    return wanted


def start_server() -> PgServer:
    bindir = binaries()
    if bindir is None:
        raise RuntimeError("bench scale --store postgresql: install Debian's postgresql (.ci/system-packages.sh)")
    # `$ROLLOUTD_SCALE_PG_SETTINGS` ("log_lock_waits=on,deadlock_timeout=200ms"): more server settings, to look inside
    extra = dict(kv.split("=", 1) for kv in os.environ.get("ROLLOUTD_SCALE_PG_SETTINGS", "").split(",") if "=" in kv)
    if os.environ.get("ROLLOUTD_SCALE_PG_STATEMENTS") == "1":
        extra["shared_preload_libraries"] = "pg_stat_statements"
    server = PgServer(bindir, fsync=True, settings={**PG_SETTINGS, **extra}).start()
    if extra:
        print(f"   PostgreSQL's log: {server.log}", flush=True)
    return server


def _family(root: int) -> list[int]:
    """`root` and its children (the postmaster's backends, checkpointer, WAL writer)."""
    pids = [root]
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == root:
                    pids.append(int(proc.name))
            except (OSError, ValueError, IndexError):
                continue
    return pids


def _stat(pid: int) -> tuple[float, int]:
    """(CPU seconds of the process and its reaped children, bytes it wrote)."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        io = {k: int(v) for k, v in (line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())}
    except (OSError, ValueError):
        return 0.0, 0
    cpu = (int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])) / os.sysconf("SC_CLK_TCK")
    return cpu, io.get("write_bytes", 0)


def server_usage(server: PgServer | None) -> tuple[float, int]:
    """The server's CPU seconds and written bytes so far (0, 0 without one): a window is a difference of two."""
    pid = server and server.pid()
    if not pid:
        return 0.0, 0
    parts = [_stat(p) for p in _family(pid)]
    return sum(c for c, _ in parts), sum(w for _, w in parts)


def database_bytes(server: PgServer, url: str) -> int:
    return int(server.psql(f"SELECT pg_database_size('{_database(url)}')").strip() or 0)


def _database(url: str) -> str:
    return url.split("@/", 1)[1].split("?", 1)[0]  # PgServer's URLs: postgresql://ROLE@/NAME?host=DIR


def statements_reset(server: PgServer | None, url: str | None) -> None:
    """With `$ROLLOUTD_SCALE_PG_STATEMENTS=1`: the statements' counts start now (the window's start)."""
    if server and url and os.environ.get("ROLLOUTD_SCALE_PG_STATEMENTS") == "1":
        server.psql("CREATE EXTENSION IF NOT EXISTS pg_stat_statements; SELECT pg_stat_statements_reset()",
                    _database(url))


def statements(server: PgServer | None, url: str | None, top: int = 25) -> dict | None:
    """The window's statements (after `statements_reset`): their totals and the `top` costliest (server time:
    execution and planning), each with its calls, ms, ms a call and rows."""
    if not (server and url and os.environ.get("ROLLOUTD_SCALE_PG_STATEMENTS") == "1"):
        return None
    rows = server.psql(
        "SELECT calls, total_exec_time, total_plan_time, rows, regexp_replace(query, '\\s+', ' ', 'g') "
        "FROM pg_stat_statements ORDER BY total_exec_time + total_plan_time DESC", _database(url)).splitlines()
    parsed = [r.split("|", 4) for r in rows if r.count("|") >= 4]
    stmts = [{"calls": int(c), "ms": round(float(e) + float(p), 1), "plan_ms": round(float(p), 1),
              "ms_per_call": round((float(e) + float(p)) / max(int(c), 1), 4), "rows": int(n), "query": q[:300]}
             for c, e, p, n, q in parsed]
    return {"calls": sum(s["calls"] for s in stmts), "ms": round(sum(s["ms"] for s in stmts), 1), "top": stmts[:top]}
