"""The runtimes behind one interface: process (dev only), apptainer (skipped without a binary),
root filesystem images for bwrap, many sandboxes at once, and the `rolloutd sandbox exec` CLI."""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rolloutd.sandbox import RuntimeUnavailable, SandboxCreateError, SandboxSpec, create_sandbox, get_runtime
from rolloutd.crds.kit.settings import SandboxSettings
from rolloutd.sandbox.runtimes.apptainer import ApptainerRuntime

from support.waiting import wait_until

from support.sandbox_checks import host_pids_of, require_bwrap


def test_unknown_runtime():
    with pytest.raises(ValueError, match="unknown sandbox runtime"):
        get_runtime("docker")


def test_spec_defaults_are_safe_and_job_fields_map():
    spec = SandboxSpec()
    assert (spec.runtime, spec.image, spec.network) == ("bwrap", "host", False)
    mapped = SandboxSpec.model_validate({"runtime": "bwrap", "limits": {"memoryMB": 512, "processes": 32,
                                                                         "wallSeconds": 60}})
    assert (mapped.limits.memory_mb, mapped.limits.processes, mapped.limits.wall_seconds) == (512, 32, 60)
    with pytest.raises(ValueError):
        SandboxSpec(mounts=[{"host_path": "relative/path"}])
    with pytest.raises(ValueError, match="'..'"):
        SandboxSpec(mounts=[{"host_path": "/srv/data/../../etc"}])


def test_process_runtime_warns_and_works(run):
    with pytest.warns(RuntimeWarning, match="NO ISOLATION"):
        sb = run(create_sandbox(SandboxSpec(runtime="process")))
    try:
        r = run(sb.bash("pwd; echo hi > f"))
        assert r.output == f"{sb.workspace}\n"
        assert (sb.workspace / "f").read_text() == "hi\n"
        run(sb.bash("sleep 1000 &"))
        # the prompt can come back while the background sleep is still inside execve, when
        # /proc/PID/environ reads empty for a moment: wait for it rather than count once
        wait_until(lambda: len(host_pids_of(sb.id)) >= 3, 10, "server, bash and the sleep")
    finally:
        run(sb.close())
    assert host_pids_of(sb.id) == []
    assert not sb.root.exists()


@pytest.mark.skipif(ApptainerRuntime.available() is None, reason="apptainer is installed: see test_apptainer_runs")
def test_apptainer_unavailable_is_a_typed_error(run):
    with pytest.raises(RuntimeUnavailable, match="apptainer"):
        run(create_sandbox(SandboxSpec(runtime="apptainer", image="/nonexistent.sif")))


def test_apptainer_refuses_network_true_naming_the_field():
    """Before, `network: true` on apptainer left out `--network none`: the node's own network, loopback included."""
    with pytest.raises(ValueError, match=r"network: true needs the bwrap runtime"):  # when the job is applied
        SandboxSpec(runtime="apptainer", image="/images/task.sif", network=True)
    runtime = ApptainerRuntime()  # and on the node, whatever built the spec
    with pytest.raises(SandboxCreateError, match=r"spec\.sandbox\.network: true needs the bwrap runtime"):
        runtime.check(SandboxSpec.model_construct(runtime="apptainer", image="/images/task.sif", network=True,
                                                  mounts=[]))
    runtime.check(SandboxSpec(runtime="apptainer", image="/images/task.sif"))


@pytest.mark.skipif(ApptainerRuntime.available() is not None, reason=str(ApptainerRuntime.available()))
def test_apptainer_runs(run, tmp_path):  # pragma: no cover - needs an apptainer binary and an image
    image = os.environ.get("ROLLOUTD_TEST_SIF")
    if not image:
        pytest.skip("set ROLLOUTD_TEST_SIF to a .sif image to run the apptainer test")
    sb = run(create_sandbox(SandboxSpec(runtime="apptainer", image=image)))
    try:
        assert run(sb.bash("echo hi")).output == "hi\n"
    finally:
        run(sb.close())


def _copy_with_libs(binary: str, root: Path) -> None:
    """Copy a host binary and the shared libraries it loads into `root`."""
    real = os.path.realpath(binary)
    dest = root / real.lstrip("/")
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(real, dest)
    out = subprocess.run(["ldd", real], capture_output=True, text=True).stdout
    for line in out.splitlines():
        parts = line.split()
        for p in parts:
            if p.startswith("/"):
                lib = root / p.lstrip("/")
                lib.parent.mkdir(parents=True, exist_ok=True)
                if not lib.exists():
                    shutil.copy2(os.path.realpath(p), lib)


def test_rootfs_image(make_sandbox, run, tmp_path):
    """A root filesystem directory replaces the host's root (read-only)."""
    require_bwrap()
    root = tmp_path / "rootfs"
    for tool in ("bash", "cat", "ls"):
        _copy_with_libs(shutil.which(tool), root)
    # the server needs the interpreter's C libraries too
    _copy_with_libs(os.path.realpath(sys.executable), root)
    for d in ("bin", "lib", "lib64"):
        if (root / "usr" / d).exists() and not (root / d).exists():
            (root / d).symlink_to(f"usr/{d}")
    (root / "etc").mkdir(exist_ok=True)
    (root / "etc" / "os-release").write_text("NAME=rolloutd-test-rootfs\n")
    sb = make_sandbox(image=str(root))
    r = run(sb.bash("cat /etc/os-release; ls -1 /usr/bin"))
    assert r.exit_code == 0, r.output
    assert r.output.startswith("NAME=rolloutd-test-rootfs\n")
    assert set(r.output.split("\n")[1:]) - {""} == {"bash", "cat", "ls"}
    assert run(sb.bash("test -e /usr/bin/python3.11 || test -e /etc/passwd")).exit_code == 1
    assert run(sb.bash("echo x > /etc/os-release")).exit_code != 0
    assert run(sb.bash("echo x > note && cat note")).output == "x\n"


def test_32_sandboxes_at_once_all_closed_without_leftovers(run, tmp_path):
    require_bwrap()
    ours = SandboxSettings(sandbox_dir=tmp_path / "sandboxes")  # a sandbox directory of our own

    async def one(i: int):
        sb = await create_sandbox(SandboxSpec(), ours)
        try:
            r = await sb.bash(f"echo sandbox-{i} > id && cat id")
            await sb.write_file("f.txt", str(i))
            return sb, r.output, await sb.read_file("f.txt")
        except BaseException:
            await sb.close()
            raise

    async def scenario():
        made = await asyncio.gather(*(one(i) for i in range(32)))
        ids = [sb.id for sb, _, _ in made]
        workspaces = {sb.workspace for sb, _, _ in made}
        await asyncio.gather(*(sb.close() for sb, _, _ in made))
        return made, ids, workspaces

    made, ids, workspaces = run(scenario(), timeout=300)
    assert [out for _, out, _ in made] == [f"sandbox-{i}\n" for i in range(32)]
    assert [content for _, _, content in made] == [str(i) for i in range(32)]
    assert len(workspaces) == 32
    assert all(host_pids_of(i) == [] for i in ids)
    assert os.listdir(ours.sandbox_dir) == []
    assert not any(sb.alive for sb, _, _ in made)


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rolloutd.controller.main", "sandbox", "exec", *args],
        capture_output=True, text=True, timeout=timeout,
    )


def test_cli_exec_prints_output_and_exits_with_the_exit_code():
    require_bwrap()
    p = _cli("--", "echo hello from $PWD; exit 3")
    assert p.returncode == 3, p.stderr
    assert p.stdout.startswith("hello from /workspace\n")
    p = _cli("--timeout", "0.5", "--", "sleep 30")
    assert p.returncode == 124
    assert "timed out" in p.stderr


def test_cli_names_the_option_a_bad_limit_came_from():
    """--memory-mb 9e12 was taken, and then bash could not start in the sandbox (RLIMIT_AS overflowed): exit 125 with
    "Bad file descriptor". Now the limit is refused before any sandbox, naming the option."""
    p = _cli("--memory-mb", "9000000000000", "--", "echo hi")
    assert p.returncode == 2 and p.stderr.startswith("rolloutd sandbox exec: --memory-mb: "), p.stderr
    assert "16777216" in p.stderr and "pydantic" not in p.stderr and not p.stdout
    p = _cli("--processes", "1", "--", "echo hi")
    assert p.returncode == 2 and "--processes: " in p.stderr, p.stderr


def test_create_failures_are_typed_and_leave_nothing(run, tmp_path):
    require_bwrap()
    from rolloutd.sandbox import SandboxCreateError

    ours = SandboxSettings(sandbox_dir=tmp_path / "sandboxes")
    with pytest.raises(SandboxCreateError, match="nonexistent"):
        run(create_sandbox(SandboxSpec(mounts=[{"host_path": "/nonexistent-rolloutd-path"}]), ours))
    with pytest.raises(SandboxCreateError, match="neither 'host' nor"):
        run(create_sandbox(SandboxSpec(image="/nonexistent-rootfs"), ours))
    assert os.listdir(ours.sandbox_dir) == []


def test_cancelled_create_and_close_leave_nothing(run, tmp_path):
    """A caller's timeout may cancel create() or close() half-way: no directory, no process."""
    require_bwrap()
    from rolloutd.sandbox.sandbox import _live

    ours = SandboxSettings(sandbox_dir=tmp_path / "sandboxes")

    async def cancel_create_after(seconds: float):
        task = asyncio.ensure_future(create_sandbox(SandboxSpec(), ours))
        done, _ = await asyncio.wait({task}, timeout=seconds)
        if not done:
            task.cancel()
        try:
            sb = await task
        except asyncio.CancelledError:
            return None
        return sb

    leftovers = []
    for delay in (0.0, 0.005, 0.02):
        sb = run(cancel_create_after(delay))
        if sb is not None:  # it finished first: close it, cancelling the close right away
            leftovers.append(sb.id)

            async def cancel_close(sb=sb):
                task = asyncio.ensure_future(sb.close())
                await asyncio.sleep(0)
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                deadline = asyncio.get_running_loop().time() + 10
                while sb.root.exists() and asyncio.get_running_loop().time() < deadline:
                    await asyncio.sleep(0.01)  # the release goes on in its thread after the cancel

            run(cancel_close())
    assert all(host_pids_of(i) == [] for i in leftovers)
    assert not any(sb_id in _live for sb_id in leftovers)
    base = tmp_path / "sandboxes"
    assert not base.exists() or os.listdir(base) == []


def _cgroup_procs(d: Path) -> list[str]:
    try:
        return (d / "cgroup.procs").read_text().split()
    except OSError:
        return []


def test_sweep_removes_what_a_killed_daemon_left(run, tmp_path, monkeypatch):
    """A daemon killed with SIGKILL leaves directories and cgroups: the next one sweeps them."""
    require_bwrap()
    from rolloutd.sandbox.host.footprint import sweep_stale
    from rolloutd.sandbox.host.limits import candidate_parents

    monkeypatch.setenv("ROLLOUTD_SANDBOX_DIR", str(tmp_path / "sandboxes"))  # the killed daemon's, read at its start
    ours = SandboxSettings(sandbox_dir=tmp_path / "sandboxes")
    live = run(create_sandbox(SandboxSpec(), ours))  # a live sandbox of this process must survive the sweep
    script = (
        "import asyncio, os, sys\n"
        "from rolloutd.crds.kit.settings import SandboxSettings\n"
        "from rolloutd.sandbox import SandboxSpec, create_sandbox\n"
        "async def main():\n"
        "    sb = await create_sandbox(SandboxSpec(), SandboxSettings.from_env())\n"
        "    print(sb.id, flush=True)\n"
        "    await sb.bash('true')\n"
        "    os.kill(os.getpid(), 9)\n"
        "asyncio.run(main())\n"
    )
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == -9, p.stderr
    dead_id = p.stdout.split()[0]
    base = tmp_path / "sandboxes"
    try:
        assert (base / dead_id).exists()  # left behind
        # the kernel is still tearing the dead daemon's sandbox down for a few ms (its
        # server, init of the pid namespace, waits for the namespace's other processes,
        # then for its own reaper); a next daemon starts later than that. The sweep tries
        # each cgroup once, so wait here until the dead sandbox's cgroups hold no process.
        dead_cgroups = [parent / f"rolloutd-{dead_id}" for parent in candidate_parents()]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_cgroup_procs(d) for d in dead_cgroups):
            time.sleep(0.005)
        removed = sweep_stale(base)
        assert dead_id in removed and live.id not in removed
        assert not (base / dead_id).exists() and live.root.exists()
        assert not any((parent / f"rolloutd-{dead_id}").exists() for parent in candidate_parents())
        assert host_pids_of(dead_id) == []
        assert run(live.bash("echo ok")).output == "ok\n"
    finally:
        run(live.close())


def test_an_interpreter_under_tmp_stays_visible_inside_the_sandbox(run, tmp_path):
    """The sandbox gets a private /tmp; a venv or checkout living under /tmp (a CI clone) must still
    be reachable, or the exec server cannot start. Checked with a real venv made under /tmp."""
    require_bwrap()
    import tempfile
    import venv

    where = Path(tempfile.mkdtemp(prefix="rolloutd-venv-", dir="/tmp"))
    venv.create(where, system_site_packages=True, with_pip=False)
    py = where / "bin" / "python"
    import sysconfig

    site_dir = sysconfig.get_paths()["purelib"]  # this venv's packages (and rolloutd's editable finder)
    code = (f"import site; site.addsitedir({site_dir!r})\n"
            "import asyncio\nfrom rolloutd.sandbox import SandboxSpec, create_sandbox\n"
            "async def main():\n    sb = await create_sandbox(SandboxSpec())\n"
            "    print((await sb.bash('echo inside')).output, end='')\n    await sb.close()\nasyncio.run(main())\n")
    try:
        r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout == "inside\n"
    finally:
        shutil.rmtree(where, ignore_errors=True)


def test_mounts_are_read_only_by_default_and_never_show_secrets(make_sandbox, run, tmp_path):
    shared = tmp_path / "dataset"
    shared.mkdir()
    (shared / "rows.txt").write_text("row\n")
    os.chmod(tmp_path, 0o755)  # the sandbox's own user (nobody, for a root node) walks to it
    sb = make_sandbox(mounts=[{"host_path": str(shared), "path": "/data"}])
    assert run(sb.bash("cat /data/rows.txt")).output == "row\n"
    assert run(sb.bash("touch /data/new")).exit_code != 0 and not (shared / "new").exists()
    data_dir = tmp_path / "rolloutd-data"
    data_dir.mkdir()
    for host_path in (str(data_dir), str(tmp_path)):  # the node's data dir, or a directory above it
        with pytest.raises(SandboxCreateError, match="never mounted"):
            run(create_sandbox(SandboxSpec(mounts=[{"host_path": host_path}]), SandboxSettings(data_dir=data_dir)))
    for host_path, inside, why in (("/etc/shadow", None, "never mounted"), ("/etc", None, "never mounted"),
                                   ("/", None, "never mounted"), (str(shared), "/workspace", "sandbox's own"),
                                   (str(shared), "/proc/x", "sandbox's own")):
        with pytest.raises(ValueError, match=why):
            SandboxSpec(mounts=[{"host_path": host_path, "path": inside}])


def test_a_jobs_sandbox_mounts_become_the_sandbox_spec_and_secrets_are_refused_at_apply_time():
    from rolloutd.crds.rolloutjob import SandboxSpec as JobSandbox

    assert JobSandbox is SandboxSpec  # one SandboxSpec: the node daemon hands the job's spec.sandbox to the runtime
    spec = JobSandbox.model_validate({"mounts": [{"hostPath": "/srv/data", "path": "/data"}, {"hostPath": "/opt/x",
                                                                                           "readOnly": False}]})
    assert [(m.host_path, m.inside, m.read_only) for m in spec.mounts] == [("/srv/data", "/data", True),
                                                                          ("/opt/x", "/opt/x", False)]
    for bad in ({"hostPath": "/etc/munge/munge.key"}, {"hostPath": "data"}, {"hostPath": "/srv/../etc/shadow"},
                {"hostPath": "/srv/data", "path": "/.rolloutd/x"}):
        with pytest.raises(ValueError):
            SandboxSpec.model_validate({"mounts": [bad]})


def test_no_seccomp_filter_means_no_sandbox(run, tmp_path, monkeypatch):
    """Fail closed: where libseccomp cannot compile the filter, bwrap refuses to start sandboxes."""
    from rolloutd.sandbox.host import syscall_filter

    if shutil.which("bwrap") is None:
        pytest.skip("bwrap is not installed")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no cached program
    monkeypatch.setattr(syscall_filter, "SYSTEM_PYTHON", "/nonexistent/python3")
    monkeypatch.setattr(syscall_filter, "build", lambda out: (_ for _ in ()).throw(ImportError("no seccomp")))
    syscall_filter.program.cache_clear()
    try:
        with pytest.raises(RuntimeUnavailable, match="seccomp"):
            run(create_sandbox(SandboxSpec()))
    finally:
        syscall_filter.program.cache_clear()
