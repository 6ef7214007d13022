"""The node daemon's supervisor (agents/daemon/supervise.py) with real child processes: a crash is restarted,
exit 0 and refusals are final, too many crashes give up, SIGTERM reaches the daemon and stops the
restarts."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rolloutd.agents.daemon.supervise import EXIT_REFUSED, supervise
from support.waiting import wait_until


def child(tmp_path: Path, body: str) -> list[str]:
    """A child that appends a line to `runs` each time it starts, then runs `body` (`n` = its start number)."""
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys, time
        runs = {str(tmp_path / "runs")!r}
        with open(runs, "a") as f:
            f.write(f"{{os.getpid()}}\\n")
        n = sum(1 for _ in open(runs))
    """) + textwrap.dedent(body))
    return [sys.executable, str(script)]


def runs(tmp_path: Path) -> int:
    path = tmp_path / "runs"
    return len(path.read_text().split()) if path.exists() else 0


def test_a_crashed_daemon_is_started_again_until_it_ends_cleanly(tmp_path, capfd):
    argv = child(tmp_path, """
        if n == 1: raise SystemExit(1)          # an exception
        if n == 2: os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer
        sys.exit(0)                             # the job is done
    """)
    assert supervise(argv, restarts=5, backoff=0.01) == 0
    assert runs(tmp_path) == 3
    err = capfd.readouterr().err
    assert "exited with code 1" in err and "exited with signal SIGKILL" in err


def test_exit_0_and_a_refusal_are_final(tmp_path):
    assert supervise(child(tmp_path, f"sys.exit({EXIT_REFUSED})"), restarts=5, backoff=0.01) == EXIT_REFUSED
    assert runs(tmp_path) == 1


def test_too_many_crashes_in_the_window_give_up_with_the_last_code(tmp_path, capfd):
    assert supervise(child(tmp_path, "sys.exit(3)"), restarts=2, window=60, backoff=0.01) == 3
    assert runs(tmp_path) == 3  # the first run and two restarts
    assert "crashed 3 times within 60s" in capfd.readouterr().err


@pytest.mark.parametrize("to_whom", ["group", "supervisor"])
def test_sigterm_reaches_the_daemon_and_stops_the_restarts(tmp_path, to_whom):
    """Under Slurm the signal reaches every process of the step (`group`: the daemon sees it twice,
    directly and forwarded, and takes the copy for the same signal); whoever signals the supervisor
    alone (`supervisor`) still stops the daemon. Either way the daemon drains and exits with its own
    code, and nothing is restarted after it, even when that code is not 0."""
    (tmp_path / "c.py").write_text(textwrap.dedent(f"""
        import os, signal, sys, time
        from rolloutd.agents.daemon.supervise import supervise
        sys.exit(supervise({child(tmp_path, '''
            got = []
            signal.signal(signal.SIGTERM, lambda *a: got.append(1))
            open(runs + ".ready", "w").close()
            while not got: time.sleep(0.01)
            sys.exit(7)
        ''')!r}, restarts=5, backoff=0.01))
    """))
    proc = subprocess.Popen([sys.executable, str(tmp_path / "c.py")], start_new_session=True)
    try:
        wait_until(lambda: (tmp_path / "runs.ready").exists(), 30, "the daemon started")
        if to_whom == "group":
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(30) == 7
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert runs(tmp_path) == 1
