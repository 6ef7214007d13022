"""A diagnostic: what the event loop was doing while it stalled (`$ROLLOUTD_STALL_SAMPLES`, off by default).

`looplag.LoopLag` says how late the loop is; this says why. A watchdog thread looks every SAMPLE_EVERY at when
the lag probe last woke (`LoopLag.ticked`); while that is more than STALL ago, the loop is stuck in one slice,
and the watchdog takes the loop thread's stack (`sys._current_frames`) and charges the time since its last look
to every function on it. The GIL does not hide a stall from it: SQLite, file and socket calls release it, and a
loop running Python code gives it up every switch interval (5 ms). Every few seconds (and at the end) it writes
to the file: the stalls seen (count, total and longest ms), the functions by stalled time (inclusive, and on top
of the stack), and the stacks of the longest stalls. `bench scale` sets it and reads it (bench/bench_scale.py).
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
        self.longest: list[tuple[float, list[str]]] = []                  # (length, its most seen stack)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stall-sampler", daemon=True)

    def start(self) -> "StallSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.write()

    def _watch(self) -> None:
        last_write = time.monotonic()
        in_stall, last, started, stacks = False, 0.0, 0.0, collections.Counter()
        while not self._stop.wait(SAMPLE_EVERY):
            now, ticked = time.monotonic(), self.ticked()
            if now - ticked > STALL:
                frame = sys._current_frames().get(self.thread_id)
                if frame is not None:
                    stack = _stack(frame)
                    dt = now - (last if in_stall else ticked + STALL)
                    for name in set(map(_func, stack)):
                        self.inclusive[name] += dt
                    if stack:
                        self.top[stack[0]] += dt
                    stacks[tuple(stack)] += dt
                    in_stall, last, started = True, now, (started if in_stall else ticked)
            elif in_stall:
                self._close(ticked - started, stacks)
                in_stall, stacks = False, collections.Counter()
            if now - last_write >= WRITE_EVERY:
                last_write = now
                self.write()

    def _close(self, length: float, stacks: collections.Counter) -> None:
        self.stalls.append(length)
        if stacks:
            self.longest.append((length, list(stacks.most_common(1)[0][0])))
            self.longest = sorted(self.longest, key=lambda x: -x[0])[:KEEP_LONGEST]

    def report(self) -> dict:
        ms = lambda s: round(s * 1e3, 1)  # noqa: E731
        return {"stalls": len(self.stalls), "stalled_ms": ms(sum(self.stalls)), "longest_ms": ms(max(self.stalls, default=0)),
                "inclusive_ms": {f: ms(s) for f, s in self.inclusive.most_common()},
                "top_ms": {f: ms(s) for f, s in self.top.most_common()},
                "longest": [{"ms": ms(n), "stack": stack} for n, stack in self.longest]}

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(self.report(), indent=1))
            tmp.replace(self.path)
        except OSError:
            pass  # a diagnostic: never the controller's failure
