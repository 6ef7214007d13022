"""The in-sandbox execution server's entry and request dispatch: `main` starts it, `Server` answers requests.

Where it sits: the launcher in `rolloutd.sandbox.launch` calls `main` as the sandbox's first process;
requests come in through `wire.read_frames` and each goes to the module that does the work
(`bash`, `kernel`, `files`), long ones on `threads.Workers`.
"""
from __future__ import annotations

import marshal
import os
import sys
import time

import _functools

if "functools" not in sys.modules:  # threading uses functools.partial alone, which the builtin _functools has:
    sys.modules["functools"] = _functools  # lent for its import, collections & co. stay out of every start (~2 ms)
    import threading
    del sys.modules["functools"]
else:
    import threading

import _socket  # not `socket`: it imports enum

from .bash import BashSession, SessionDead
from .first_bash import apply_limits, undumpable
from .procs import all_stats
from .threads import Deadlines, Workers
from .wire import RequestError, read_frames, reply_to, to_json

SESSION_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-")
DEFAULT_MAX_OUTPUT = 16384


def valid_session_name(name: str) -> bool:
    return isinstance(name, str) and 0 < len(name) <= 64 and all(c in SESSION_CHARS for c in name)


def bash_result(produce, session: str) -> dict:
    """A bash command's result dict from `produce()`; a session that ended is the request's error."""
    try:
        return produce()
    except SessionDead:
        raise RequestError(f"bash session {session!r} ended") from None


class Server:
    """Requests → operations. Stdlib only (the IPython kernel is a process of its own), run with
    ``python -S`` from a bare ``server`` package: importing asyncio or pydantic would cost more
    than the whole 50 ms start budget, and neither json nor socket nor re is imported on the start
    path (they pull in enum, functools, collections). Concurrency is therefore plain threads: one
    per connection, one reader per pty, reused workers for long requests (ipython, a bash whose
    session is busy, a timeout's escalation) and one for bash timeouts. A bash command on an idle
    session is typed by the connection thread and answered by its pty's reader when the prompt is
    back (no hand-off between threads: about 3 context switches per command instead of 10).

    Replies carry the request's id and may come back out of order (a ``send_input`` is answered
    while the ``bash`` it feeds is still running)::

        → {"id": 7, "op": "bash", "command": "ls", "session": "default", "timeout": 30}
        ← {"id": 7, "result": {...}}   or   {"id": 7, "error": {"type": "ExecError", "message": "..."}}

    Operations: the ``op_*`` methods below (``bash`` also through `start_bash`).
    """

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
        self.landlock: int | None = None  # `op_confine`: the agent's ruleset fd, and the sessions it spares
        self.exempt: frozenset[str] = frozenset()

    @property
    def kernel(self):
        if self._kernel is None:
            from .kernel import IPythonKernel

            self._kernel = IPythonKernel(self.workspace, self.env, self.runtime_dir, self._preexec)
        return self._kernel

    def _preexec(self) -> None:
        """In each child (bash, kernel) before exec: the spec's rlimits; after `op_confine`, the ruleset."""
        apply_limits(self.cfg.get("rlimits") or {})
        if self.landlock is not None:
            from .confine import enter
            enter(self.landlock)

    def op_confine(self, exempt: list[str] | None = None) -> dict:
        """Confine every session (but `exempt`) and kernel started from now on (`confine.confine_server`)."""
        from .confine import confine_server

        return confine_server(self, frozenset(exempt or ()))

    # -- bash --------------------------------------------------------------

    def session(self, name: str, create: bool = True, adopt: tuple[int, int] | None = None) -> BashSession | None:
        if not valid_session_name(name):
            raise RequestError(f"bad session name {name!r}: use 1-64 of [A-Za-z0-9_.-]")
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
                        landlock=None if name in self.exempt else self.landlock,
                    )
                except (OSError, SessionDead) as e:
                    raise RequestError(f"cannot start bash session {name!r}: {e}") from None
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
        except (RequestError, TypeError, ValueError, OverflowError):
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
            raise RequestError(f"no bash session {session!r}")
        try:
            s.send_input(text)
        except SessionDead:
            raise RequestError(f"bash session {session!r} ended") from None
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
            raise RequestError(f"IPython is not available in this sandbox: {e}") from None
        except RuntimeError as e:
            raise RequestError(f"the IPython kernel did not start: {e}") from None

    def op_ipython_interrupt(self) -> dict:
        if self._kernel is not None:
            self._kernel.interrupt()
        return {}

    # -- files -------------------------------------------------------------

    @property
    def files(self):
        """`server.files`, imported on the first file request: not on the start path."""
        from . import files

        return files

    def op_read_file(self, path: str, start_line: int | None = None, end_line: int | None = None,
                     max_bytes: int | None = None, tail: bool = False) -> dict:
        return self.files.read_file(self.workspace, path, start_line, end_line, max_bytes, tail)

    def op_write_file(self, path: str, content: str) -> dict:
        return self.files.write_file(self.workspace, path, content)

    def op_edit_file(self, path: str, old: str, new: str) -> dict:
        return self.files.edit_file(self.workspace, path, old, new)

    def op_list_dir(self, path: str = ".") -> dict:
        return self.files.list_dir(self.workspace, path)

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
        pid = self._kernel.pid if self._kernel is not None else None
        if pid:
            pids.add(pid)
        return pids

    def reap_orphans(self) -> None:
        """As the pid namespace's init, reap orphaned zombies (not our own
        children: the sessions and the kernel wait for those themselves)."""
        while not self.exiting:
            time.sleep(0.5)
            mine = self.known_children()
            me = os.getpid()
            for st in all_stats():
                if st.state == "Z" and st.ppid == me and st.pid not in mine:
                    try:
                        os.waitpid(st.pid, os.WNOHANG)
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
                raise RequestError(f"unknown op {op!r}")
            try:
                return fn(**req)
            except TypeError as e:
                raise RequestError(f"bad request for {op}: {e}") from None

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
    """Bind the socket (0600, in the 0700 control directory bound into the sandbox), adopt the
    default bash session (forked by the launcher, see `first_bash.py`) and write ``READY <pid>`` on
    stdout, which is what the node side waits for. Accept exactly one connection, then remove the
    socket. Exit when the client disconnects, on ``shutdown``, or at ``wall_seconds``, killing
    every process started, by process session."""
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
        except RequestError:
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


if __name__ == "__main__":  # pragma: no cover - started through launch.LAUNCHER
    main(marshal.loads(bytes.fromhex(sys.argv[1])))  # no early bash: the server starts it itself
