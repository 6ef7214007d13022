"""Stopping what a bash session runs: a well-timed Ctrl-C, a timeout's escalation, the session's kill.

Where it sits: `server.bash.BashSession` calls these for `interrupt`, for a command past its
timeout (`finish`) and for `kill`; processes are found and killed through `server.procs`.

Timeouts escalate, each step followed by a short grace wait for the prompt:
Ctrl-C → SIGKILL of the terminal's foreground process group → SIGKILL of every
process in the session but bash → the session itself is killed (the next
command starts a fresh one). The session stays usable in all but the last case;
once its prompt is back, whatever the timed-out command left running in the
background (processes of the session started since it began) is killed too.
"""
from __future__ import annotations

import os
import time

from .procs import SIGKILL, all_stats, kill_until_gone

GRACE = 1.0  # seconds to wait for the prompt after each escalation step
FIGHT = 0.5  # seconds to go on killing a session's processes (fork bombs respawn)


def session_members(sid: int, since: tuple[int, int] | None = None) -> list[int]:
    """Running pids whose session id is `sid` (the processes a bash session started);
    with `since` = (last pid, boot tick) taken at some moment, only the
    processes started after it (a larger pid, not started before that tick)."""
    return [
        st.pid for st in all_stats()
        if st.sid == sid and not st.dead and (since is None or (st.pid > since[0] and st.start >= since[1]))
    ]


def interrupt(session) -> None:
    """Ctrl-C, sent when the terminal's foreground is in a stable state.

    Two windows swallow a Ctrl-C: while the command line is still in the
    tty's input queue (the line is flushed: the command never runs), and
    while a program bash just forked holds the terminal but still runs
    bash's code, before its exec (bash's handler eats the signal). So wait
    until bash has read the line, then until the foreground is either a
    program that has exec'd or bash itself for 20 ms (builtins, loops);
    after `GRACE` send anyway.
    """
    with session.cond:
        cap = session.capture
        if cap is not None:
            session.start_waiters += 1
            try:
                session.cond.wait_for(lambda: cap.started or cap.done or session.dead, GRACE)
            finally:
                session.start_waiters -= 1
    if session.dead:
        return
    if cap is not None:
        bash_exe = _exe(session.pid)
        deadline = time.monotonic() + GRACE
        bash_since = None
        while time.monotonic() < deadline and not (cap.done or session.dead):
            fg = session.foreground()
            if fg == session.pid:
                bash_since = bash_since or time.monotonic()
                if time.monotonic() - bash_since >= 0.02:
                    break
            else:
                bash_since = None
                if fg > 0 and _exe(fg) not in (bash_exe, None):
                    break
            with session.cond:
                session.cond.wait_for(lambda: cap.done or session.dead, 0.002)
        if cap.done or session.dead:
            return
    session.write(b"\x03")


def escalate(session, cap) -> bool:
    """Stop a command past its timeout. True when the session survived."""
    session.interrupt()
    if session.wait(cap, GRACE):
        return True
    fg = session.foreground()
    if fg > 0 and fg != session.pid:
        try:
            os.killpg(fg, SIGKILL)
        except ProcessLookupError:
            pass
        if session.wait(cap, GRACE):
            return True
    kill_until_gone(lambda: [p for p in session_members(session.pid) if p != session.pid], timeout=FIGHT)
    if session.wait(cap, GRACE):
        return True
    session.kill()
    return False


def kill_leftovers_of_command(session) -> None:
    """After a timed-out command: kill what it started in the background too
    (every process of the session started since the command began; e.g. a
    fork bomb's `&` jobs, which would otherwise hold the process limit).
    Processes from earlier commands are left alone."""
    since = session.started_at
    kill_until_gone(lambda: [p for p in session_members(session.pid, since) if p != session.pid], timeout=FIGHT)


def kill_session_processes(session) -> None:
    """SIGKILL bash and every process of its session."""
    kill_until_gone(lambda: session_members(session.pid), timeout=0.2, pause=0.01)
    try:
        os.kill(session.pid, SIGKILL)
    except ProcessLookupError:
        pass


def _exe(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None
