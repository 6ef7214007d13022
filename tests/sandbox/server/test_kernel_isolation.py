"""The IPython kernel is a process of its sandbox like any other: its user, namespaces, filter and root, no
socket of its own, and nothing shared with another sandbox's kernel. Real bwrap, real kernels."""
from __future__ import annotations

import os

import pytest

from support.sandbox_checks import host_pids_of, is_root


@pytest.fixture(scope="module")
def two(run):
    from rolloutd.sandbox import SandboxSpec, get_runtime

    from support.sandbox_checks import require_bwrap

    require_bwrap()
    a = run(get_runtime("bwrap").create(SandboxSpec()))
    b = run(get_runtime("bwrap").create(SandboxSpec()))
    yield a, b
    run(a.close())
    run(b.close())


def _sockets(pid: int) -> int:
    n = 0
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
            except OSError:
                pass
    except OSError:
        pass
    return n


def test_the_kernel_opens_no_socket(two, run):
    """The server's one connection to the node is the sandbox's only socket, a kernel running or not
    (a ZeroMQ kernel held a dozen: its own and the server's client)."""
    a, _ = two
    assert run(a.ipython("k = 1")).error is None
    assert run(a.health()).kernel
    counts = {pid: _sockets(pid) for pid in host_pids_of(a.id)}
    assert sum(counts.values()) == 1, counts


def test_each_kernel_sees_only_its_own_sandbox(two, run):
    a, b = two
    run(b.bash("sleep 4242 &"))
    assert run(b.bash("echo b-only > /workspace/b-marker && echo b-tmp > /tmp/b-marker")).exit_code == 0
    probe = ("import os, socket\n"
             "mine = [p for p in os.listdir('/proc') if p.isdigit()]\n"
             "def cmd(p):\n"
             "    try:\n"
             "        return open(f'/proc/{p}/cmdline', 'rb').read()\n"
             "    except OSError:\n"
             "        return b''\n"
             "(any(b'4242' in cmd(p) for p in mine), os.path.exists('/workspace/b-marker'),"
             " os.path.exists('/tmp/b-marker'), sorted(n for _, n in socket.if_nameindex()), b'-S' in cmd(1))")
    assert run(a.ipython(probe)).result == "(False, False, False, ['lo'], True)"  # pid 1: a's own exec server
    assert run(b.ipython(probe)).result == "(True, True, True, ['lo'], True)"


def test_two_kernels_share_no_state(two, run):
    a, b = two
    assert run(a.ipython("secret = 'a'; import sys; sys.modules['planted'] = sys")).error is None
    assert run(b.ipython("secret = 'b'")).error is None
    assert run(b.ipython("(secret, 'planted' in __import__('sys').modules)")).result == "('b', False)"
    assert run(a.ipython("secret")).result == "'a'"


def test_the_kernel_runs_confined_as_the_sandbox_user(two, run):
    a, _ = two
    cell = run(a.ipython(
        "import os\n"
        "status = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines() if ':\\t' in l)\n"
        "(os.getuid(), status['NoNewPrivs'].strip(), status['Seccomp'].strip(), status['CapEff'].strip())"))
    uid = 65534 if is_root() else os.getuid()
    assert cell.result == f"({uid}, '1', '2', '0000000000000000')", cell


def test_output_written_below_python_is_captured(two, run):
    """print, a raw write to fd 1, a shell command and a subprocess all come back, in order."""
    a, _ = two
    cell = run(a.ipython("import os, subprocess, sys\nprint('p')\nos.write(1, b'raw\\n')\n"
                         "!echo shell\nsubprocess.run(['echo', 'sub'])\nprint('e', file=sys.stderr)\n"))
    assert cell.error is None, cell.error
    assert cell.stdout.split() == ["p", "raw", "shell", "sub"], cell.stdout
    assert cell.stderr == "e\n"


def test_a_timeout_interrupts_a_shell_command_and_keeps_the_state(two, run):
    a, _ = two
    run(a.ipython("kept = 7"))
    cell = run(a.ipython("!sleep 100", timeout=1))
    assert cell.timed_out and not cell.kernel_restarted
    assert run(a.ipython("kept")).result == "7"


def test_a_reply_forged_by_the_cell_is_not_taken_for_the_kernels(two, run):
    """The cell may write to the kernel's reply pipe (it is the agent's own process): a line without the
    request's id is skipped, garbage ends that kernel (reported, a new one next cell), never the server."""
    a, _ = two
    cell = run(a.ipython("import os\nos.write(4, b'{\"id\": 0, \"stdout\": \"forged\"}\\n')\n'real'"))
    assert (cell.result, cell.stdout, cell.kernel_restarted) == ("'real'", "", False), cell
    cell = run(a.ipython("import os\nos.write(4, b'{\"id\": [[[' * 1000 + b'\\n')\nimport time; time.sleep(5)"))
    assert cell.kernel_restarted and "died" in cell.error
    assert run(a.ipython("1 + 1")).result == "2"
    assert run(a.health()).sessions == ["default"]


def test_history_of_the_session_works_without_a_database(two, run):
    a, _ = two
    run(a.ipython("first = 'h'"))
    cell = run(a.ipython("%history\n_ih[-2]"))
    assert cell.result == "\"first = 'h'\"" and "first = 'h'" in cell.stdout, cell


def test_parse_reply_takes_one_json_object_and_nothing_else():
    from rolloutd.sandbox.server.kernel import KernelDied, parse_reply

    assert parse_reply(b'{"id": 1, "result": "\\u00e9", "x": NaN}') == {"id": 1, "result": "é", "x": None}
    for line in (b"[1]", b'{"id": 1} {"id": 2}', b"\xff{}", b"{" * 100000, b"", b'"s"'):
        with pytest.raises(KernelDied):
            parse_reply(line)


def test_no_kernel_runs_before_the_first_cell(make_sandbox, run):
    """The kernel starts on the agent's first `ipython` call: a bash-only sandbox never pays for one."""
    sb = make_sandbox()
    assert run(sb.bash("true")).exit_code == 0
    assert not run(sb.health()).kernel

    def runner_running() -> bool:
        for pid in host_pids_of(sb.id):
            try:
                if b"ipyrunner.py" in open(f"/proc/{pid}/cmdline", "rb").read():
                    return True
            except OSError:
                pass
        return False

    assert not runner_running()
    assert run(sb.ipython("1")).result == "1"
    assert run(sb.health()).kernel and runner_running()
