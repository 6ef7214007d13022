"""A persistent IPython kernel inside the sandbox: a child process running `ipyrunner`, JSON lines over two pipes.

Where it sits: the in-sandbox execution server (`server/main.py`) owns one
`IPythonKernel` and calls `execute` / `interrupt` from its request threads.
The kernel starts lazily on the first cell (the agent's first ``ipython`` call;
a sandbox whose agent never uses it never pays for one). No ZeroMQ and no
jupyter_client: the server imports nothing third-party, the kernel only IPython
(see `ipyrunner`), and no socket is opened.

A cell past its timeout is interrupted (SIGINT to the kernel's process group);
if the kernel is still busy after a grace period it is killed and restarted and
the result says so (its state is lost). A kernel that dies (``os._exit``, the
memory limit) is reported in the cell's error and restarted on the next cell.
Next step: kernels forked from a per-node template (bench/bench_density.py).
"""
from __future__ import annotations

import fcntl
import os
import select
import sys
import threading
import time

import _json  # not json: it imports re and enum (~0.6 MB in every sandbox that runs a cell)

from .wire import to_json

GRACE = 3.0
SIGINT, SIGKILL = 2, 9  # not `signal`: it imports enum
RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ipyrunner.py")
REQUEST_FD, REPLY_FD = 3, 4  # in the kernel (ipyrunner.REQUESTS, REPLIES)


class KernelDied(Exception):
    pass


class _Plain:
    """What `_json`'s scanner asks of a decoder: JSON's own types, NaN and Infinity as null."""

    strict = True
    object_hook = object_pairs_hook = None
    parse_float, parse_int = float, int
    parse_constant = staticmethod(lambda name: None)


_scan = _json.make_scanner(_Plain())


def parse_reply(line: bytes) -> dict:
    """One reply line of the kernel (the agent's own process: untrusted) as a dict; KernelDied if it is not one."""
    try:
        text = line.decode("utf-8")
        obj, end = _scan(text, 0)
    except (UnicodeDecodeError, StopIteration, ValueError, RecursionError):
        raise KernelDied("the kernel sent a malformed reply") from None
    if not isinstance(obj, dict) or text[end:].strip():
        raise KernelDied("the kernel sent a malformed reply")
    return obj


class IPythonKernel:
    def __init__(self, cwd: str, env: dict[str, str], runtime_dir: str, preexec_fn=None) -> None:
        self.cwd = cwd
        self.env = env
        self.runtime_dir = runtime_dir
        self.preexec_fn = preexec_fn
        self.pid: int | None = None
        self._to = self._from = None  # our ends of the request and reply pipes
        self._pending = b""
        self._seq = 0  # each request's id, echoed by its reply: a reply the cell forged on fd 4 is skipped
        self._lock = threading.Lock()  # one cell at a time

    @property
    def running(self) -> bool:
        return self.pid is not None

    def _start(self) -> None:
        os.makedirs(self.runtime_dir, mode=0o700, exist_ok=True)
        env = dict(self.env)
        env.setdefault("IPYTHONDIR", os.path.join(self.runtime_dir, "ipython"))
        env.setdefault("MPLCONFIGDIR", os.path.join(self.runtime_dir, "mpl"))
        env.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
        # one malloc arena: threads a cell starts would each reserve 64 MB of address
        # space, and the kernel would not start under a small RLIMIT_AS
        env.setdefault("MALLOC_ARENA_MAX", "1")
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: the pipes at fds 3 and 4, the limits, then the sandbox's Python
            try:
                os.setsid()
                if self.preexec_fn is not None:  # first: it may use an fd of ours (the Landlock ruleset)
                    self.preexec_fn()
                high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (req_r, rep_w)]  # clear of 3 and 4
                for fd, target in zip(high, (REQUEST_FD, REPLY_FD)):
                    os.dup2(fd, target)
                null = os.open("/dev/null", os.O_RDWR)
                for target in (0, 1, 2):
                    os.dup2(null, target)
                os.closerange(REPLY_FD + 1, os.sysconf("SC_OPEN_MAX"))
                os.chdir(self.cwd)
                os.execve(sys.executable, [sys.executable, RUNNER], env)
            finally:
                os._exit(127)
        os.close(req_r)
        os.close(rep_w)
        self.pid, self._to, self._from, self._pending = pid, req_w, rep_r, b""
        try:
            hello = self._read(time.monotonic() + 60)
        except (KernelDied, TimeoutError) as e:
            self.shutdown()
            raise RuntimeError(f"the kernel did not start ({e})") from None
        if "fatal" in hello:
            self.shutdown()
            raise ImportError(hello["fatal"])

    def _read(self, deadline: float) -> dict:
        """The kernel's next reply line; TimeoutError at `deadline`, KernelDied at EOF or garbage."""
        while b"\n" not in self._pending:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([self._from], [], [], wait)[0]:
                raise TimeoutError("no reply")
            chunk = os.read(self._from, 1 << 20)
            if not chunk:
                raise KernelDied("the kernel exited")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return parse_reply(line)

    def _reply(self, seq: int, deadline: float) -> dict:
        while True:
            reply = self._read(deadline)
            if reply.get("id") == seq:
                return reply

    def shutdown(self) -> None:
        pid = self.pid  # stays in `Server.known_children` until reaped here: the orphan reaper leaves it
        to, frm, self._to, self._from = self._to, self._from, None, None
        for fd in (to, frm):
            if fd is not None:
                os.close(fd)
        if pid is not None:
            for kill in (os.killpg, os.kill):  # its process group (what `!cmd` started), then itself
                try:
                    kill(pid, SIGKILL)
                except OSError:
                    pass
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        self.pid = None

    def interrupt(self) -> None:
        pid = self.pid
        if pid is not None:
            try:
                os.killpg(pid, SIGINT)
            except OSError:
                pass

    def execute(self, code: str, timeout: float) -> dict:
        with self._lock:
            if self.pid is None or not self._alive():
                self.shutdown()
                self._start()
            return self._execute(code, timeout)

    def _alive(self) -> bool:
        """Whether the kernel still runs. Not reaped here (WNOWAIT): until `shutdown` reaps it, its pid
        (and process group id) cannot be reused by another process of the sandbox that `shutdown` would kill."""
        try:
            return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
        except ChildProcessError:
            return False

    def _execute(self, code: str, timeout: float) -> dict:
        start = time.monotonic()
        out = {"stdout": "", "stderr": "", "result": None, "error": None, "images": [],
               "timed_out": False, "kernel_restarted": False}
        self._seq += 1
        seq = self._seq
        data = memoryview((to_json({"id": seq, "code": code}) + "\n").encode())
        try:
            while data:
                data = data[os.write(self._to, data):]
            try:
                reply = self._reply(seq, start + timeout)
            except TimeoutError:
                out["timed_out"] = True
                self.interrupt()
                reply = self._reply(seq, time.monotonic() + GRACE)
        except TimeoutError:
            self.shutdown()
            self._start()
            out["kernel_restarted"] = True
            out["error"] = ("rolloutd: the cell did not stop after an interrupt; the kernel was restarted "
                            "(its state is lost)")
        except (KernelDied, OSError):
            self.shutdown()
            out["kernel_restarted"] = True
            out["error"] = "rolloutd: the kernel died (its state is lost); the next cell starts a new one"
        else:
            for key in ("stdout", "stderr", "result", "error", "images"):
                if key in reply:
                    out[key] = reply[key]
        out["duration"] = time.monotonic() - start
        return out
