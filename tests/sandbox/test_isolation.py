"""Isolation and limits of the bwrap runtime, shown with real attacks on a real sandbox."""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from rolloutd.sandbox import SandboxDied

from support.waiting import wait_until

from support.sandbox_checks import host_pids_of, is_root


def test_writes_outside_the_workspace_fail(make_sandbox, run):
    sb = make_sandbox()
    targets = ["/etc/rolloutd-x", "/rolloutd-x", "/usr/rolloutd-x", "/dev/rolloutd-x"]
    if not str(Path.cwd()).startswith(("/tmp/", "/run/")):  # those are the sandbox's private tmpfs
        targets.append(str(Path.cwd() / "rolloutd-x"))
    for target in targets:
        r = run(sb.bash(f"echo x > {target}"))
        assert r.exit_code != 0, target
        assert "Read-only file system" in r.output or "No such file" in r.output
        assert not os.path.exists(target)
    # whatever the checkout's place, a write there never reaches the host
    run(sb.bash(f"echo x > {Path.cwd() / 'rolloutd-y'} 2>/dev/null"))
    assert not (Path.cwd() / "rolloutd-y").exists()
    r = run(sb.bash("echo inside > note.txt && echo tmp > /tmp/scratch && cat /tmp/scratch"))
    assert r.exit_code == 0 and r.output == "tmp\n"
    assert (sb.workspace / "note.txt").read_text() == "inside\n"


def test_memory_backed_scratch_space_is_bounded(make_sandbox, run):
    """/tmp and /dev/shm hold at most tmp_mb each and /run 16 MB: without a cgroup (non-root) nothing
    else would stop a task from filling the node's memory with files. Devices still work."""
    sb = make_sandbox(tmp_mb=8)
    for place, mb in (("/tmp", 8), ("/dev/shm", 8), ("/run", 16)):
        r = run(sb.bash(f"dd if=/dev/zero of={place}/fill bs=1M count={mb + 4} 2>&1; rm -f {place}/fill"))
        assert "No space left on device" in r.output, (place, r.output)
    r = run(sb.bash("echo ok > /dev/null && head -c 4 /dev/urandom | wc -c && "
                    "python3 -c 'from multiprocessing import shared_memory as s; m = s.SharedMemory(create=True, "
                    "size=1 << 20); m.close(); m.unlink(); print(\"shm\")'"))
    assert r.output == "4\nshm\n" and r.exit_code == 0, r.output


def test_private_tmp_and_no_other_sandbox_visible(make_sandbox, run, tmp_path):
    a, b = make_sandbox(), make_sandbox()
    run(a.bash("echo secret > /tmp/a-only && echo ws > mine"))
    assert run(b.bash("cat /tmp/a-only")).exit_code != 0
    assert run(b.bash(f"ls {a.workspace}")).exit_code != 0  # the host's sandbox dirs are hidden
    marker = Path("/tmp") / f"rolloutd-host-{os.getpid()}"
    marker.write_text("host")
    try:
        assert run(a.bash(f"cat {marker}")).exit_code != 0
    finally:
        marker.unlink()


def _listener():
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    accepted = []

    def accept():
        try:
            while True:
                conn, _ = srv.accept()
                accepted.append(conn)
        except OSError:
            pass

    threading.Thread(target=accept, daemon=True).start()
    return srv, srv.getsockname()[1], accepted


def test_no_network_by_default(make_sandbox, run):
    srv, port, accepted = _listener()
    try:
        sb = make_sandbox()
        r = run(sb.bash(f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo connected"))
        assert r.exit_code != 0 and "connected" not in r.output
        assert accepted == []
        ifaces = run(sb.bash("ls /sys/class/net 2>/dev/null; cat /proc/net/dev | tail -n +3 | cut -d: -f1"))
        assert ifaces.exit_code == 0
        assert [l.strip() for l in ifaces.output.split("\n")[-2:] if l.strip()] == ["lo"]
    finally:
        srv.close()


def test_network_true_is_a_namespace_of_its_own_with_a_route_out(make_sandbox, run):
    """network: true is no longer the host's namespace (issue 24): slirp4netns gives it a tap and a default
    route out, never the host's loopback (tests/tenancy/test_sandbox_tenant.py plays the tenant)."""
    if shutil.which("slirp4netns") is None:
        pytest.skip("slirp4netns is not installed (.ci/system-packages.sh)")
    srv, port, accepted = _listener()
    try:
        sb = make_sandbox(network=True)
        r = run(sb.bash(f"exec 3<>/dev/tcp/127.0.0.1/{port} && echo connected"))
        assert r.exit_code != 0 and accepted == []
        assert "default via 10.0.2.2 dev tap0" in run(sb.bash("ip route")).output
        assert "tap0:" in run(sb.bash("cat /proc/net/dev")).output  # its namespace's, not the host's /sys
    finally:
        srv.close()


def test_host_processes_are_invisible(make_sandbox, run):
    sb = make_sandbox()
    r = run(sb.bash("for p in /proc/[0-9]*; do cat $p/comm; done"))
    names = set(r.output.split())
    assert names <= {"bwrap", "python", "python3", "bash", "cat"}, names
    assert len(r.output.split()) < 10
    assert run(sb.bash(f"grep -l pytest /proc/[0-9]*/cmdline")).exit_code != 0


def test_fork_bomb_is_contained(make_sandbox, run):
    sb = make_sandbox(processes=64)
    if is_root() and "pids" not in sb.limits["cgroup"]:
        pytest.skip("running as root without a pids cgroup: RLIMIT_NPROC is not enforced for root")
    r = run(sb.bash("bomb() { bomb | bomb & }; bomb; sleep 3; echo survived", timeout=2))
    assert r.timed_out
    # the node is fine: it can still start processes
    assert subprocess.run(["true"]).returncode == 0
    # the sandbox stays usable (possibly with a fresh session) or is reported dead: never stuck
    try:
        after = run(sb.bash("echo alive; ls / > /dev/null && echo forked"))
    except SandboxDied:
        assert not sb.alive
    else:
        # bash may print "fork: retry" while the bomb's last processes are being reaped: it then
        # succeeds, which is what "usable" means; it may also report the bomb's job as done
        # ("[1]+  Done  bomb | bomb") when it reaps the killed job during this command
        lines = [
            line for line in after.output.splitlines()
            if "fork: retry" not in line and not (line.startswith("[1]") and "bomb" in line)
        ]
        assert lines == ["alive", "forked"], after.output
    pids = host_pids_of(sb.id)
    run(sb.close())
    assert host_pids_of(sb.id) == []
    assert not any(os.path.exists(f"/proc/{p}") for p in pids)


def test_memory_bomb_is_stopped(make_sandbox, run):
    sb = make_sandbox(memory_mb=256)
    r = run(sb.bash("python3 -c 'a = []\nwhile True: a.append(bytearray(10**7))'", timeout=60))
    assert r.exit_code != 0 and not r.timed_out
    assert "MemoryError" in r.output or r.exit_code == 137
    assert run(sb.bash("echo ok")).output == "ok\n"


def test_file_size_limit(make_sandbox, run):
    sb = make_sandbox(file_size_mb=1)
    r = run(sb.bash("head -c 3000000 /dev/zero > big; echo rc=$?"))
    assert "rc=0" not in r.output
    assert (sb.workspace / "big").stat().st_size <= 1024 * 1024


def test_wall_time_kills_the_sandbox_and_reports_it(make_sandbox, run):
    sb = make_sandbox(wall_seconds=1)
    with pytest.raises(SandboxDied, match="wall time"):
        run(sb.bash("sleep 30", timeout=60))
    assert not sb.alive
    with pytest.raises(SandboxDied):
        run(sb.bash("true"))


def test_sandboxed_code_cannot_kill_its_server(make_sandbox, run):
    sb = make_sandbox()
    r = run(sb.bash("kill -9 $PPID; kill -9 1; echo still"))
    assert r.output.endswith("still\n")
    assert run(sb.bash("echo ok")).output == "ok\n"


def test_crashed_server_is_reported_dead_not_as_a_command_failure(make_sandbox, run):
    from rolloutd.sandbox.server.procs import children

    sb = make_sandbox()

    async def scenario():
        task = asyncio.ensure_future(sb.bash("sleep 30", timeout=60))
        await asyncio.sleep(0)
        await sb.health()  # the bash request has reached the server
        for pid in children(sb._proc.pid):  # the server: bwrap's only child
            os.kill(pid, signal.SIGKILL)
        return await task

    with pytest.raises(SandboxDied):
        run(scenario())
    assert not sb.alive and sb.died


def test_close_kills_everything_and_removes_dirs(make_sandbox, run):
    sb = make_sandbox()
    run(sb.bash("sleep 1000 & setsid sleep 1001 & nohup sleep 1002 >/dev/null 2>&1 &"))
    run(sb.bash("sleep 1003 &", session="second"))
    run(sb.ipython("import subprocess; p = subprocess.Popen(['sleep', '1004'])"))
    # bwrap, server, 2 bash, 5 sleeps, kernel (a sleep still inside execve reads as no environment)
    def all_started() -> list[int]:
        pids = host_pids_of(sb.id)
        return pids if len(pids) >= 8 else []

    pids = wait_until(all_started, 10, "all nine processes") + [sb._proc.pid]
    cgroups = list(sb._cgroup.dirs) if sb._cgroup else []
    run(sb.close())
    run(sb.close())  # idempotent
    assert host_pids_of(sb.id) == []
    assert not any(os.path.exists(f"/proc/{p}") for p in pids)  # not even as zombies
    assert not sb.root.exists()
    assert not any(d.exists() for d in cgroups)
    with pytest.raises(SandboxDied):
        run(sb.bash("true"))


def test_control_socket_is_private_and_single_use(make_sandbox, run):
    sb = make_sandbox()
    assert (sb.root.stat().st_mode & 0o777) == 0o700
    assert ((sb.root / "ctl").stat().st_mode & 0o777) == 0o700
    # the node is the only client ever: code inside cannot reach the server
    # (the server unlinks the socket before it serves its first request)
    run(sb.health())
    assert not (sb.root / "ctl" / "exec.sock").exists()
    assert run(sb.bash("ls -A /.rolloutd; test -S /.rolloutd/exec.sock")).exit_code == 1
    assert run(sb.bash("echo ok")).output == "ok\n"


def test_socket_is_created_0600(tmp_path):
    """Before its one client connects, the server's socket is 0600 in a 0700 directory."""
    import subprocess
    import sys

    from rolloutd.sandbox.launch import LaunchConfig, server_argv

    ctl = tmp_path / "ctl"
    ws = tmp_path / "ws"
    ws.mkdir()
    cfg = LaunchConfig(socket=str(ctl / "exec.sock"), workspace=str(ws), ctl_dir=str(ctl), env={"PATH": "/usr/bin:/bin"})
    proc = subprocess.Popen(server_argv(cfg, sys.executable), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout.readline().startswith(b"READY")
        assert ((ctl / "exec.sock").stat().st_mode & 0o777) == 0o600
        assert (ctl.stat().st_mode & 0o777) == 0o700
        client = socket.socket(socket.AF_UNIX)
        client.connect(str(ctl / "exec.sock"))
        client.close()  # the client hangs up: the server exits and ends its sessions
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()
