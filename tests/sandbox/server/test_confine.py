"""`Sandbox.confine` on the real bwrap runtime: after it, sessions (but the exempt ones) and the IPython kernel
cannot write the control directory, can still write their usual places, and cannot signal or read the
process of an exempt session; the shells running at the call end. What Harbor builds on it:
tests/agents/tasks/test_harbor.py."""
from __future__ import annotations

import pytest

from rolloutd.sandbox.server import confine


WRITABLE_MOUNT = "/data set é"  # mountinfo escapes the space (\040) and leaves the é as UTF-8


@pytest.fixture
def confined(make_sandbox, run, tmp_path):
    if confine.abi() < 1:
        pytest.skip("this kernel has no Landlock")
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared").chmod(0o777)  # the sandbox's user writes there
    sb = make_sandbox(mounts=[{"hostPath": str(tmp_path / "shared"), "path": WRITABLE_MOUNT, "readOnly": False}])
    run(sb.bash("mkdir -p /.rolloutd/guarded && echo kept > /.rolloutd/guarded/f && echo $$ > /tmp/before"))
    result = run(sb.confine(["trusted"]))
    assert result.confined and result.abi >= 1
    return sb, result


def test_confined_sessions_write_their_places_but_not_the_control_directory(confined, run):
    """Their places: /workspace, /tmp, /dev and every read-write mount, even one whose path mountinfo escapes."""
    sb, _ = confined
    out = run(sb.bash("echo $$ > /tmp/after; cmp -s /tmp/before /tmp/after && echo same-shell; "
                      "echo x > /.rolloutd/guarded/f; echo forge=$?; rm -f /.rolloutd/guarded/f; echo rm=$?; "
                      "mkdir /.rolloutd/new; echo mkdir=$?; echo w > /workspace/w && echo t > /tmp/t && "
                      "echo n > /dev/null && echo m > '/data set é/m' && echo usual-places-ok")).output
    assert "same-shell" not in out  # the shell that ran before the call was ended: this one is confined
    assert "forge=1" in out and "rm=1" in out and "mkdir=1" in out and "usual-places-ok" in out
    assert run(sb.bash("cat /.rolloutd/guarded/f", session="other")).output == "kept\n"
    trusted = run(sb.bash("echo y > /.rolloutd/guarded/f && cat /.rolloutd/guarded/f", session="trusted"))
    assert trusted.output == "y\n"
    cell = run(sb.ipython("open('/.rolloutd/guarded/g', 'w')"))
    assert cell.error and "PermissionError" in cell.error


def test_confined_processes_cannot_signal_or_read_an_exempt_one(confined, run):
    sb, result = confined
    if not result.signals_scoped:
        pytest.skip("Landlock ABI < 6: no signal scope on this kernel")
    run(sb.bash("sleep 300 > /dev/null 2>&1 & echo $! > /tmp/trusted.pid", session="trusted"))
    out = run(sb.bash("pid=$(cat /tmp/trusted.pid); kill -9 $pid; echo kill=$?; "
                      "cat /proc/$pid/environ > /dev/null; echo environ=$?")).output
    assert "kill=1" in out and "environ=1" in out
    assert run(sb.bash("kill -0 $(cat /tmp/trusted.pid) && echo alive", session="trusted")).output == "alive\n"
