"""Tenancy, bounded image builds (issue 36, class 4): a tenant's Dockerfile step that forks, allocates, sleeps or
creates files without end fails the build with an error naming the bound it met; real builds, real bwrap, the
node's cgroups. The bounds are the node's settings (ROLLOUTD_BUILD_*), capped by a tenant's policy quotas."""
from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest

from support.node_helpers import BASE_SPEC
from rolloutd.agents.daemon.jobconfig import JobConfig, load_spec
from rolloutd.agents.tasks.harbor import HarborTask
from rolloutd.crds.kit.settings import SandboxSettings
from rolloutd.crds.tenancy import TenantPolicySpec, TenantQuotas
from rolloutd.sandbox.image.build_limits import BuildLimits, for_build
from rolloutd.sandbox.image.build_step import SizeLimitExceeded, tree_bytes
from rolloutd.sandbox.image.build import build_image
from rolloutd.sandbox.host.limits import Cgroup, candidate_parents
from rolloutd.sandbox.image.rootfs import ImageBuildError, base_rootfs, image_cache_dir


@pytest.fixture(scope="module")
def needs_builder():
    if shutil.which("bwrap") is None or shutil.which("mmdebstrap") is None or os.geteuid() != 0:
        pytest.skip("image builds need bwrap, mmdebstrap and root here (bash .ci/system-packages.sh)")


def _needs_cgroup(kind: str) -> None:
    probe = Cgroup.create(f"probe-{os.getpid()}", 64, 64, 1.0, headroom=False)
    kinds = probe.kinds if probe else []
    if probe:
        probe.destroy()
    if kind not in kinds:
        pytest.skip(f"this node may not make a {kind} cgroup")


def _context(tmp_path: Path, *runs: str) -> Path:
    """A Dockerfile of `runs`, its own each time: an image an older, unbounded builder cached never answers it."""
    (tmp_path / "Dockerfile").write_text(f"# {uuid.uuid4()}\nFROM debian:bookworm\n"
                                         + "".join(f"RUN {r}\n" for r in runs))
    return tmp_path


def _settings(**env: str) -> SandboxSettings:
    return SandboxSettings.from_env({f"ROLLOUTD_BUILD_{k.upper()}": v for k, v in env.items()})


def test_a_step_forking_1000_processes_fails_at_the_default_process_bound(needs_builder, tmp_path):
    _needs_cgroup("pids")
    ctx = _context(tmp_path, "for i in $(seq 1000); do sleep 5 & done; wait")
    with pytest.raises(ImageBuildError) as err:
        build_image(ctx, log=lambda m: None)
    assert "Dockerfile:3: RUN" in str(err.value)
    assert "process bound of 512" in str(err.value) and "ROLLOUTD_BUILD_PROCESSES" in str(err.value)


def test_a_step_holding_more_than_the_memory_bound_fails(needs_builder, tmp_path):
    _needs_cgroup("memory")
    # 180 MB touched: under RLIMIT_AS (2 × 128 MB), over the step's cgroup of 128 MB
    ctx = _context(tmp_path, "python3 -c \"b = b'x' * (180 << 20); print(len(b))\"")
    with pytest.raises(ImageBuildError) as err:
        build_image(ctx, log=lambda m: None, settings=_settings(memory_mb="128"))
    assert "memory bound of 128 MB" in str(err.value) and "ROLLOUTD_BUILD_MEMORY_MB" in str(err.value)


def _descends_from_us(pid: int) -> bool:
    while pid > 1:
        if pid == os.getpid():
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
    return False


def _step_cgroups(seen: dict, done: threading.Event) -> None:
    """What the running step's cgroups bound, read from the host while it runs (the last read wins, so a value
    read between a cgroup's making and its write is overwritten): {file name: value}. Only cgroups that hold a
    process of this test's build: another test's build (another pytest-xdist worker's, another session's) runs
    in cgroups of its own, with other bounds."""
    while not done.is_set():
        for parent in candidate_parents():
            for d in parent.glob("rolloutd-build-*"):
                try:
                    procs = (d / "cgroup.procs").read_text().split()
                except OSError:
                    continue
                if not any(_descends_from_us(int(p)) for p in procs):
                    continue
                for name in ("cpu.cfs_quota_us", "cpu.max", "memory.limit_in_bytes", "memory.max", "pids.max"):
                    with contextlib.suppress(OSError):
                        seen[name] = (d / name).read_text().strip()
        time.sleep(0.05)


def test_a_step_sleeping_past_the_step_timeout_is_stopped_and_ran_in_its_cgroup(needs_builder, tmp_path):
    ctx = _context(tmp_path, "sleep 60")
    seen: dict = {}
    done = threading.Event()
    watcher = threading.Thread(target=_step_cgroups, args=(seen, done), daemon=True)
    watcher.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(ImageBuildError) as err:
            build_image(ctx, log=lambda m: None,
                        settings=_settings(step_seconds="3", cpus="0.5", memory_mb="300", processes="77"))
    finally:
        done.set()
        watcher.join(5)
    assert time.monotonic() - t0 < 50
    assert "Dockerfile:3: RUN" in str(err.value) and "ROLLOUTD_BUILD_STEP_SECONDS" in str(err.value)
    probe = Cgroup.create(f"probe-{os.getpid()}", 64, 64, 1.0, headroom=False)
    if probe:
        probe.destroy()
    kinds = probe.kinds if probe else []
    if "cpu" in kinds:
        assert seen.get("cpu.cfs_quota_us", seen.get("cpu.max", "")).split()[0] == "50000", seen
    if "memory" in kinds:
        assert seen.get("memory.limit_in_bytes", seen.get("memory.max")) == str(300 << 20), seen
    if "pids" in kinds:
        assert seen.get("pids.max") == "77", seen


def test_steps_within_their_timeout_still_stop_at_the_whole_build_timeout(needs_builder, tmp_path):
    ctx = _context(tmp_path, "sleep 2", "sleep 2", "sleep 2", "sleep 60")
    t0 = time.monotonic()
    with pytest.raises(ImageBuildError) as err:
        build_image(ctx, log=lambda m: None, settings=_settings(step_seconds="30", seconds="5"))
    assert time.monotonic() - t0 < 50
    assert "build's timeout of 5s" in str(err.value) and "ROLLOUTD_BUILD_SECONDS" in str(err.value)


def test_100000_empty_files_fill_a_64_mb_image(needs_builder, tmp_path):
    """Each inode counts (at least 4 KiB), not only the blocks: empty files are not free."""
    base = tree_bytes(base_rootfs(image_cache_dir(SandboxSettings().images), log=lambda m: None)) >> 20
    limit = base + 64
    ctx = _context(tmp_path, "mkdir /many && cd /many && seq 100000 | xargs touch")
    with pytest.raises(SizeLimitExceeded) as err:
        build_image(ctx, log=lambda m: None, max_mb=limit)
    assert f"size limit of {limit} MB" in str(err.value)


def test_a_tenants_build_is_capped_by_its_policy():
    node = SandboxSettings(build_memory_mb=4096, build_processes=512, build_cpus=4.0, build_step_seconds=1800,
                           build_seconds=3600)
    quotas = TenantQuotas.model_validate({"sandboxMemoryMB": 1024, "sandboxProcesses": 64, "sandboxCpus": 1.0,
                                          "stageSeconds": 600})
    assert for_build(node, quotas) == BuildLimits(1024, 64, 1.0, 600, 600)
    assert for_build(node) == BuildLimits(4096, 512, 4.0, 1800, 3600)  # an admin's: the node's


def test_a_tenants_harbor_build_gets_its_policys_process_bound(needs_builder, tmp_path):
    """The node daemon hands the job's policy quotas to the handler; its build's steps get at most them."""
    _needs_cgroup("pids")
    policy = TenantPolicySpec.model_validate({"quotas": {"sandboxProcesses": 64}})
    handler = HarborTask()
    JobConfig.build(load_spec(BASE_SPEC), job="j", node="n", handler=handler, policy=policy)
    assert handler.scope.quotas.sandbox_processes == 64
    handler.bind(replace(handler.scope, roots=None))  # read in place (the private copy: test_build_context.py)
    _context(tmp_path, "for i in $(seq 200); do sleep 5 & done; wait")
    with pytest.raises(ImageBuildError, match="process bound of 64 "):
        handler._build(build_image, str(tmp_path))
