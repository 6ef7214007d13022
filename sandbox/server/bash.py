"""Persistent bash sessions on a pseudo-terminal, inside the sandbox: one `BashSession` per session name.

Where it sits: `server.main.Server` starts commands here; each command's output goes through
`server.output.Capture`, and a command past its timeout is stopped by `server.stopping`.
"""
from __future__ import annotations

import os
import select
import threading
import time

from .first_bash import spawn_bash
from .output import Capture
from .procs import boot_ticks, last_pid

START_LINE = "printf '\\036RS%s\\036' \"$__rd_t\"\n"
PS1 = "\x1eRD${__rd_t}:$?\x1e"


class SessionDead(Exception):
    """The bash process of this session has exited."""


def _rewrite(path: str, data: bytes) -> None:
    """Replace the content of the file at `path` (created, with its directory, if missing)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags, 0o600)
    except FileNotFoundError:  # first use, or `rm -rf /tmp/*` by an earlier command
        parent = os.path.dirname(path)
        os.makedirs(os.path.dirname(parent), mode=0o700, exist_ok=True)  # the runtime dir: 0700 too
        os.makedirs(parent, mode=0o700, exist_ok=True)
        fd = os.open(path, flags, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def write_command_file(paths: list[str], command: str) -> str:
    """Write the command's text for bash to source, at the first of `paths` that works; returns it.

    The first choice is a tmpfs (the sandbox's /tmp): on a disk file system
    the rewrite costs far more (ext4 allocates and starts writing back a
    truncated-and-rewritten file at close, and the next truncate waits for
    that: 0.2-1.5 ms per command on a busy node, against ~10 us on tmpfs).
    If it fails (/tmp full, or removed and not re-creatable) the control
    directory is used for this command."""
    data = (START_LINE + command + ("" if command.endswith("\n") else "\n")).encode("utf-8")
    error: OSError | None = None
    for path in paths:
        try:
            _rewrite(path, data)
            return path
        except OSError as e:
            error = e
    assert error is not None
    raise error


class ShellCommand:
    """A command begun by `BashSession.start`: nobody waits for it; its result is
    handed to `on_done` exactly once, by whoever claims it first (the pty reader
    at the prompt, `kill`, or the deadline through `expire` + `complete`)."""

    __slots__ = ("cap", "start", "on_done", "claimed")

    def __init__(self, on_done) -> None:
        self.cap: Capture | None = None
        self.start = 0.0
        self.on_done = on_done  # on_done(produce): produce() returns the result dict (or raises)
        self.claimed = False


class BashSession:
    """One named, persistent bash on a pty. Thread-safe; one command at a time.

    The server's connection thread begins a command with `start` when the session is idle (the
    pty's reader thread then hands the result over as soon as the prompt is back: no thread waits
    per command); its request threads call `run` (session busy), `send_input` and `interrupt`.
    The pty comes from `first_bash.spawn_bash` (``os.forkpty``: stdlib only, the server starts in ms).

    bash runs interactive on a pty (``--noediting``: no readline, so no bracketed
    paste or line-editing escapes; the tty does not echo). Its prompt is a marker
    ``\\x1eRD<tag>:<$?>\\x1e`` where ``<tag>`` is the value of ``$__rd_t``. For
    each command the server writes the command text to a file and types one short
    line, ``__rd_t=<fresh tag>; . <file>``: the command runs in the session's own
    shell (so ``cd``, variables and functions persist), may span many lines or be
    longer than the tty's 4 KiB line limit, and ends exactly when the prompt with
    *that* tag appears. A command that prints a marker-looking string cannot end
    itself early: it would have to know the fresh random tag. Output that does not
    end a line is fine: the marker is searched anywhere in the byte stream.
    """

    def __init__(
        self,
        name: str,
        cwd: str,
        env: dict[str, str],
        cmd_dir: str,
        rlimits: dict,
        adopt: tuple[int, int] | None = None,
        fallback_cmd_dir: str | None = None,
        landlock: int | None = None,
    ) -> None:
        self.name = name
        # where each command's text goes: `cmd_dir` (a tmpfs), else `fallback_cmd_dir`
        self._cmd_files = [os.path.join(d, f"{name}.sh") for d in (cmd_dir, fallback_cmd_dir) if d]
        self._secret = os.urandom(4).hex()
        self._seq = 0
        self._lock = threading.Lock()  # serialises commands
        self.cond = threading.Condition()  # guards capture / dead
        self.capture: Capture | None = None
        self._job: ShellCommand | None = None  # the running command, when begun by `start`
        self.start_waiters = 0  # interrupts waiting for the command to start
        self.dead = False
        if adopt is None:
            adopt = spawn_bash(cwd, env, rlimits, landlock)
        self.pid, self.fd = adopt  # `adopt`: a bash started early by server/first_bash.py
        self.exit_status: int | None = None
        self._reaped = threading.Lock()
        os.set_blocking(self.fd, False)
        threading.Thread(target=self._read_loop, name=f"pty-{name}", daemon=True).start()
        init = (
            "unset HISTFILE PROMPT_COMMAND; set +o history; "
            f"PS2=''; PS1='{PS1}'"
        )
        result = self._run_line(init, timeout=10.0, max_output=4096)
        if result["exit_code"] is None:
            self.kill()
            raise SessionDead(f"bash did not start: {result['output'][-500:]!r}")

    # -- public operations -------------------------------------------------

    def run(self, command: str, timeout: float, max_output: int) -> dict:
        """Run one command to its end (or timeout); waits while another command runs."""
        self._lock.acquire()
        try:
            path = write_command_file(self._cmd_files, command)
            started = self._begin(f". '{path}'", max_output)
        except BaseException:
            self._lock.release()
            raise
        return self.finish(started, timeout)

    def start(self, command: str, max_output: int, on_done) -> ShellCommand | None:
        """Begin `command` now if the session is idle, and return without waiting.

        The result goes to ``on_done(produce)`` (``produce()`` returns the
        result dict, like `run`): from the pty reader thread as soon as the
        prompt is back (no hand-off to a waiting thread), or from `kill`, or
        from `complete` once the caller's deadline has passed and `expire`
        said the command still runs (`complete` then escalates, like `run`'s
        timeout). None when another command is running; then use `run`.

        Used by the server's connection thread, which thus types the command
        line before it reads the next request on the same connection (a
        ``send_input`` or ``interrupt`` sent right after the ``bash``).
        """
        if not self._lock.acquire(blocking=False):
            return None
        job = ShellCommand(on_done)
        try:
            path = write_command_file(self._cmd_files, command)
            self._begin(f". '{path}'", max_output, job)
        except BaseException:
            with self.cond:
                mine = not job.claimed
                job.claimed = True
                if self._job is job:
                    self._job = None
            if mine:
                self._lock.release()
                raise
            # the session ended while the line was typed and its end claimed the
            # job: `on_done` has the result (session_ended)
        return job

    def expire(self, job: ShellCommand) -> bool:
        """`job`'s deadline has passed: True if it still runs; the caller must then
        call `complete(job)` on a thread that may block (it escalates)."""
        with self.cond:
            if job.claimed:
                return False
            job.claimed = True
            if self._job is job:
                self._job = None
            return True

    def complete(self, job: ShellCommand) -> None:
        """Finish a claimed job (escalating if it still runs) and hand over its result."""
        cap, start = job.cap, job.start
        job.cap = None  # a deadline entry may outlive the job: do not keep its output alive
        try:
            job.on_done(lambda: self.finish((cap, start), 0.0))
        except Exception:  # noqa: BLE001 - on_done reports; the reader thread must live on
            pass

    def _claim(self) -> ShellCommand | None:
        """With `cond` held: take the running job, unless someone has."""
        job = self._job
        if job is None or job.claimed:
            return None
        job.claimed = True
        self._job = None
        return job

    def send_input(self, text: str) -> None:
        self.write(text.encode())

    def interrupt(self) -> None:
        """Ctrl-C, once the terminal's foreground is in a stable state (`stopping.interrupt`)."""
        from . import stopping  # off the server's start path, like every use of it here

        stopping.interrupt(self)

    def foreground(self) -> int:
        """The terminal's foreground process group (-1: unknown)."""
        try:
            return os.tcgetpgrp(self.fd)
        except OSError:
            return -1

    def kill(self) -> None:
        """Kill bash and every process of its session."""
        with self.cond:
            self.dead = True
            self.cond.notify_all()
        from . import stopping

        stopping.kill_session_processes(self)
        self._reap()
        # a started command's result, now (the pty's EOF may never come: a
        # process that left the session can hold the terminal open)
        with self.cond:
            job = self._claim()
        if job is not None:
            self.complete(job)

    # -- internals ---------------------------------------------------------

    def _run_line(self, line: str, timeout: float, max_output: int) -> dict:
        self._lock.acquire()
        try:
            started = self._begin(line, max_output)
        except BaseException:
            self._lock.release()
            raise
        return self.finish(started, timeout)

    def _begin(self, line: str, max_output: int, job: ShellCommand | None = None) -> tuple[Capture, float]:
        """With the lock held: type the line that runs a command."""
        if self.dead:
            raise SessionDead(self.name)
        self._seq += 1
        tag = f"{self._secret}{self._seq:x}"
        cap = Capture(tag, max_output)
        start = time.monotonic()
        if job is not None:
            job.cap, job.start = cap, start
        with self.cond:
            self.capture = cap
            self._job = job
        self.started_at = (last_pid(), boot_ticks())
        self.write(f" __rd_t={tag}; {line}\n".encode())
        return cap, start

    def finish(self, started: tuple[Capture, float], timeout: float) -> dict:
        """Wait for the command begun by `_begin`; releases the lock."""
        cap, start = started
        try:
            timed_out = False
            ended = False
            if not self.wait(cap, timeout) and not self.dead:
                timed_out = True
                from . import stopping

                ended = not stopping.escalate(self, cap)
                if not ended:
                    stopping.kill_leftovers_of_command(self)
            duration = time.monotonic() - start
            with self.cond:
                self.capture = None
                if not cap.done:
                    cap.flush()
            output, truncated = cap.output()
            exit_code = cap.exit_code
            if self.dead:
                ended = True
                if exit_code is None:
                    status = self.exit_status
                    exit_code = status if status is not None else -1
                output += "\n[rolloutd: the bash session ended; the next command starts a new one]"
            return {
                "output": output,
                "exit_code": exit_code,
                "duration": duration,
                "truncated": truncated,
                "timed_out": timed_out,
                "session_ended": ended,
            }
        finally:
            self._lock.release()

    def _reap(self) -> None:
        """Collect bash's exit status (once). The pty is closed by the reader
        thread alone (closing it under a blocked reader could hand its number
        to another file)."""
        with self._reaped:
            if self.exit_status is not None:
                return
            try:
                _, status = os.waitpid(self.pid, 0)
                code = os.waitstatus_to_exitcode(status)
                self.exit_status = code if code >= 0 else 128 - code
            except ChildProcessError:
                self.exit_status = -1

    def wait(self, cap: Capture, timeout: float) -> bool:
        with self.cond:
            self.cond.wait_for(lambda: cap.done or self.dead, timeout)
            return cap.done

    def write(self, data: bytes) -> None:
        while data:
            if self.dead:
                raise SessionDead(self.name)
            try:
                n = os.write(self.fd, data)
            except BlockingIOError:  # the tty's input queue is full: wait for room
                select.select([], [self.fd], [], 1.0)
                continue
            except OSError as e:
                raise SessionDead(f"{self.name}: {e}") from e
            data = data[n:]

    def _read_loop(self) -> None:
        fd = self.fd
        while True:
            try:
                select.select([fd], [], [])
                data = os.read(fd, 65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                break
            job = None
            with self.cond:
                cap = self.capture
                if cap is not None and not cap.done:
                    was_started = cap.started
                    cap.feed(data)
                    # wake a waiting thread only for what it waits for: the end,
                    # or the start when an interrupt is waiting for it
                    if cap.done or (self.start_waiters and cap.started != was_started):
                        self.cond.notify_all()
                    if cap.done:
                        job = self._claim()
            if job is not None:  # a `start`ed command: its reply goes out from here
                self.complete(job)
        # EOF: bash exited (or was killed)
        self._reap()
        try:
            os.close(fd)
        except OSError:
            pass
        with self.cond:
            self.dead = True
            self.cond.notify_all()
            job = self._claim()
        if job is not None:
            self.complete(job)
