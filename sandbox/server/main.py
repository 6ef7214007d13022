"""The in-sandbox execution server: bash sessions, an IPython kernel and files over a Unix socket.

Where it sits: every runtime (`bwrap.py`, `apptainer.py`, `process.py`)
starts this as the sandbox's first process with `launch_command()`'s command
line; the node side talks to it through `rolloutd.sandbox.client.ExecClient`.
It imports only the standard library (jupyter_client on the first IPython cell),
and runs with ``python -S`` from a bare ``server`` package on ``sys.path``:
importing asyncio or pydantic would cost more than the whole 50 ms start
budget. Concurrency is therefore plain threads: one per connection, one
reader per pty, reused workers for long requests (ipython, a bash whose
session is busy, a timeout's escalation) and one for bash timeouts. A bash
command on an idle session is typed by the connection thread and answered by
its pty's reader when the prompt is back (no hand-off between threads: about
3 context switches per command instead of 10).

Wire protocol: requests are length-prefixed marshal dicts (node → server:
trusted, and marshal is builtin), replies are JSON lines (server → node: a
sandbox is untrusted, so the node parses its replies with json, never marshal)::

    → {"id": 7, "op": "bash", "command": "ls", "session": "default", "timeout": 30}
    ← {"id": 7, "result": {...}}   or   {"id": 7, "error": {"type": "ExecError", "message": "..."}}

Neither json nor socket nor re is imported on the start path (they pull in
enum, functools, collections: more than the whole start budget on a busy node).

Replies carry the request's id and may come back out of order (a ``send_input``
is answered while the ``bash`` it feeds is still running). Operations:
``bash``, ``send_input``, ``interrupt``, ``close_session``, ``ipython``,
``ipython_interrupt``, ``read_file``, ``write_file``, ``edit_file``,
``list_dir``, ``health``, ``shutdown``.

Start-up: it binds the socket (mode 0600, in the 0700 control directory bound
into the sandbox), adopts the default bash session (forked by the launcher,
see `early.py`) and writes ``READY <pid>`` on stdout, which is what the node
side waits for. It accepts exactly one connection, then removes the socket.
It exits when its client disconnects, on ``shutdown``, or at ``wall_seconds``;
it then kills every process it started, by process session.
"""
from __future__ import annotations

import marshal
import os
import sys
import threading
import time
from _json import encode_basestring_ascii as encode_string
from _queue import SimpleQueue

import _socket  # not `socket`: it imports enum

from .bash import BashSession, SessionDead
from .early import apply_limits, undumpable
from .files import FileOpError, edit_file, list_dir, read_file, write_file

SESSION_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
DEFAULT_MAX_OUTPUT = 16384


class ExecError(Exception):
    """Returned to the client as an ExecError: the request, not the sandbox, failed."""


def read_frames(conn):
    """Requests: a 4-byte big-endian length, then a marshal payload (from the node,
    trusted; marshal is builtin, json would import re and enum)."""
    buf = bytearray()
    while True:
        while len(buf) >= 4:
            n = int.from_bytes(buf[:4], "big")
            if len(buf) < 4 + n:
                break
            payload = bytes(buf[4 : 4 + n])
            del buf[: 4 + n]
            try:
                yield marshal.loads(payload)
            except (ValueError, EOFError, TypeError):
                continue
        try:
            data = conn.recv(1 << 20)
        except OSError:
            return
        if not data:
            return
        buf += data


def to_json(obj) -> str:
    """Replies are JSON lines: the node parses what comes out of a sandbox with a
    safe parser (never marshal). Strings are escaped to ASCII, so a reply holds
    no raw newline; non-finite floats become null."""
    if obj is None:
        return "null"
    if obj is True:
        return "true"
    if obj is False:
        return "false"
    if isinstance(obj, str):
        return encode_string(obj)
    if isinstance(obj, int):
        return int.__repr__(obj)
    if isinstance(obj, float):
        return float.__repr__(obj) if obj == obj and obj not in (float("inf"), float("-inf")) else "null"
    if isinstance(obj, dict):
        return "{" + ",".join(encode_string(str(k)) + ":" + to_json(v) for k, v in obj.items()) + "}"
    if isinstance(obj, (list, tuple)):
        return "[" + ",".join(to_json(v) for v in obj) + "]"
    return encode_string(str(obj))


def valid_session_name(name: str) -> bool:
    return isinstance(name, str) and 0 < len(name) <= 64 and all(c in SESSION_CHARS for c in name)


def reply_to(rid, call) -> dict:
    """The reply to request `rid`: what `call()` returns, or the error it raises —
    `ExecError` for the request's own failure (the node shows it to the agent),
    `ServerError` for anything else (the node treats it as infrastructure)."""
    try:
        return {"id": rid, "result": call()}
    except (ExecError, FileOpError) as e:
        return {"id": rid, "error": {"type": "ExecError", "message": str(e)}}
    except Exception as e:  # noqa: BLE001 - reported, the server keeps serving
        return {"id": rid, "error": {"type": "ServerError", "message": f"{type(e).__name__}: {e}"}}


def bash_result(produce, session: str) -> dict:
    """A bash command's result dict from `produce()`; a session that ended is the request's error."""
    try:
        return produce()
    except SessionDead:
        raise ExecError(f"bash session {session!r} ended") from None


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

    def add(self, when: float, session: BashSession, job) -> None:
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


class Server:
    def __init__(self, cfg: dict) -> None:
        self.cfg = cfg
        self.workspace = cfg["workspace"]
        self.env = dict(cfg.get("env", {}))
        self.runtime_dir = cfg.get("runtime_dir") or os.path.join(cfg["ctl_dir"], "rt")
        # command files: on the sandbox's /tmp (a tmpfs under bwrap), else the control directory
        self.cmd_dir = os.path.join(self.runtime_dir, "cmd")
        self.fallback_cmd_dir = os.path.join(cfg["ctl_dir"], "cmd")
        self.started = time.monotonic()
        self.sessions: dict[str, BashSession] = {}
        self.sessions_lock = threading.Lock()
        self._kernel = None  # server.kernel is imported on the first cell (it pulls in queue, re)
        self.stopping = False
        self.exiting = False
        self.workers = Workers()
        self.deadlines = Deadlines(self.workers)

    @property
    def kernel(self):
        if self._kernel is None:
            from .kernel import IPythonKernel

            self._kernel = IPythonKernel(self.workspace, self.env, self.runtime_dir, self._preexec)
        return self._kernel

    def _preexec(self) -> None:
        """Runs in each child (bash, kernel) before exec: the spec's rlimits, SIGPIPE default."""
        apply_limits(self.cfg.get("rlimits") or {})

    # -- bash --------------------------------------------------------------

    def session(self, name: str, create: bool = True, adopt: tuple[int, int] | None = None) -> BashSession | None:
        if not valid_session_name(name):
            raise ExecError(f"bad session name {name!r}: use 1-64 of [A-Za-z0-9_.-]")
        with self.sessions_lock:
            s = self.sessions.get(name)
            if s is not None and s.dead:
                s.kill()
                s = None
                del self.sessions[name]
            if s is None and create:
                try:
                    s = BashSession(
                        name, self.workspace, self.env, self.cmd_dir, self.cfg.get("rlimits") or {}, adopt,
                        fallback_cmd_dir=self.fallback_cmd_dir,
                    )
                except (OSError, SessionDead) as e:
                    raise ExecError(f"cannot start bash session {name!r}: {e}") from None
                self.sessions[name] = s
            return s

    def op_bash(self, command: str, session: str = "default", timeout: float = 30.0,
                max_output: int = DEFAULT_MAX_OUTPUT) -> dict:
        """A command whose session was busy (or a request `start_bash` left to
        `dispatch`): waits on a worker thread for the session, then for the command."""
        return bash_result(lambda: self.session(session).run(command, float(timeout), int(max_output)), session)

    BASH_FIELDS = frozenset({"id", "op", "command", "session", "timeout", "max_output"})

    def start_bash(self, req: dict, send) -> bool:
        """On the connection thread: start the command now if its session is idle.

        No thread waits for it: the pty reader sends the reply when the prompt
        is back (`BashSession.start`), and `Deadlines` hands it to a worker if
        the timeout passes first. The command line reaches the terminal before
        any later request on the same connection (a ``send_input`` sent right
        after a ``bash``) is read. False: `dispatch` on a worker handles the
        request (session busy, or a request to report an error for).
        """
        if not req.keys() <= self.BASH_FIELDS or not isinstance(req.get("command"), str):
            return False
        name = req.get("session", "default")
        try:
            timeout = float(req.get("timeout", 30.0))
            max_output = int(req.get("max_output", DEFAULT_MAX_OUTPUT))
            if timeout != timeout:  # NaN
                return False
            s = self.session(name)
        except (ExecError, TypeError, ValueError, OverflowError):
            return False
        try:
            self.deadlines.start()
        except RuntimeError:
            return False
        rid = req.get("id")

        def on_done(produce) -> None:
            send(reply_to(rid, lambda: bash_result(produce, name)))

        try:
            job = s.start(req["command"], max_output, on_done)
        except (SessionDead, OSError, ValueError):
            return False  # op_bash reports it
        if job is None:
            return False
        if timeout != float("inf"):
            self.deadlines.add(job.start + timeout, s, job)
        return True

    def op_send_input(self, text: str, session: str = "default") -> dict:
        s = self.session(session, create=False)
        if s is None:
            raise ExecError(f"no bash session {session!r}")
        try:
            s.send_input(text)
        except SessionDead:
            raise ExecError(f"bash session {session!r} ended") from None
        return {}

    def op_interrupt(self, session: str = "default") -> dict:
        s = self.session(session, create=False)
        if s is not None and not s.dead:
            s.interrupt()
        return {}

    def op_close_session(self, session: str = "default") -> dict:
        with self.sessions_lock:
            s = self.sessions.pop(session, None)
        if s is not None:
            s.kill()
        return {}

    # -- ipython -----------------------------------------------------------

    def op_ipython(self, code: str, timeout: float = 30.0) -> dict:
        try:
            return self.kernel.execute(code, float(timeout))
        except ImportError as e:
            raise ExecError(f"IPython is not available in this sandbox: {e}") from None
        except RuntimeError as e:
            raise ExecError(f"the IPython kernel did not start: {e}") from None

    def op_ipython_interrupt(self) -> dict:
        if self._kernel is not None:
            self._kernel.interrupt()
        return {}

    # -- files -------------------------------------------------------------

    def op_read_file(self, path: str, start_line: int | None = None, end_line: int | None = None) -> dict:
        return read_file(self.workspace, path, start_line, end_line)

    def op_write_file(self, path: str, content: str) -> dict:
        return write_file(self.workspace, path, content)

    def op_edit_file(self, path: str, old: str, new: str) -> dict:
        return edit_file(self.workspace, path, old, new)

    def op_list_dir(self, path: str = ".") -> dict:
        return list_dir(self.workspace, path)

    # -- lifecycle ---------------------------------------------------------

    def op_health(self) -> dict:
        with self.sessions_lock:
            sessions = sorted(n for n, s in self.sessions.items() if not s.dead)
        return {
            "pid": os.getpid(),
            "uptime": time.monotonic() - self.started,
            "sessions": sessions,
            "kernel": self._kernel is not None and self._kernel.running,
        }

    def op_shutdown(self) -> dict:
        self.stop_children()
        return {}

    def known_children(self) -> set[int]:
        with self.sessions_lock:
            pids = {s.pid for s in self.sessions.values()}
        km = self._kernel.km if self._kernel is not None else None
        if km is not None and getattr(km, "provisioner", None) is not None:
            pid = getattr(km.provisioner, "pid", None)
            if pid:
                pids.add(pid)
        return pids

    def reap_orphans(self) -> None:
        """As the pid namespace's init, reap orphaned zombies (not our own
        children: the sessions and jupyter_client wait for those themselves)."""
        while not self.exiting:
            time.sleep(0.5)
            mine = self.known_children()
            for entry in os.listdir("/proc"):
                if not entry.isdigit() or int(entry) in mine:
                    continue
                try:
                    with open(f"/proc/{entry}/stat", "rb") as f:
                        stat = f.read()
                except OSError:
                    continue
                fields = stat[stat.rfind(b")") + 2 :].split()
                if fields[0] == b"Z" and int(fields[1]) == os.getpid():
                    try:
                        os.waitpid(int(entry), os.WNOHANG)
                    except ChildProcessError:
                        pass

    def stop_children(self) -> None:
        self.stopping = True
        with self.sessions_lock:
            sessions = list(self.sessions.values())
            self.sessions.clear()
        for s in sessions:
            s.kill()
        if self._kernel is not None:
            self._kernel.shutdown()

    # -- transport ---------------------------------------------------------

    LONG_OPS = {"bash", "ipython", "shutdown", "interrupt"}

    def dispatch(self, req: dict) -> dict:
        rid = req.pop("id", None)
        op = req.pop("op", None)
        fn = getattr(self, f"op_{op}", None) if isinstance(op, str) else None

        def call():
            if fn is None:
                raise ExecError(f"unknown op {op!r}")
            try:
                return fn(**req)
            except TypeError as e:
                raise ExecError(f"bad request for {op}: {e}") from None

        return reply_to(rid, call)

    def serve_connection(self, conn) -> None:
        lock = threading.Lock()

        def send(resp: dict, op: str | None = None) -> None:
            if self.exiting and op != "shutdown":
                return  # results cut short by the exit (wall time) must not look normal
            data = to_json(resp).encode() + b"\n"
            with lock:
                try:
                    conn.sendall(data)
                except OSError:
                    pass

        def reply(req: dict) -> None:
            op = req.get("op")
            send(self.dispatch(req), op)
            if op == "shutdown":
                self.exit(0)

        for req in read_frames(conn):
            if not isinstance(req, dict):
                continue
            if req.get("op") == "bash" and self.start_bash(req, send):
                continue
            if req.get("op") in self.LONG_OPS:
                self.workers.submit(reply, req)
            else:
                reply(req)
        # the node side hung up: nobody can reach this sandbox any more
        self.exit(0)

    def exit(self, code: int) -> None:
        self.exiting = True
        try:
            self.stop_children()
        finally:
            os._exit(code)


def main(cfg: dict, early_bash: tuple[int, int] | None = None) -> None:
    undumpable(cfg)  # before READY: no sandboxed code runs before the node's first request
    server = Server(cfg)
    os.makedirs(cfg["ctl_dir"], mode=0o700, exist_ok=True)
    sock_path = cfg["socket"]
    try:
        os.unlink(sock_path)
    except FileNotFoundError:
        pass
    listener = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        listener.bind(sock_path)
    finally:
        os.umask(old)
    os.chmod(sock_path, 0o600)
    listener.listen(8)

    def warm() -> None:  # the first command should not pay for bash's start
        try:
            server.session("default", adopt=early_bash)
        except ExecError:
            pass

    home = server.env.get("HOME")
    if home:
        try:
            os.makedirs(home, exist_ok=True)
        except OSError:
            pass
    threading.Thread(target=warm, daemon=True).start()
    if os.getpid() == 1:
        threading.Thread(target=server.reap_orphans, daemon=True).start()
    wall = cfg.get("wall_seconds")
    if wall:
        timer = threading.Timer(float(wall), server.exit, args=(124,))
        timer.daemon = True
        timer.start()
    os.write(1, f"READY {os.getpid()}\n".encode())
    # exactly one client, the node that started us (it connects before any user
    # code runs): then the socket is gone, so code inside the sandbox can neither
    # drive the server nor end the sandbox by connecting and hanging up
    fd, _ = listener._accept()
    conn = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM, 0, fd)
    listener.close()
    os.unlink(sock_path)
    server.serve_connection(conn)


if __name__ == "__main__":  # pragma: no cover - started through launch_command
    main(marshal.loads(bytes.fromhex(sys.argv[1])))  # no early bash: the server starts it itself
