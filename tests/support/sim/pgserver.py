"""A throwaway PostgreSQL server (Debian's `postgresql` binaries) under a temporary directory, on a Unix socket:
`initdb` + `postgres` as an unprivileged user, databases made on demand, everything removed at `stop`.

Used by the tests (`tests/support/postgres.py`, one per session) and `bench scale --store postgresql`.
Next step: none planned; production servers are the site's (docs: Operations, PostgreSQL).
"""
from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

SYSTEM_USER = "rolloutd-pg"  # who runs the server when we are root (postgres refuses to run as root)
ROLE = "rolloutd"
START_SECONDS = 60.0


def binaries() -> Path | None:
    """The newest installed server's bin directory (/usr/lib/postgresql/<version>/bin), None when none is."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"), key=lambda p: int(Path(p).parts[-3]))
    return Path(found[-1]).parent if found else None


def _as_user() -> list[str]:
    """The prefix that runs a command as the unprivileged user: nothing unless we are root."""
    if os.geteuid() != 0:
        return []
    try:
        pwd.getpwnam(SYSTEM_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", SYSTEM_USER],
                       check=True, capture_output=True)
    return ["runuser", "-u", SYSTEM_USER, "--"]


class PgServer:
    """`start()` → the server up on a socket in `dir`; `create_database()` → a fresh database's URL;
    `fsync=False` for tests (a crash of the test machine loses nothing we keep)."""

    def __init__(self, bindir: Path, *, fsync: bool = True, settings: dict[str, str] | None = None):
        self.bindir, self.fsync = bindir, fsync
        self.settings = settings or {}
        self.dir = Path(tempfile.mkdtemp(prefix="rolloutd-pg-"))
        self.data, self.log = self.dir / "data", self.dir / "server.log"
        self.proc: subprocess.Popen | None = None
        self._names = itertools.count(1)

    def _run(self, *argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([*_as_user(), *argv], check=True, capture_output=True, text=True)

    def start(self) -> "PgServer":
        prefix = _as_user()
        os.chmod(self.dir, 0o755)
        if prefix:
            shutil.chown(self.dir, SYSTEM_USER)
        self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-U", ROLE, "--auth=trust", "--locale=C",
                  "-E", "UTF8", "--no-sync")
        opts = {"listen_addresses": "", "unix_socket_directories": str(self.dir), "fsync": "on" if self.fsync else "off",
                "synchronous_commit": "on" if self.fsync else "off", "full_page_writes": "on" if self.fsync else "off",
                "max_connections": "200", "shared_buffers": "128MB", "timezone": "UTC", **self.settings}
        argv = [str(self.bindir / "postgres"), "-D", str(self.data)]
        for k, v in opts.items():
            argv += ["-c", f"{k}={v}"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([*prefix, *argv], stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + START_SECONDS
        while subprocess.run([str(self.bindir / "pg_isready"), "-q", "-h", str(self.dir), "-U", ROLE]).returncode:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"postgres did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)
        return self

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{ROLE}@/{database}?host={self.dir}"

    def psql(self, sql: str, database: str = "postgres") -> str:
        return subprocess.run([str(self.bindir / "psql"), "-X", "-q", "-At", "-h", str(self.dir), "-U", ROLE,
                               "-d", database, "-c", sql], check=True, capture_output=True, text=True).stdout

    def create_database(self, prefix: str = "t") -> str:
        name = f"{prefix}_{os.getpid()}_{next(self._names)}"
        self.psql(f"CREATE DATABASE {name}")
        return self.url(name)

    def pid(self) -> int | None:
        """The postmaster's pid (for CPU accounting: the backends are its children)."""
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            pid = self.pid()
            if pid is not None:
                os.kill(pid, signal.SIGINT)  # fast shutdown: clients disconnected, a clean checkpoint
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
