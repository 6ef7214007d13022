"""The one /proc reader and kill-until-gone loop (`rolloutd.sandbox.server.procs`), and the lazy runtime registry."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

from rolloutd.sandbox.server.procs import all_stats, identity, kill_until_gone, read_stat


def test_stat_fields_survive_a_command_name_with_parentheses(tmp_path):
    odd = tmp_path / "x) (y"  # /proc/PID/stat's comm field: "(x) (y)"
    shutil.copy(shutil.which("sleep"), odd)
    proc = subprocess.Popen([str(odd), "30"], start_new_session=True)
    try:
        st = read_stat(proc.pid)
        assert st is not None
        assert (st.ppid, st.pgid, st.sid) == (os.getpid(), proc.pid, proc.pid)
        assert not st.dead and identity(proc.pid) == f"{proc.pid} {st.start}"
    finally:
        proc.kill()
        proc.wait()
    assert read_stat(proc.pid) is None and identity(proc.pid) is None


def test_a_zombie_is_dead_and_has_no_identity():
    proc = subprocess.Popen(["true"])
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
    try:
        st = read_stat(proc.pid)
        assert st is not None and st.dead and identity(proc.pid) is None
    finally:
        proc.wait()


def test_kill_until_gone_leaves_nothing_of_a_session_whose_shell_keeps_starting_processes():
    proc = subprocess.Popen(["sh", "-c", "while :; do sleep 30 & sleep 30 & wait; done"], start_new_session=True)

    def session():
        return [st.pid for st in all_stats() if st.sid == proc.pid and not st.dead]

    try:
        assert kill_until_gone(session, timeout=10.0, pause=0.01) == []
        assert session() == []
    finally:
        proc.kill()
        proc.wait()


def test_runtimes_are_imported_on_first_use():
    code = (
        "import sys\nfrom rolloutd.sandbox import get_runtime\n"
        "mods = lambda: sorted(m for m in sys.modules if m.startswith('rolloutd.sandbox.runtimes.'))\n"
        "before = mods()\nget_runtime('process')\nprint(before, mods())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['rolloutd.sandbox.runtimes.base'] ['rolloutd.sandbox.runtimes.base', 'rolloutd.sandbox.runtimes.process']"
