"""Containment: hostile code tries every escape on the real runtime, as root and as an unprivileged user.

One sandbox per runtime variant runs `containment_probe.py` (every escape, each
in a forked child) and `containment_driver.py` checks the host afterwards;
each test below asserts one group of verdicts. ``bwrap-user`` runs the node
side as uid 54321 (in a private mount namespace where only the interpreter
under /root is reachable, as on a cluster where the daemon's user owns its venv).
The process runtime isolates nothing and says so (test_runtimes.py::test_process_runtime_warns_and_works).
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from support.sandbox_checks import is_root, require_bwrap

HERE = Path(__file__).resolve().parent
CHECKOUT = HERE.parents[1]
USER_UID = 54321
VARIANTS = ["bwrap-root", "bwrap-user"]


def _driver_cmd(variant: str, home: Path, out: Path) -> list[str]:
    driver = [sys.executable, str(HERE / "containment_driver.py"), "bwrap", str(out)]
    if variant == "bwrap-root":
        return driver
    # the unprivileged node: setpriv to a uid of its own; /root (0700) hidden by a tmpfs except the interpreter
    prefix = os.path.realpath(sys.base_prefix)
    script = 'exec setpriv --reuid "$1" --regid "$1" --clear-groups --inh-caps=-all -- "${@:4}"'
    if prefix.startswith("/root/"):
        script = ('mount --bind "$2" "$3" && mount -t tmpfs -o mode=755 tmpfs /root && mkdir -p "$2" && '
                  f'mount --move "$3" "$2" && {script}')
    stage = home.parent / "stage"
    stage.mkdir(exist_ok=True)
    return ["unshare", "-m", "--propagation", "private", "bash", "-c", script, "bash", str(USER_UID), prefix,
            str(stage), *driver]


@pytest.fixture(scope="module", params=VARIANTS)
def verdicts(request) -> dict[str, str]:
    require_bwrap()
    if platform.machine() != "x86_64":
        pytest.skip("the probe's syscall numbers are x86_64's")
    if not is_root():
        if request.param == "bwrap-user":
            pytest.skip("switching to another uid needs root; the bwrap-root variant is this run's own user")
    elif shutil.which("setpriv") is None or shutil.which("unshare") is None:
        pytest.skip("setpriv/unshare (util-linux) are needed to run the node as another user")
    # the data dir lives where /var would expose it; /var/tmp, not pytest's 0700 tmp, so the other user reaches it
    base = Path(tempfile.mkdtemp(prefix="rolloutd-containment-", dir="/var/tmp"))
    os.chmod(base, 0o755)
    data, home = base / "data", base / "home"
    for d in (home, data):
        d.mkdir()
    (data / "token").write_text("secret-api-token\n")
    os.chmod(data, 0o700)
    out = home / "verdicts.json"
    env = dict(os.environ, ROLLOUTD_DATA_DIR=str(data), PROBE_CHECKOUT=str(CHECKOUT), HOME=str(home))
    if request.param == "bwrap-user":
        for d in (home, data, data / "token"):
            os.chown(d, USER_UID, USER_UID)
        env.pop("ROLLOUTD_SANDBOX_DIR", None)
        env["XDG_CACHE_HOME"] = str(home / ".cache")
    try:
        p = subprocess.run(_driver_cmd(request.param, home, out), env=env, capture_output=True, text=True,
                           timeout=240)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(out.read_text())
    finally:
        shutil.rmtree(base, ignore_errors=True)


def escaped(verdicts: dict[str, str], names: list[str]) -> dict[str, str]:
    missing = [n for n in names if n not in verdicts]
    assert not missing, f"cases not run: {missing}"
    return {n: verdicts[n] for n in names if verdicts[n] != "contained"}


def test_no_privileges_inside(verdicts):
    assert escaped(verdicts, ["no capabilities", "not root inside", "no_new_privs", "seccomp filter"]) == {}


def test_mounts_and_chroot_refused_and_host_unwritten(verdicts):
    assert escaped(verdicts, ["remount rw", "mount tmpfs", "mount binary (setuid)", "su (setuid)", "umount2", "pivot_root",
                              "chroot", "host writes"]) == {}


def test_no_new_namespaces(verdicts):
    assert escaped(verdicts, ["unshare user ns", "unshare mount ns", "unshare -Ur binary", "clone new pid+net ns",
                              "setns"]) == {}


def test_exec_server_cannot_be_traced_and_agent_code_still_can_be(verdicts):
    assert escaped(verdicts, ["ptrace attach server", "server memory", "server environ", "process_vm_readv server",
                              "agent code dumpable"]) == {}


KERNEL_SYSCALLS = ["kexec_load", "kexec_file_load", "bpf", "perf_event_open", "keyctl", "add_key", "request_key",
                   "init_module", "finit_module", "delete_module", "swapon", "swapoff", "reboot", "open_by_handle_at",
                   "userfaultfd", "io_uring_setup", "acct", "personality"]


def test_kernel_attack_surface_answers_eperm(verdicts):
    assert escaped(verdicts, [f"syscall {n}" for n in KERNEL_SYSCALLS] + ["i386 syscall ABI"]) == {}


def test_host_secrets_checkouts_and_data_dir_are_invisible(verdicts):
    reads = [k for k in verdicts if k.startswith("read ")]
    assert any(k.endswith("/token") for k in reads) and "read /etc/shadow" in reads
    assert escaped(verdicts, [*reads, "/proc/1/root escape"]) == {}


def test_no_sys_writes_raw_sockets_or_network(verdicts):
    assert escaped(verdicts, ["/sys and /proc/sys writes", "raw sockets", "network false"]) == {}


def test_resources_are_bounded(verdicts):
    assert escaped(verdicts, ["fork bomb", "memory bomb", "/tmp fill", "workspace file fill",
                              "sandbox usable after the escapes"]) == {}


def test_nothing_left_after_close(verdicts):
    assert escaped(verdicts, ["leftover processes", "sandbox directory removed"]) == {}

