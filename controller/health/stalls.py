"""A diagnostic: what the event loop was doing while it stalled (`$ROLLOUTD_STALL_SAMPLES`, off by default).

`looplag.LoopLag` says how late the loop is; this says why. A watchdog thread looks every SAMPLE_EVERY at when
the lag probe last woke (`LoopLag.ticked`); while that is more than STALL ago, the loop is stuck in one slice,
and the watchdog takes the loop thread's stack (`sys._current_frames`) and charges the time since its last look
to every function on it. The GIL does not hide a stall from it: SQLite, file and socket calls release it, and a
loop running Python code gives it up every switch interval (5 ms). Each stall also says whose CPU it was
(`_cause`): the loop thread's own work, other threads' (the loop waited for the GIL: a stack on `select` that
lasts), or neither (the process was not given a core, or the loop waited in a system call). Every few seconds (and
at the end) it writes to the file: the stalls seen (count, total and longest ms), the functions by stalled time
(inclusive, and on top of the stack), and the longest stalls of the last LONGEST_SPAN seconds with their stacks,
start time and CPU (a start-up's long stalls would otherwise hide those of a later window). `bench scale` sets it and
reads it (bench/bench_scale.py).
The cost while on: a thread waking every SAMPLE_EVERY (microseconds each); do not compare timings taken with it.
Next step: the same report for a worker thread the loop waits on (the GIL's holder).
"""
from __future__ import annotations

import collections
import json
import sys
import threading
import time
from pathlib import Path
from typing import Callable

STALL = 0.020        # the probe wakes every 10 ms: no wake for this long is a slice of ≥ 10 ms
SAMPLE_EVERY = 0.004
WRITE_EVERY = 5.0
KEEP_LONGEST = 10
LONGEST_SPAN = 30.0  # seconds: the longest stalls kept are those begun this recently (a `bench scale` window)
MOSTLY = 0.5         # a stall is a thread's when that thread's CPU covered at least this part of it
DEPTH = 40           # frames kept per stack, innermost first


def _stack(frame) -> list[str]:
    out = []
    while frame is not None and len(out) < DEPTH:
        code = frame.f_code
        out.append(f"{code.co_name} ({'/'.join(Path(code.co_filename).parts[-2:])}:{frame.f_lineno})")
        frame = frame.f_back
    return out


def _func(label: str) -> str:
    """A frame's label without its line: the function (its file)."""
    return label.rsplit(":", 1)[0] + ")"


class StallSampler:
    """Watches `ticked()` (the loop thread's last wake, time.monotonic) for the loop thread `thread_id`."""

    def __init__(self, path: Path, ticked: Callable[[], float], thread_id: int) -> None:
        self.path, self.ticked, self.thread_id = Path(path), ticked, thread_id
        self.inclusive: collections.Counter[str] = collections.Counter()  # function → seconds stalled under it
        self.top: collections.Counter[str] = collections.Counter()        # frame (with line) → seconds on top
        self.stalls: list[float] = []                                     # each stall's length seen, seconds
        self.longest: list[tuple[float, list[str], dict]] = []            # (length, its most seen stack, its CPU)
        self.causes: collections.Counter[str] = collections.Counter()     # cause → seconds stalled
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stall-sampler", daemon=True)

    def start(self) -> "StallSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.write()

    def _cpu(self) -> tuple[float, float]:
        """(the loop thread's CPU seconds, the whole process's) so far."""
        try:
            loop = time.clock_gettime(time.pthread_getcpuclockid(self.thread_id))
        except (OSError, AttributeError):  # the thread is gone, or no per-thread clock here
            loop = 0.0
        return loop, time.process_time()

    def _watch(self) -> None:
        last_write = time.monotonic()
        in_stall, last, started, stacks = False, 0.0, 0.0, collections.Counter()
        cpu, looks, looked = (0.0, 0.0), 0, 0.0  # CPU and time at the stall's first look, the looks since
        while not self._stop.wait(SAMPLE_EVERY):
            now, ticked = time.monotonic(), self.ticked()
            if now - ticked > STALL:
                frame = sys._current_frames().get(self.thread_id)
                if frame is not None:
                    if not in_stall:
                        cpu, looks, looked = self._cpu(), 0, now
                    looks += 1
                    stack = _stack(frame)
                    dt = now - (last if in_stall else ticked + STALL)
                    for name in set(map(_func, stack)):
                        self.inclusive[name] += dt
                    if stack:
                        self.top[stack[0]] += dt
                    stacks[tuple(stack)] += dt
                    in_stall, last, started = True, now, (started if in_stall else ticked)
            elif in_stall:
                (loop0, proc0), (loop1, proc1) = cpu, self._cpu()
                self._close(ticked - started, now - looked, stacks, {
                    "at": round(time.time() - (now - started), 3), "loop_cpu_ms": round((loop1 - loop0) * 1e3, 1),
                    "other_threads_cpu_ms": round(max(0.0, (proc1 - proc0) - (loop1 - loop0)) * 1e3, 1),
                    "looks": looks})
                in_stall, stacks = False, collections.Counter()
            if now - last_write >= WRITE_EVERY:
                last_write = now
                self.write()

    def _close(self, length: float, measured: float, stacks: collections.Counter, cpu: dict) -> None:
        """A stall of `length` seconds; `cpu` was read over its last `measured` seconds (from the first look)."""
        self.stalls.append(length)
        cpu["cause"] = _cause(measured, cpu)
        self.causes[cpu["cause"]] += length
        if stacks:
            self.longest.append((length, list(stacks.most_common(1)[0][0]), cpu))
            self.longest = sorted(self._recent(), key=lambda x: -x[0])[:KEEP_LONGEST]

    def _recent(self) -> list[tuple[float, list[str], dict]]:
        since = time.time() - LONGEST_SPAN
        return [x for x in self.longest if x[2]["at"] >= since]

    def report(self) -> dict:
        ms = lambda s: round(s * 1e3, 1)  # noqa: E731
        return {"stalls": len(self.stalls), "stalled_ms": ms(sum(self.stalls)), "longest_ms": ms(max(self.stalls, default=0)),
                "inclusive_ms": {f: ms(s) for f, s in self.inclusive.most_common()},
                "top_ms": {f: ms(s) for f, s in self.top.most_common()},
                "causes_ms": {c: ms(s) for c, s in self.causes.most_common()},
                "longest": [{"ms": ms(n), **cpu, "stack": stack} for n, stack, cpu in self._recent()]}

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(self.report(), indent=1))
            tmp.replace(self.path)
        except OSError:
            pass  # a diagnostic: never the controller's failure


def _cause(measured: float, cpu: dict) -> str:
    """Whose CPU a stall was, from its CPU over `measured` seconds: "loop" (its own work), "other threads" (it waited
    for the GIL they held), or "not running" (the process was not given a core, or the loop waited in a system call)."""
    if cpu["loop_cpu_ms"] / 1e3 >= MOSTLY * measured:
        return "loop"
    if cpu["other_threads_cpu_ms"] / 1e3 >= MOSTLY * measured:
        return "other threads"
    return "not running"
