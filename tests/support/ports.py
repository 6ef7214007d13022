"""The tests' TCP ports: `free_port()` hands each xdist worker its own block below the kernel's ephemeral range, so
no other worker, and no port the kernel picks (`bind(("127.0.0.1", 0))`, an outgoing connection), is ever handed out
between the pick and the bind of the server that takes it.

A port from `bind(..., 0)` is free only until its socket closes: on CI two workers' controllers were once handed
the same one, and the first to answer /healthz was the other worker's (its data dir had no token: the test erred).
"""
from __future__ import annotations

import itertools
import os
import random
import socket

BASE, BLOCK = 20000, 1500  # 20000-32000 for up to 8 workers: below every Linux default ephemeral range (>= 32768)


def _worker() -> int:
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    return int(name[2:]) if name[2:].isdigit() else 0


FIRST = BASE + (_worker() % 8) * BLOCK  # this worker's block: FIRST .. FIRST + BLOCK - 1


def _ports():
    start = random.randrange(BLOCK)  # a process this worker spawned that picks ports too starts elsewhere
    for i in itertools.count(start):
        yield FIRST + i % BLOCK


_next = _ports()


def free_port() -> int:
    """A loopback port nothing listens on, not handed out before by this process (until its block wraps)."""
    for _ in range(BLOCK):
        port = next(_next)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in this worker's block {FIRST}-{FIRST + BLOCK - 1}")
