"""The one core of the trainer clients' loops: resumable streams with retry and back-off, waits on a
job's condition, long-polls for a batch, groups assembled from trajectories. State and decisions only;
`sync.RolloutClient` and `aio.AsyncRolloutClient` each drive them with a few lines of their own I/O.

A stream (`WatchStream`, `TrajectoryStream`) says which request to (re)open next (`next_call`; None
once its deadline passed), what each line yields (`feed`), whether a clean end is the end (`final`; None:
only once the job ended, which the client checks), and how long to back off after a failure (`failed`,
from its `retry.Retry`: the error once the client's `retry_for` or the stream's deadline is spent).
"""
from __future__ import annotations

import json
import time
from typing import Any

from rolloutd.crds.names import TERMINAL_PHASES

from .calls import POLL_SLICE_SECONDS, Call, Calls, trajectory_line
from .errors import JobEnded, WaitTimeout
from .retry import Retry


def deadline_after(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def time_left(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()


class SSEParser:
    """Line-at-a-time SSE parsing (shared by the sync and async watch loops)."""

    def __init__(self) -> None:
        self.event, self.data, self.id = "message", [], None

    def feed(self, line: str) -> tuple[str, dict[str, Any], str | None] | None:
        if line == "":
            out = (self.event, json.loads("\n".join(self.data)), self.id) if self.data else None
            self.event, self.data = "message", []
            return out
        if line.startswith(":"):
            return None
        key, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if key == "event":
            self.event = value
        elif key == "data":
            self.data.append(value)
        elif key == "id":
            self.id = value
        return None


class Stream:
    """A server stream resumed after drops until its deadline; subclasses say what a line means."""

    what = "the stream"
    # a clean end of the response ends the stream (False: reconnect until the deadline; None: end only if the
    # job ended, else the controller stopped mid-stream and the stream resumes from the one that comes back)
    final: bool | None = True

    def __init__(self, timeout: float | None, retry_backoff: float, server: str = "",
                 retry_for: float | None = None):
        self.deadline = deadline_after(timeout)
        self.retry = Retry(server, retry_for, self.deadline, initial=retry_backoff)
        self.resumed = False  # a response was open before: this is a reconnection

    def next_call(self) -> Call | None:
        left = time_left(self.deadline)
        if left is not None and left <= 0:
            return None
        return self.call(left)

    def call(self, left: float | None) -> Call:
        raise NotImplementedError

    def opened(self) -> None:
        """A response started (its status was fine)."""
        self.resumed = True

    def feed(self, line: str) -> Any:
        """What `line` yields to the caller, or None."""
        raise NotImplementedError

    def failed(self, e: Exception, retry_after: str | None = None) -> float:
        """The delay before reconnecting after `e` (a transport error, a torn line, a 502/503/504), or `e` raised
        (as `ConnectionFailed` for a transport error) once retrying is over."""
        return self.retry.after(e, True, retry_after)


class WatchStream(Stream):
    """`watch`: (type, object, resourceVersion) per change, resumed from the last version seen."""

    what = "the watch stream"
    final = False  # the server ends a watch (restart, its timeout): reconnect from `last`

    def __init__(self, name: str | None, namespace: str, since: str | None, timeout: float | None,
                 retry_backoff: float, server: str = "", retry_for: float | None = None):
        super().__init__(timeout, retry_backoff, server, retry_for)
        self.name, self.namespace, self.last = name, namespace, since
        self.parser = SSEParser()

    def call(self, left: float | None) -> Call:
        return Calls.watch(self.name, self.namespace, self.last, left)

    def opened(self) -> None:
        super().opened()
        self.parser = SSEParser()

    def feed(self, line: str) -> tuple[str, dict[str, Any], str | None] | None:
        ev = self.parser.feed(line)
        if ev is None:
            return None
        self.retry.ok()
        self.last = ev[2] or self.last
        return None if ev[0] == "BOOKMARK" else ev


class TrajectoryStream(Stream):
    """`trajectories(follow=True)`: each trajectory once, resumed after the last `seq` received."""

    what = "the trajectory stream"
    final = None  # the server ends it when the job ended and all was sent, or when it stops (a restart)

    def __init__(self, name: str, cursor: int, timeout: float | None, retry_backoff: float, server: str = "",
                 retry_for: float | None = None):
        super().__init__(timeout, retry_backoff, server, retry_for)
        self.name, self.cursor = name, cursor

    def call(self, left: float | None) -> Call:
        return Calls.follow(self.name, self.cursor, left)

    def feed(self, line: str) -> dict[str, Any] | None:
        t = trajectory_line(line)
        if t is not None:
            self.retry.ok()
            self.cursor = t["seq"]
        return t


def job_over(obj: dict[str, Any] | None) -> bool:
    """Whether a job (None: deleted) has ended: a trajectory stream that ended cleanly is then complete."""
    return obj is None or (obj.get("status") or {}).get("phase") in TERMINAL_PHASES


def condition_met(obj: dict[str, Any], condition: str) -> tuple[bool, str | None]:
    """(met, why it never will be). `condition`: a condition type (`Complete`, `Provisioned`, …,
    met when its status is True) or `phase=PHASE`."""
    st = obj.get("status") or {}
    phase = st.get("phase", "Pending")
    if condition.lower().startswith("phase="):
        want = condition.split("=", 1)[1]
        if phase.lower() == want.lower():
            return True, None
    else:
        ctype, _, value = condition.partition("=")
        value = value or "True"
        cond = next((c for c in st.get("conditions", []) if c.get("type", "").lower() == ctype.lower()), None)
        if cond and str(cond.get("status", "")).lower() == value.lower():
            return True, None
    if phase in TERMINAL_PHASES:
        why = next((c.get("message") for c in st.get("conditions", []) if c.get("type") == "Complete"), "") \
            or st.get("message", "")
        return False, f"job ended {phase}" + (f": {why}" if why else "")
    return False, None


class JobWait:
    """`wait`'s decisions on each state of the job seen: met (return it), never (`JobEnded`), or watch on."""

    def __init__(self, name: str, condition: str, timeout: float | None):
        self.name, self.condition, self.timeout = name, condition, timeout

    def met(self, obj: dict[str, Any], type_: str = "MODIFIED") -> bool:
        if type_ == "DELETED":
            raise JobEnded(f"rolloutjob {self.name} was deleted", obj)
        ok, never = condition_met(obj, self.condition)
        if never and not ok:
            raise JobEnded(f"rolloutjob {self.name}: {never}", obj)
        return ok

    def timed_out(self, obj: dict[str, Any]) -> WaitTimeout:
        return WaitTimeout(f"timed out after {self.timeout:g}s waiting for {self.condition} on rolloutjob/{self.name}",
                           obj)


class BatchPoll:
    """`batch(wait=True)`: long-polls cut into slices until the batch is complete or the deadline passed."""

    def __init__(self, name: str, k: int, wait: bool, timeout: float | None, all_groups: bool):
        self.name, self.k, self.wait, self.all_groups = name, k, wait, all_groups
        self.deadline = deadline_after(timeout)

    def call(self) -> Call:
        left = time_left(self.deadline)
        slice_ = POLL_SLICE_SECONDS if left is None else min(POLL_SLICE_SECONDS, max(left, 0.0))
        return Calls.batch(self.name, self.k, self.wait, slice_, self.all_groups)

    def done(self, batch: Any) -> bool:
        return not self.wait or batch.complete or (self.deadline is not None and time.monotonic() >= self.deadline)


def unfilled(name: str, k: int, batch: Any, timeout: float | None) -> WaitTimeout:
    """`next_batch`'s error when batch `k` did not fill in time (`.last`: the partial batch)."""
    return WaitTimeout(f"batch {k} of rolloutjob {name}: {batch.counted}/{batch.target} groups after {timeout:g}s",
                       batch)


def still_exists(name: str, obj: dict[str, Any], timeout: float | None) -> WaitTimeout:
    return WaitTimeout(f"rolloutjob {name} still exists after {timeout:g}s", obj)


class GroupAssembler:
    """Trajectories in, whole groups out: a group is yielded once all `samples` of it arrived
    (keyed by the trajectory's `group` id when the server sends one, else by its prompt)."""

    def __init__(self, samples: int):
        self.samples = samples
        self.open: dict[Any, list[dict[str, Any]]] = {}

    def add(self, t: dict[str, Any]):
        from .batch import Group

        key = t.get("group", t.get("prompt"))
        got = self.open.setdefault(key, [])
        got.append(t)
        if len(got) < self.samples:
            return None
        del self.open[key]
        got.sort(key=lambda s: s.get("sample", 0))
        return Group(group=key, prompt=t.get("prompt", -1), samples=got, rewards=[s.get("reward") for s in got],
                     state="complete")
