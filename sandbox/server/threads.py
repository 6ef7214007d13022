"""The server's threads: reused workers for long requests, and one thread for every bash command's deadline.

Where it sits: `server.main.Server` submits long requests (ipython, a bash whose session is busy,
a timeout's escalation) to `Workers` and registers each started bash command with `Deadlines`,
which calls `BashSession.expire` / `complete` (`server.bash`) when its timeout passes.
"""
from __future__ import annotations

import threading
import time
from _queue import SimpleQueue


class Workers:
    """Threads for long requests, reused: `Thread.start()` waits for the new
    thread to run (two context switches per request on a busy node); a parked
    worker takes a job with one."""

    def __init__(self) -> None:
        self.jobs: SimpleQueue = SimpleQueue()
        self.idle = 0
        self.lock = threading.Lock()

    def submit(self, fn, *args) -> None:
        """Run fn(*args) on a worker. Raises RuntimeError, with the job not queued,
        if a thread is needed and cannot be started (the process limit is reached)."""
        with self.lock:
            spawn = self.idle == 0
            if not spawn:
                self.idle -= 1
        if spawn:
            threading.Thread(target=self._loop, args=((fn, args),), daemon=True).start()
        else:
            self.jobs.put((fn, args))

    def _loop(self, job) -> None:
        while True:
            fn, args = job
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - reply() reports its own errors
                pass
            with self.lock:
                self.idle += 1
            job = self.jobs.get()


class Deadlines:
    """Timeouts of started bash commands, all on one thread (started with the first command).

    A command that ends in time leaves its entry behind (`expire` would do
    nothing): adding one wakes the thread only when it is the new earliest,
    and the thread drops every ended entry whenever it wakes (or when many
    pile up). There is at most one running command per session, so the thread
    wakes about once per timeout period of a busy session, not per command."""

    def __init__(self, workers: Workers) -> None:
        self.workers = workers
        self._entries: list = []  # (when, session, job)
        self._earliest = float("inf")  # when the thread wakes next
        self._cond = threading.Condition(threading.Lock())
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (before the first command: once a command runs, a fork
        bomb may hold the process limit). Raises RuntimeError if it cannot."""
        with self._cond:
            if self._thread is None:
                thread = threading.Thread(target=self._loop, name="deadlines", daemon=True)
                thread.start()
                self._thread = thread

    def add(self, when: float, session, job) -> None:
        with self._cond:
            if len(self._entries) >= 4096:
                self._entries = [e for e in self._entries if not e[2].claimed]
            self._entries.append((when, session, job))
            if when < self._earliest:
                self._earliest = when
                self._cond.notify()

    def _loop(self) -> None:
        inf = float("inf")
        due: list = []
        while True:
            for session, job in due:
                if session.expire(job):  # it still runs: escalate on a worker (that blocks)
                    try:
                        self.workers.submit(session.complete, job)
                    except RuntimeError:  # no thread to be had (a fork bomb?): escalate here
                        session.complete(job)
            with self._cond:
                now = time.monotonic()
                keep, due = [], []
                for entry in self._entries:
                    if not entry[2].claimed:
                        if entry[0] <= now:
                            due.append(entry[1:])
                        else:
                            keep.append(entry)
                self._entries = keep
                self._earliest = min([e[0] for e in keep], default=inf)
                if not due:
                    self._cond.wait(None if self._earliest == inf else self._earliest - now)

