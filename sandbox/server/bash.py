"""Persistent bash sessions on a pseudo-terminal, inside the sandbox.

Where it sits: the in-sandbox execution server (`server/main.py`) keeps one
`BashSession` per session name; its connection thread begins a command with
`start` when the session is idle (the pty's reader thread then hands the
result over as soon as the prompt is back: no thread waits per command), and
its request threads call `run` (session busy), `send_input` and `interrupt`.
Nothing on the node side imports this module; it is
stdlib only (the pty comes from `early.spawn_bash`, i.e. `os.forkpty`), because
the server must start in milliseconds.

How a command runs
------------------
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

Timeouts escalate, each step followed by a short grace wait for the prompt:
Ctrl-C → SIGKILL of the terminal's foreground process group → SIGKILL of every
process in the session but bash → the session itself is killed (the next
command starts a fresh one). The session stays usable in all but the last case;
once its prompt is back, whatever the timed-out command left running in the
background (processes of the session started since it began) is killed too.

Output policy (documented in the README): at most ``max_output`` bytes are
kept — the first half and the last half of the stream — with a marker line
``[... rolloutd: N bytes truncated ...]`` between them; ANSI escapes and
control characters other than tab and newline are removed, CRLF becomes LF and
a carriage-return overwrite keeps the last segment of the line.
"""
from __future__ import annotations

import os
import select
import threading
import time

from .early import SIGKILL, spawn_bash

START_LINE = "printf '\\036RS%s\\036' \"$__rd_t\"\n"
PS1 = "\x1eRD${__rd_t}:$?\x1e"
HOLD = 96  # bytes held back so that a marker split across reads is still found
GRACE = 1.0  # seconds to wait for the prompt after each escalation step
HEX = frozenset(b"0123456789abcdef")
# control characters other than tab and newline (CR is handled before)
CONTROL = dict.fromkeys([*range(0x00, 0x09), 0x0B, 0x0C, *range(0x0E, 0x20), 0x7F])

# No `re` here: importing it (with enum, functools, ...) would cost more than the
# server's whole start on a busy node. Markers and escapes are parsed by hand.


class SessionDead(Exception):
    """The bash process of this session has exited."""


def find_prompt(buf: bytes, tag: bytes) -> tuple[int, int, int] | None:
    """(start, end, exit code) of the prompt marker ``\\x1eRD<tag>:<code>\\x1e``."""
    prefix = b"\x1eRD" + tag + b":"
    at = buf.find(prefix)
    while at != -1:
        digits_at = at + len(prefix)
        end = buf.find(b"\x1e", digits_at)
        if end == -1:
            return None
        digits = buf[digits_at:end]
        if digits.isdigit() and len(digits) < 4:
            return at, end + 1, int(digits)
        at = buf.find(prefix, at + 1)
    return None


def strip_markers(raw: bytes) -> bytes:
    """Remove every marker, ours or stale (``\\x1eRD<hex>:<n>\\x1e``, ``\\x1eRS<hex>\\x1e``)."""
    if b"\x1e" not in raw:
        return raw
    out = bytearray()
    pos = 0
    while True:
        at = raw.find(b"\x1eR", pos)
        if at == -1:
            break
        end = raw.find(b"\x1e", at + 1)
        body = raw[at + 3 : end] if end != -1 else b""
        kind = raw[at + 2 : at + 3]
        head, _, code = body.partition(b":")
        ok = end != -1 and head and set(head) <= HEX and (
            (kind == b"S" and not _) or (kind == b"D" and code.isdigit())
        )
        if ok:
            out += raw[pos:at]
            pos = end + 1
        else:
            out += raw[pos : at + 1]
            pos = at + 1
    out += raw[pos:]
    return bytes(out)


def strip_ansi(text: str) -> str:
    """Remove escape sequences: CSI (colours, cursor), OSC (titles, links),
    DCS/SOS/PM/APC strings, and two-byte escapes."""
    if "\x1b" not in text:
        return text
    out = []
    pos = 0
    n = len(text)
    while True:
        at = text.find("\x1b", pos)
        if at == -1:
            out.append(text[pos:])
            return "".join(out)
        out.append(text[pos:at])
        i = at + 1
        kind = text[i] if i < n else ""
        if kind == "[":  # CSI: parameters 0x30-0x3f, intermediates 0x20-0x2f, final 0x40-0x7e
            i += 1
            while i < n and "\x30" <= text[i] <= "\x3f":
                i += 1
            while i < n and "\x20" <= text[i] <= "\x2f":
                i += 1
            pos = i + 1 if i < n and "\x40" <= text[i] <= "\x7e" else i
        elif kind == "]":  # OSC, ended by BEL or ESC \\
            bel = text.find("\x07", i)
            st = text.find("\x1b\\", i)
            ends = [e for e in ((bel, 1), (st, 2)) if e[0] != -1]
            pos = min(ends)[0] + min(ends)[1] if ends else n
        elif kind in ("P", "X", "^", "_"):  # DCS, SOS, PM, APC, ended by ESC \\
            st = text.find("\x1b\\", i)
            pos = st + 2 if st != -1 else n
        elif kind and "\x40" <= kind <= "\x5f":  # two-byte escape
            pos = i + 1
        else:
            pos = i  # a lone ESC: drop it


def clean_output(raw: bytes) -> str:
    """Bytes from the pty → text an LLM can read (see the module docstring)."""
    raw = strip_markers(raw)  # a stale prompt (e.g. after typed-ahead input) is not output
    text = raw.decode("utf-8", "replace").replace("\r\n", "\n")
    text = strip_ansi(text)
    if "\r" in text:
        lines = []
        for line in text.split("\n"):
            if "\r" in line:
                parts = [p for p in line.split("\r") if p]
                line = parts[-1] if parts else ""
            lines.append(line)
        text = "\n".join(lines)
    return text.translate(CONTROL)


class Capture:
    """Collects one command's output until its prompt marker; bounded memory."""

    def __init__(self, tag: str, max_output: int) -> None:
        self.tag = tag.encode()
        self.head_limit = max_output // 2
        self.tail_limit = max_output - self.head_limit
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0
        self.hold = b""
        self.started = False  # bash has read the command line and is running the command
        self.done = False
        self.exit_code: int | None = None

    def feed(self, data: bytes) -> None:
        buf = self.hold + data
        if not self.started:
            start = b"\x1eRS" + self.tag + b"\x1e"
            at = buf.find(start)
            if at != -1:
                buf = buf[:at] + buf[at + len(start) :]
                self.started = True
        prompt = find_prompt(buf, self.tag)
        if prompt is not None:
            self._commit(buf[: prompt[0]])
            self.hold = b""
            self.exit_code = prompt[2]
            self.done = True
            return
        if len(buf) > HOLD:
            self._commit(buf[:-HOLD])
            self.hold = buf[-HOLD:]
        else:
            self.hold = buf

    def flush(self) -> None:
        """The stream ended without a marker: keep what was held back."""
        self._commit(self.hold)
        self.hold = b""

    def _commit(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 2 * self.tail_limit + 65536:
                del self.tail[: len(self.tail) - self.tail_limit]

    def output(self) -> tuple[str, bool]:
        """(cleaned text, truncated?)"""
        kept_tail = bytes(self.tail[-self.tail_limit :]) if self.tail_limit else b""
        cut = self.total - len(self.head) - len(kept_tail)
        if cut <= 0:
            return clean_output(bytes(self.head) + bytes(self.tail)), False
        note = (
            f"\n[... rolloutd: {cut} bytes truncated; kept the first {len(self.head)} "
            f"and the last {len(kept_tail)} of {self.total} bytes ...]\n"
        )
        return clean_output(bytes(self.head)) + note + clean_output(kept_tail), True


CLK_TCK = os.sysconf("SC_CLK_TCK")


def boot_ticks() -> int:
    """Now, in the unit of a process's start time in /proc/PID/stat."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * CLK_TCK)


_last_pid_fd: int | None = None


def last_pid() -> int:
    """The last pid allocated in this pid namespace (pids only grow until they wrap).
    Read on every command: through one open file (pread, ~1.5 us; open+read+close
    cost ~17 us)."""
    global _last_pid_fd
    try:
        if _last_pid_fd is None:
            _last_pid_fd = os.open("/proc/sys/kernel/ns_last_pid", os.O_RDONLY)
        return int(os.pread(_last_pid_fd, 32, 0))
    except (OSError, ValueError):
        return 0


def _session_members(sid: int, since: tuple[int, int] | None = None) -> list[int]:
    """Pids whose session id is `sid` (the processes a bash session started);
    with `since` = (last pid, boot tick) taken at some moment, only the
    processes started after it (a larger pid, not started before that tick)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 19 and int(fields[3]) == sid:
            if since is None or (int(entry) > since[0] and int(fields[19]) >= since[1]):
                pids.append(int(entry))
    return pids


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


class Job:
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
    """One named, persistent bash on a pty. Thread-safe; one command at a time."""

    def __init__(
        self,
        name: str,
        cwd: str,
        env: dict[str, str],
        cmd_dir: str,
        rlimits: dict,
        adopt: tuple[int, int] | None = None,
        fallback_cmd_dir: str | None = None,
    ) -> None:
        self.name = name
        # where each command's text goes: `cmd_dir` (a tmpfs), else `fallback_cmd_dir`
        self._cmd_files = [os.path.join(d, f"{name}.sh") for d in (cmd_dir, fallback_cmd_dir) if d]
        self._secret = os.urandom(4).hex()
        self._seq = 0
        self._lock = threading.Lock()  # serialises commands
        self._cond = threading.Condition()  # guards _capture / dead
        self._capture: Capture | None = None
        self._job: Job | None = None  # the running command, when begun by `start`
        self._start_waiters = 0  # interrupts waiting for the command to start
        self.dead = False
        if adopt is None:
            adopt = spawn_bash(cwd, env, rlimits)
        self.pid, self.fd = adopt  # `adopt`: a bash started early by server/early.py
        self.exit_status: int | None = None
        self._reaped = threading.Lock()
        os.set_blocking(self.fd, False)
        threading.Thread(target=self._read_loop, name=f"pty-{name}", daemon=True).start()
        init = (
            "stty -onlcr 2>/dev/null; unset HISTFILE PROMPT_COMMAND; set +o history; "
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
            path = self._write_command_file(command)
            started = self._begin(f". '{path}'", max_output)
        except BaseException:
            self._lock.release()
            raise
        return self.finish(started, timeout)

    def start(self, command: str, max_output: int, on_done) -> Job | None:
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
        job = Job(on_done)
        try:
            path = self._write_command_file(command)
            self._begin(f". '{path}'", max_output, job)
        except BaseException:
            with self._cond:
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

    def expire(self, job: Job) -> bool:
        """`job`'s deadline has passed: True if it still runs; the caller must then
        call `complete(job)` on a thread that may block (it escalates)."""
        with self._cond:
            if job.claimed:
                return False
            job.claimed = True
            if self._job is job:
                self._job = None
            return True

    def complete(self, job: Job) -> None:
        """Finish a claimed job (escalating if it still runs) and hand over its result."""
        cap, start = job.cap, job.start
        job.cap = None  # a deadline entry may outlive the job: do not keep its output alive
        try:
            job.on_done(lambda: self.finish((cap, start), 0.0))
        except Exception:  # noqa: BLE001 - on_done reports; the reader thread must live on
            pass

    def _claim(self) -> Job | None:
        """With `_cond` held: take the running job, unless someone has."""
        job = self._job
        if job is None or job.claimed:
            return None
        job.claimed = True
        self._job = None
        return job

    def send_input(self, text: str) -> None:
        self._write(text.encode())

    def interrupt(self) -> None:
        """Ctrl-C, sent when the terminal's foreground is in a stable state.

        Two windows swallow a Ctrl-C: while the command line is still in the
        tty's input queue (the line is flushed: the command never runs), and
        while a program bash just forked holds the terminal but still runs
        bash's code, before its exec (bash's handler eats the signal). So wait
        until bash has read the line, then until the foreground is either a
        program that has exec'd or bash itself for 20 ms (builtins, loops);
        after `GRACE` send anyway.
        """
        with self._cond:
            cap = self._capture
            if cap is not None:
                self._start_waiters += 1
                try:
                    self._cond.wait_for(lambda: cap.started or cap.done or self.dead, GRACE)
                finally:
                    self._start_waiters -= 1
        if self.dead:
            return
        if cap is not None:
            bash_exe = self._exe(self.pid)
            deadline = time.monotonic() + GRACE
            bash_since = None
            while time.monotonic() < deadline and not (cap.done or self.dead):
                fg = self._foreground()
                if fg == self.pid:
                    bash_since = bash_since or time.monotonic()
                    if time.monotonic() - bash_since >= 0.02:
                        break
                else:
                    bash_since = None
                    if fg > 0 and self._exe(fg) not in (bash_exe, None):
                        break
                with self._cond:
                    self._cond.wait_for(lambda: cap.done or self.dead, 0.002)
            if cap.done or self.dead:
                return
        self._write(b"\x03")

    def _foreground(self) -> int:
        try:
            return os.tcgetpgrp(self.fd)
        except OSError:
            return -1

    @staticmethod
    def _exe(pid: int) -> str | None:
        try:
            return os.readlink(f"/proc/{pid}/exe")
        except OSError:
            return None

    def kill(self) -> None:
        """Kill bash and every process of its session."""
        with self._cond:
            self.dead = True
            self._cond.notify_all()
        for _ in range(20):
            members = _session_members(self.pid)
            if not members:
                break
            for pid in members:
                try:
                    os.kill(pid, SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)
        try:
            os.kill(self.pid, SIGKILL)
        except ProcessLookupError:
            pass
        self._reap()
        # a started command's result, now (the pty's EOF may never come: a
        # process that left the session can hold the terminal open)
        with self._cond:
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

    def _write_command_file(self, command: str) -> str:
        """Write the command's text for bash to source; returns the file's path.

        The first choice is a tmpfs (the sandbox's /tmp): on a disk file system
        the rewrite costs far more (ext4 allocates and starts writing back a
        truncated-and-rewritten file at close, and the next truncate waits for
        that: 0.2-1.5 ms per command on a busy node, against ~10 us on tmpfs).
        If it fails (/tmp full, or removed and not re-creatable) the control
        directory is used for this command."""
        data = (START_LINE + command + ("" if command.endswith("\n") else "\n")).encode("utf-8")
        error: OSError | None = None
        for path in self._cmd_files:
            try:
                _rewrite(path, data)
                return path
            except OSError as e:
                error = e
        assert error is not None
        raise error

    def _begin(self, line: str, max_output: int, job: Job | None = None) -> tuple[Capture, float]:
        """With the lock held: type the line that runs a command."""
        if self.dead:
            raise SessionDead(self.name)
        self._seq += 1
        tag = f"{self._secret}{self._seq:x}"
        cap = Capture(tag, max_output)
        start = time.monotonic()
        if job is not None:
            job.cap, job.start = cap, start
        with self._cond:
            self._capture = cap
            self._job = job
        self._started_at = (last_pid(), boot_ticks())
        self._write(f" __rd_t={tag}; {line}\n".encode())
        return cap, start

    def finish(self, started: tuple[Capture, float], timeout: float) -> dict:
        """Wait for the command begun by `_begin`; releases the lock."""
        cap, start = started
        try:
            timed_out = False
            ended = False
            if not self._wait(cap, timeout) and not self.dead:
                timed_out = True
                ended = not self._escalate(cap)
                if not ended:
                    self._kill_leftovers_of_command()
            duration = time.monotonic() - start
            with self._cond:
                self._capture = None
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

    def _escalate(self, cap: Capture) -> bool:
        """Stop a command past its timeout. True when the session survived."""
        self.interrupt()
        if self._wait(cap, GRACE):
            return True
        fg = self._foreground()
        if fg > 0 and fg != self.pid:
            try:
                os.killpg(fg, SIGKILL)
            except ProcessLookupError:
                pass
            if self._wait(cap, GRACE):
                return True
        for _ in range(50):  # fork bombs: repeat until nothing is left
            members = [p for p in _session_members(self.pid) if p != self.pid]
            if not members:
                break
            for pid in members:
                try:
                    os.kill(pid, SIGKILL)
                except ProcessLookupError:
                    pass
        if self._wait(cap, GRACE):
            return True
        self.kill()
        return False

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

    def _kill_leftovers_of_command(self) -> None:
        """After a timed-out command: kill what it started in the background too
        (every process of the session started since the command began; e.g. a
        fork bomb's `&` jobs, which would otherwise hold the process limit).
        Processes from earlier commands are left alone."""
        for _ in range(50):
            members = [p for p in _session_members(self.pid, self._started_at) if p != self.pid]
            if not members:
                return
            for pid in members:
                try:
                    os.kill(pid, SIGKILL)
                except ProcessLookupError:
                    pass

    def _wait(self, cap: Capture, timeout: float) -> bool:
        with self._cond:
            self._cond.wait_for(lambda: cap.done or self.dead, timeout)
            return cap.done

    def _write(self, data: bytes) -> None:
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
            with self._cond:
                cap = self._capture
                if cap is not None and not cap.done:
                    was_started = cap.started
                    cap.feed(data)
                    # wake a waiting thread only for what it waits for: the end,
                    # or the start when an interrupt is waiting for it
                    if cap.done or (self._start_waiters and cap.started != was_started):
                        self._cond.notify_all()
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
        with self._cond:
            self.dead = True
            self._cond.notify_all()
            job = self._claim()
        if job is not None:
            self.complete(job)
