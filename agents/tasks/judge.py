"""Judgements that may not end, in worker processes with a time bound: a model's answer can make sympy compute for
ever (`exp(exp(exp(99)))` never returned), and a thread cannot be stopped. Used by the math task's EVAL (`math.py`).

The workers (pebble's process pool: a task over its bound is killed with its worker, which is replaced) are started
once per process on first use, by `spawn` (the node daemon runs threads: no fork), and import sympy as they start,
so that the bound measures the judgement, not the import.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import threading
from collections.abc import Callable
from typing import Any

from rolloutd.crds.errors import AgentError

JUDGE_SECONDS = 10.0  # a judgement takes milliseconds; one of seconds is an answer built to be expensive
WORKERS = 2

_pool: Any = None
_lock = threading.Lock()


class JudgementTimedOut(AgentError):
    """The judgement ran past its bound and was stopped: the answer could not be verified (the answer's doing)."""


def _warm() -> None:
    import sympy  # noqa: F401 - the first import takes ~1.5 s: not the first judgement's


def pool() -> Any:
    """This process's worker pool (started on first use)."""
    global _pool
    with _lock:
        if _pool is None or not _pool.active:
            import pebble

            _pool = pebble.ProcessPool(max_workers=WORKERS, initializer=_warm,
                                       context=multiprocessing.get_context("spawn"))
        return _pool


async def judged(fn: Callable[..., Any], *args: Any, seconds: float | None = None) -> Any:
    """`fn(*args)` in a worker; JudgementTimedOut once it has run `seconds` (default JUDGE_SECONDS; its worker
    killed). Cancelling the await (the stage's own timeout) stops it too."""
    seconds = JUDGE_SECONDS if seconds is None else seconds
    future = pool().schedule(fn, args=args, timeout=seconds)
    try:
        return await asyncio.wrap_future(future)
    except concurrent.futures.TimeoutError as e:  # pebble's, for a task past its bound
        raise JudgementTimedOut(f"the judgement ran over {seconds:g} s and was stopped") from e
