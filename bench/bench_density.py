"""Sandbox density: PSS per sandbox, bash-only and with its IPython kernel, many sandboxes alive at once.

Where it sits: run by the bench runner (`python -m bench density`) through `run(quick)`, or alone as
``python -m bench.bench_density [--n 128] [--quick]`` (prints its own table and the breakdown). Rows:
``{benchmark, ours, baseline, ratio, target, met}``; results go to bench/results/RESULTS-sandbox.md by hand.

What is measured (smem's way: the sum of ``Pss`` from ``/proc/PID/smaps_rollup`` over every process of
every sandbox — bwrap, the exec server, bash, the kernel — while all N are alive, so pages shared
between sandboxes are divided among them and the bench process's own share is not counted):

1. N sandboxes created (8 at a time), each answering ``bash("true")``: PSS per sandbox. Target ≤ 5 MB.
2. the same N sandboxes after one IPython cell each (``x = 1``; the kernel starts on that first cell,
   4 at a time): PSS per sandbox, today's kernel (jupyter_client in the server, an ipykernel process).
   Target ≤ 20 MB.
3. the lever for 2, measured outside any sandbox, side by side in the same run: N IPython shells
   (``InteractiveShell`` in a process, no ZeroMQ, no ipykernel), each one cell, started as N
   processes of their own against N forked from one template that imported IPython and built its
   shell once (``gc.freeze()`` then ``fork``; each child runs its cell in its copy of the shell):
   what copy-on-write sharing of the import heap buys. Not yet the product's path (see the docs'
   benchmarks page: the template must fork each kernel into its sandbox's namespaces).

Next step: the row for a template-forked kernel inside the sandboxes once that path exists.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time

from rolloutd.sandbox import SandboxSpec, create_sandbox


def pss_kb(pid: int) -> int:
    """``Pss`` of one process in kB (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def tree(root: int, kids: dict[int, list[int]]) -> list[int]:
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def kind(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return "gone"
    if argv[0].endswith(b"bwrap"):
        return "bwrap"
    if b"ipykernel_launcher" in argv or any(a.endswith(b"ipyrunner.py") for a in argv):
        return "kernel"
    if argv[0].endswith(b"bash"):
        return "bash"
    if b"-c" in argv and any(a.startswith(b"import sys,marshal") for a in argv):
        return "server"
    return "other"


def measure(roots: list[int]) -> tuple[int, dict[str, int]]:
    """(total PSS in kB, kB by kind of process) over the process trees of `roots`."""
    kids = children_map()
    by: dict[str, int] = {}
    for root in roots:
        for pid in tree(root, kids):
            by[kind(pid)] = by.get(kind(pid), 0) + pss_kb(pid)
    return sum(by.values()), by


async def _bounded(items, fn, limit: int) -> list:
    sem = asyncio.Semaphore(limit)

    async def one(x):
        async with sem:
            return await fn(x)

    return await asyncio.gather(*(one(x) for x in items))


async def _sandboxes(n: int) -> dict:
    try:  # this checkout: the sandbox settings, read here from the environment (an older one reads it itself)
        from rolloutd.crds.kit.settings import SandboxSettings
        settings = (SandboxSettings.from_env(),)
    except ImportError:
        settings = ()
    sbs = []
    try:
        async def make(_):
            sb = await create_sandbox(SandboxSpec(), *settings)
            sbs.append(sb)
            r = await sb.bash("true")
            assert r.exit_code == 0, r
            return sb

        t = time.monotonic()
        await _bounded(range(n), make, 8)
        made = time.monotonic() - t
        await asyncio.sleep(1.0)  # let the starts' transient allocations settle
        roots = [sb._proc.pid for sb in sbs]
        bash_total, bash_by = measure(roots)

        async def cell(sb):
            r = await sb.ipython("x = 1\nx", timeout=120)
            assert r.error is None and r.result == "1", r

        t = time.monotonic()
        await _bounded(sbs, cell, 4)
        kernels = time.monotonic() - t
        await asyncio.sleep(1.0)
        kern_total, kern_by = measure(roots)
        return {"n": n, "bash": (bash_total, bash_by), "kernel": (kern_total, kern_by),
                "seconds": (made, kernels)}
    finally:
        await asyncio.gather(*(sb.close() for sb in sbs), return_exceptions=True)


# -- 3. the lever: a template that imported IPython once, forked -----------------------------------

_SHELL = r"""
import io, os, sys
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

def shell():
    c = Config()
    c.HistoryManager.hist_file = ":memory:"  # n shells on one history database would lock each other
    return InteractiveShell.instance(config=c)

def serve(sh, r, w):
    sys.stdout = io.StringIO()  # what the cell prints is captured, as a kernel would send it
    res = sh.run_cell("x = 1\nx")
    assert res.result == 1, res
    os.write(w, b"ok\n")
    os.read(r, 1)   # until the bench closes our stdin
    os._exit(0)
"""
_EXEC = _SHELL + "\nserve(shell(), 0, 1)\n"
# the template builds and warms its shell once (so the children dirty little of its heap), then forks
_TEMPLATE = _SHELL + r"""
import gc
sh = shell()
sh.run_cell("pass", silent=True)
gc.collect(); gc.freeze()
n = int(sys.argv[1])
for _ in range(n):
    if os.fork() == 0:
        serve(sh, 0, 1)
os.write(1, b"T%d\n" % os.getpid())
os.read(0, 1)
"""


def _shells(n: int, forked: bool) -> tuple[int, int]:
    """(total PSS kB of the n shells and their template, seconds to have them all ready)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "MALLOC_ARENA_MAX": "1",
           "IPYTHONDIR": "/tmp/rolloutd-bench-ipython"}
    t = time.monotonic()
    if forked:
        procs = [subprocess.Popen([sys.executable, "-c", _TEMPLATE, str(n)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, env=env)]
        lines = [procs[0].stdout.readline() for _ in range(n + 1)]
        assert sum(x == b"ok\n" for x in lines) == n, lines
        roots = [procs[0].pid]
    else:
        procs = []
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", _EXEC], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, env=env))
            if len(procs) % 4 == 0:  # 4 starting at a time, as in row 2
                assert all(p.stdout.readline() == b"ok\n" for p in procs[-4:])
        assert all(p.stdout.readline() == b"ok\n" for p in procs[len(procs) - len(procs) % 4:])
        roots = [p.pid for p in procs]
    ready = time.monotonic() - t
    time.sleep(1.0)
    kids = children_map()
    total = sum(pss_kb(pid) for root in roots for pid in tree(root, kids))
    for p in procs:
        p.stdin.close()
        p.wait()
    return total, ready


# -- the rows -----------------------------------------------------------------------------------------


def _mb(kb: float) -> str:
    return f"{kb / 1024:.1f} MB"


def _baseline(tree: str, n: int) -> dict:
    """`_sandboxes(n)` run with the `rolloutd` of another checkout (`tree`, e.g. ``git archive`` of main)."""
    import json

    with tempfile.TemporaryDirectory() as shim:
        os.symlink(os.path.abspath(tree), os.path.join(shim, "rolloutd"))
        env = {**os.environ, "PYTHONPATH": shim}  # before the editable install's finder
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        out = subprocess.run([sys.executable, "-m", "bench.bench_density", "--sandboxes-json", "--n", str(n)],
                             cwd=here, env=env, check=True, stdout=subprocess.PIPE).stdout
    return json.loads(out.splitlines()[-1])


def _per(got: dict, n: int, key: str) -> str:
    total, by = got[key]
    parts = ", ".join(f"{k} {_mb(by.get(k, 0) / n)}" for k in ("server", "kernel", "bash", "bwrap") if by.get(k))
    return f"{_mb(total / n)} ({parts}; total {_mb(total)})"


def run(quick: bool = False, n: int | None = None, baseline: str | None = None) -> list[dict]:
    """`baseline`: a checkout of the code to compare with, measured first in the same run."""
    n = n or (8 if quick else 128)
    # our own sandbox directory: tests running meanwhile on this machine expect theirs to empty out
    own_dir = None if os.environ.get("ROLLOUTD_SANDBOX_DIR") else tempfile.mkdtemp(prefix="rolloutd-bench-density-")
    if own_dir:
        os.environ["ROLLOUTD_SANDBOX_DIR"] = own_dir
    try:
        base = _baseline(baseline, n) if baseline else None
        got = asyncio.run(_sandboxes(n))
    finally:
        if own_dir:
            del os.environ["ROLLOUTD_SANDBOX_DIR"]
            os.rmdir(own_dir)
    own, forked = _shells(n, forked=False), _shells(n, forked=True)
    print(f"seconds: {n} sandboxes ready {got['seconds'][0]:.1f}, their first cells {got['seconds'][1]:.1f}; "
          f"shells own {own[1]:.1f}, forked {forked[1]:.1f}"
          + (f"; baseline ready {base['seconds'][0]:.1f}, cells {base['seconds'][1]:.1f}" if base else ""),
          file=sys.stderr)
    rows = []
    for key, what, target in (("bash", "bash only", 5), ("kernel", "with its IPython kernel, one cell run", 20)):
        total = got[key][0]
        rows.append({"benchmark": f"PSS per sandbox, {what} ({n} alive at once)", "ours": _per(got, n, key),
                     "baseline": f"{baseline}: {_per(base, n, key)}" if base else "-",
                     "ratio": base[key][0] / total if base else None, "target": f"≤ {target} MB",
                     "met": total / n <= target * 1024})
    rows.append({"benchmark": f"lever, outside sandboxes: PSS per IPython shell (no ZeroMQ), {n} forked from one "
                              f"template vs {n} started on their own, one cell each",
                 "ours": _mb(forked[0] / n), "baseline": f"own process {_mb(own[0] / n)}",
                 "ratio": own[0] / forked[0], "target": "(reference)", "met": None})
    return rows


def main() -> None:
    n = int(sys.argv[sys.argv.index("--n") + 1]) if "--n" in sys.argv else None
    if "--sandboxes-json" in sys.argv:  # `_baseline`'s child
        import json

        print(json.dumps(asyncio.run(_sandboxes(n or 8))))
        return
    baseline = sys.argv[sys.argv.index("--baseline") + 1] if "--baseline" in sys.argv else None
    rows = run(quick="--quick" in sys.argv, n=n, baseline=baseline)
    from bench.__main__ import render

    print(render(rows), end="")


if __name__ == "__main__":
    main()
