"""Where a cold sandbox's CPU and wall time go: its start taken apart, one step added at a time, serial.

Where it sits: a diagnostic beside `bench_burst.py` (not a row of the runner), run as
``python -m bench.cold_profile [--runs 15]``. Each step runs `runs` times alternating with the others; per step
the median CPU of the started processes (``RUSAGE_CHILDREN``: bwrap, the server, bash, all reaped before the
next run), the daemon's own CPU (``RUSAGE_SELF``) and the wall time. Steps:

* bare: ``bwrap --ro-bind / / --unshare-all --die-with-parent true`` (the issue's baseline)
* opts → true: the sandbox's own bwrap command line (its mounts, namespaces, seccomp, cgroup join) running
  ``/bin/true`` instead of the exec server; variants without the seccomp program, without /etc's covered
  secrets, without the cgroup join, without /sys;
* opts → python: the same running ``python -I -S -c pass``; opts → server imports: the launcher's imports,
  the uid change (become) and no more;
* full: ``create`` + ``bash("true")`` + ``close`` through the product's API, its parts timed in the daemon;
  ``--daemon``: the daemon's share under cProfile.

Next: the numbers go to bench/results/RESULTS-sandbox.md ("Where a cold sandbox's time goes").
"""
from __future__ import annotations

import asyncio
import os
import resource
import statistics
import subprocess
import sys
import time

from rolloutd.sandbox import SandboxSpec, get_runtime
from rolloutd.sandbox.host.footprint import Layout, remove
from rolloutd.sandbox.launch import LaunchConfig
from rolloutd.sandbox.host.limits import Cgroup, rlimits_for
from rolloutd.sandbox.runtimes.base import CGROUP_JOIN, sandbox_env

BARE = ["bwrap", "--ro-bind", "/", "/", "--unshare-all", "--die-with-parent", "true"]
IMPORTS = ("import sys,marshal;c=marshal.loads(bytes.fromhex(sys.argv[1]));sys.path[:0]=c['path'][:1];"
           "from server.first_bash import become;become(c);sys.path+=c['path'][1:];import server.main")


def cpu(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def launch_argv(*, seccomp: bool = True, etc: bool = True, cgroup: bool = True,
                sys_: bool = True) -> tuple[list[str], tuple, object]:
    """The sandbox's command line as `runtimes/base.py` builds it (its server argv at the end), its fds, and
    what to remove afterwards."""
    rt, spec = get_runtime("bwrap"), SandboxSpec()
    fds = rt.open_fds()
    layout = Layout.new()
    who, inside = rt.identity(spec), rt.inside(layout)
    config = LaunchConfig(socket=f"{inside.ctl}/exec.sock", workspace=inside.workspace, ctl_dir=inside.ctl,
                          runtime_dir=inside.runtime_dir, env=sandbox_env(spec, layout.id, HOME=inside.home),
                          rlimits=rlimits_for(spec.limits, nproc=rt.rlimit_nproc(who.uid)),
                          wall_seconds=spec.limits.wall_seconds, uid=who.uid, gid=who.gid)
    argv = rt.launch(spec, layout, config, fds).argv
    if not seccomp:
        at = argv.index("--seccomp")
        del argv[at:at + 2]
    if not etc or not sys_:
        out, i = [], 0
        while i < len(argv):
            bind = argv[i + 1:i + 3] if argv[i] == "--ro-bind" else [None, ""]
            if (not etc and bind[1].startswith("/etc/")) or (not sys_ and bind == ["/sys", "/sys"]):
                i += 3
                continue
            out.append(argv[i])
            i += 1
        argv = out
    cg = Cgroup.create(layout.id, spec.limits.memory_mb, spec.limits.processes, spec.limits.cpus) if cgroup else None
    if cg is not None:
        argv = ["/bin/sh", "-c", CGROUP_JOIN, "sh", *(str(d) for d in cg.dirs), "--", *argv]
    return argv, fds, (layout, cg)


def run_inside(tail: list[str], **kw) -> tuple[float, float, float]:
    """(children CPU, own CPU, wall) of the sandbox's bwrap running `tail` instead of its server."""
    s0, c0, t0 = cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN), time.perf_counter()
    argv, fds, (layout, cg) = launch_argv(**kw)
    cut = len(argv) - argv[::-1].index("--")   # the server's argv follows bwrap's last "--"
    wire = argv[-1]
    full = argv[:cut] + [t.replace("WIRE", wire) for t in tail]
    subprocess.run(full, pass_fds=fds, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, check=False,
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    took = time.perf_counter() - t0
    for fd in fds:
        os.close(fd)
    remove(layout.root, cg)
    return cpu(resource.RUSAGE_CHILDREN) - c0, cpu(resource.RUSAGE_SELF) - s0, took


def bare() -> tuple[float, float, float]:
    s0, c0, t0 = cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run(BARE, check=True)
    return cpu(resource.RUSAGE_CHILDREN) - c0, cpu(resource.RUSAGE_SELF) - s0, time.perf_counter() - t0


async def full_once(rt) -> dict[str, float]:
    out = {}
    s0, c0, t0 = cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN), time.perf_counter()
    sb = await rt.create(SandboxSpec())
    s1, t1 = cpu(resource.RUSAGE_SELF), time.perf_counter()
    await sb.bash("true")
    s2, t2 = cpu(resource.RUSAGE_SELF), time.perf_counter()
    await sb.close()
    s3, t3 = cpu(resource.RUSAGE_SELF), time.perf_counter()
    out["children"] = cpu(resource.RUSAGE_CHILDREN) - c0
    out["self create"], out["self bash"], out["self close"] = s1 - s0, s2 - s1, s3 - s2
    out["wall create"], out["wall bash"], out["wall close"] = t1 - t0, t2 - t1, t3 - t2
    return out


def daemon_side(runs: int) -> None:
    """``--daemon``: where the daemon's own CPU goes in create + bash + close (cProfile, top functions)."""
    import cProfile
    import pstats

    rt = get_runtime("bwrap")

    async def go() -> None:
        for _ in range(runs):
            sb = await rt.create(SandboxSpec())
            await sb.bash("true")
            await sb.close()

    prof = cProfile.Profile()
    prof.runcall(asyncio.run, go())
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def main() -> None:
    args = sys.argv[1:]
    runs = int(args[args.index("--runs") + 1]) if "--runs" in args else 15
    if "--daemon" in args:
        return daemon_side(runs)
    py = [sys.executable, "-I", "-S"]
    steps = {
        "bare bwrap --unshare-all true": bare,
        "opts → /bin/true": lambda: run_inside(["/bin/true"]),
        "opts → /bin/true, no seccomp": lambda: run_inside(["/bin/true"], seccomp=False),
        "opts → /bin/true, /etc secrets not covered": lambda: run_inside(["/bin/true"], etc=False),
        "opts → /bin/true, no cgroup join": lambda: run_inside(["/bin/true"], cgroup=False),
        "opts → /bin/true, no /sys": lambda: run_inside(["/bin/true"], sys_=False),
        "opts → python -I -S -c pass": lambda: run_inside([*py, "-c", "pass"]),
        "opts → server imports + become": lambda: run_inside([*py, "-c", IMPORTS, "WIRE"]),
        "opts → /bin/bash --norc -c true": lambda: run_inside(["/bin/bash", "--norc", "--noprofile", "-c", "true"]),
    }
    got: dict[str, list[tuple[float, float, float]]] = {k: [] for k in steps}
    rt = get_runtime("bwrap")
    full: list[dict[str, float]] = []
    load0 = os.getloadavg()[0]
    for _ in range(runs):
        for name, step in steps.items():
            got[name].append(step())
        full.append(asyncio.run(full_once(rt)))
    print(f"load average (1 min) {load0:.2f} → {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; {runs} runs each")
    print("| step | CPU of its processes | daemon CPU | wall |\n|---|---|---|---|")
    for name, xs in got.items():
        med = [statistics.median(x[i] for x in xs) * 1000 for i in range(3)]
        print(f"| {name} | {med[0]:.1f} ms | {med[1]:.1f} ms | {med[2]:.1f} ms |")
    med = {k: statistics.median(f[k] for f in full) * 1000 for k in full[0]}
    print(f"| full: create + bash true + close (API) | {med['children']:.1f} ms | create {med['self create']:.1f} "
          f"+ bash {med['self bash']:.1f} + close {med['self close']:.1f} ms | create {med['wall create']:.1f} "
          f"+ bash {med['wall bash']:.1f} + close {med['wall close']:.1f} ms |")


if __name__ == "__main__":
    main()
