"""Stalls: team-b's GET latency while team-a does its worst legal thing, beside an idle window, in one run.

    python -m bench stalls           (writes bench/results/RESULTS-stalls.md; --quick: smaller loads)
    ROLLOUTD_STALLS_GROUPS=100000 python -m bench stalls      (the batch's size; default 2000)
    ROLLOUTD_STALLS_SECONDS=60 …     (the idle, bombs and half-open windows' length; default 8)
    ROLLOUTD_STALLS_PARTS=bombs …    (the windows to run after idle, of batch,bombs,half-open; default all; a
                                      subset writes a section of its own in the results file)

One real `rolloutd controller` (`bench_scale.Controller`: nothing starts, 0 nodes). team-b GETs its own job in
a loop with its namespace token, four windows one after the other: idle; while a batch of many groups is
requested on a batch job (`batch`); while YAML alias bombs are POSTed in a loop by team-a's namespace token
(`bombs`; its request rate, 50/s by default, holds it); while many connections are held open without sending a
request head (`half-open`). Reported per window: team-b's GET
p50/p99/max and the ratio of its p99 to the idle one (goal of issue 36: within 2×), and the same of team-b's node
heartbeat (one registered node of its job, the beat in turn with the GET). The setup is `teams.py`'s. The batch is
team-a's own request, with its namespace token, on a job its TenantPolicy allows (`quotas.itemsPerJob` = the
batch's rollouts: the legal worst case); its window lasts until every group is open (the fill goes on after the
request returns), and the controller's CPU time, peak memory and store size over it are reported.
`$ROLLOUTD_STALLS_BEFORE=REV` (e.g. main) measures that revision's controller first in the same run, and the
results file shows both tables (side by side on the same loaded box).
"""
from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from bench.bench_pipeline import _cpu_seconds
from bench.bench_scale import P, older_source
from bench.teams import job, two_teams
from rolloutd.controller.access.auth import create_scoped_token

HERE = Path(__file__).resolve().parent
DEFAULT_GROUPS = 2000
BOMB = ("a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8))).encode()
# team-a's bomber is a process of its own, as a hostile tenant is: in the bench's process its loop would hold
# the GIL that team-b's probe needs, and the window would measure the bench, not the controller
# (it prints how many bombs were answered, and how many of them 429, when it is told to stop)
_BOMBER = """
import collections, signal, sys, httpx
url, token, path, bomb = sys.argv[1:5]
codes = collections.Counter()
def stop(*_):
    print(sum(codes.values()), codes[429], flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}", "Content-Type": "application/yaml"}) as a:
    while True:
        codes[a.post(path, content=bomb.encode()).status_code] += 1
"""
PARTS = ("batch", "bombs", "half-open")


def measure(groups: int, seconds: float, half_open: int, src: Path | None = None, parts=PARTS) -> dict:
    with two_teams(64, "bench-stalls-", src) as t:
        ctl = t.ctl
        big = job("big", t.source, 64, 8, t.health.urls)
        big["spec"]["batches"] = {"groups": groups}
        a = _team_a(t, groups * 8)
        r = a.post(f"{P}/namespaces/team-a/rolloutjobs", json=big)
        if r.status_code != 201:
            raise RuntimeError(f"team-a's batch job was refused: {r.text[:500]}")
        opened = threading.Event()
        batch_stats: dict = {}

        def batch(stop: threading.Event) -> None:
            """team-a's batch request: answered once every group is open (the fill goes on after its first step,
            off the loop, and the request waits for it)."""
            pid, t0 = ctl.proc.pid, time.monotonic()
            cpu0 = _cpu_seconds(pid)
            try:
                r = a.post(f"{P}/namespaces/team-a/rolloutjobs/big/batches", json={}, timeout=None)
                r.raise_for_status()
                if r.json()["openedGroups"] < groups:
                    raise RuntimeError(f"the batch answered with {r.json()['openedGroups']} of {groups} groups open")
                batch_stats.update(fill_s=time.monotonic() - t0, cpu_s=_cpu_seconds(pid) - cpu0, peak_mb=_peak_mb(pid),
                                   store_mb=sum(f.stat().st_size for f in (t.root / "data").glob("*.db*")) / 2 ** 20)
            except Exception as e:  # noqa: BLE001 - raised again once the probe's window ends
                batch_stats["error"] = e
            finally:
                opened.set()

        bombed: dict = {}

        def bombs(stop: threading.Event) -> None:
            bomber = subprocess.Popen([sys.executable, "-c", _BOMBER, ctl.url, a.headers["authorization"][7:],
                                       f"{P}/namespaces/team-a/rolloutjobs", BOMB.decode()], stdout=subprocess.PIPE)
            t0 = time.monotonic()
            try:
                stop.wait()
            finally:
                bomber.terminate()
                answered, refused = (bomber.communicate(timeout=30)[0].split() or [b"0", b"0"])[:2]
                bombed.update(n=int(answered), refused=int(refused), s=time.monotonic() - t0)

        def hold(stop: threading.Event) -> None:
            socks = []
            try:
                for _ in range(half_open):
                    socks.append(socket.create_connection(("127.0.0.1", ctl.port)))
                    socks[-1].sendall(b"GET /healthz HTTP/1.1\r\n")
                stop.wait()
            finally:
                for s in socks:
                    s.close()

        cpu0, t0 = _cpu_seconds(ctl.proc.pid), time.monotonic()
        out = {"idle": t.window(seconds, None)}
        idle_cpu = (_cpu_seconds(ctl.proc.pid) - cpu0) / (time.monotonic() - t0)  # the controller's, per second
        if "batch" in parts:
            t0 = time.monotonic()
            worker = threading.Thread(target=batch, args=(threading.Event(),))
            worker.start()
            out["batch"] = t.probe(24 * 3600.0, opened, at_least=seconds)  # until every group is open
            worker.join()
            if "error" in batch_stats:
                raise batch_stats["error"]
            out["idle-after"] = t.window(seconds, None)  # the store holding the batch's rollouts, nothing running
            out["batch_s"] = time.monotonic() - t0
            out["batch_stats"] = {**batch_stats, "load": os.getloadavg()[0]}
        if "bombs" in parts:
            cpu0, t0 = _cpu_seconds(ctl.proc.pid), time.monotonic()
            out["bombs"] = t.window(seconds, bombs)
            out["bombed"] = {**bombed, "idle_cpu": idle_cpu,
                             "cpu": (_cpu_seconds(ctl.proc.pid) - cpu0) / (time.monotonic() - t0)}
        if "half-open" in parts:
            out["half-open"] = t.window(seconds, hold)
    return out


def _team_a(t, items: int) -> httpx.Client:
    """team-a's namespace token, under a TenantPolicy allowing `items` rollouts per job (its dataset, its backends)."""
    t.root.chmod(0o755)  # a tenant's data must be readable by any user (the policy's check)
    t.source.chmod(0o644)
    policy = {"apiVersion": "rolloutd.io/v1alpha1", "kind": "TenantPolicy", "metadata": {"name": "team-a"},
              "spec": {"dataRoots": [str(t.root)], "backends": [t.health.urls[0].rsplit("/", 1)[0]],
                       "quotas": {"itemsPerJob": max(items, 100_000)}}}
    t.ctl.api.put(f"{P}/tenantpolicies/team-a", json=policy).raise_for_status()
    token = create_scoped_token(t.root / "data" / "tokens", "team-a", read_only=False, namespaces=["team-a"])
    return httpx.Client(base_url=t.ctl.url, headers={"Authorization": f"Bearer {token.token}"}, timeout=300)


def _peak_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _table(m: dict, names: dict) -> str:
    rows = []
    for k in (k for k in names if k in m):
        cells = []
        for kind in ("get", "beat"):
            x, idle = m[k][kind], m["idle"][kind]["p99"]
            cells.append(f"{x['n']} | {x['p50']:.1f} | {x['p99']:.1f} | {x['max']:.1f} | {x['p99'] / idle:.2f}×")
        rows.append(f"| {names[k]} | {' | '.join(cells)} |\n")
    return ("| team-b while | GET n | p50 ms | p99 ms | max ms | p99 / idle | beat n | p50 ms | p99 ms | max ms | "
            "p99 / idle |\n|---|---|---|---|---|---|---|---|---|---|---|\n" + "".join(rows))


def run(quick: bool = False) -> list[dict]:
    """`$ROLLOUTD_STALLS_BEFORE=REV`: that revision's controller is measured first, in the same run (side by side).
    `$ROLLOUTD_STALLS_GROUPS=N`: the batch's groups (default 2000; 500 with --quick). The default size rewrites the
    results file's top and keeps its `## ` sections; another size writes (or replaces) a section of its own."""
    groups, seconds, half_open = (500, 4.0, 300) if quick else (DEFAULT_GROUPS, 8.0, 1000)
    groups = int(os.environ.get("ROLLOUTD_STALLS_GROUPS") or groups)
    seconds = float(os.environ.get("ROLLOUTD_STALLS_SECONDS") or seconds)
    parts = tuple(p for p in PARTS if p in (os.environ.get("ROLLOUTD_STALLS_PARTS") or ",".join(PARTS)).split(","))
    before_rev = os.environ.get("ROLLOUTD_STALLS_BEFORE")
    before = None
    if before_rev:
        with older_source(before_rev) as src:
            before = measure(groups, seconds, half_open, src, parts)
    load0 = os.getloadavg()[0]
    m = measure(groups, seconds, half_open, parts=parts)
    names = {"idle": "idle", "batch": f"a batch of {groups} groups × 8 requested (team-a's token, its policy allowing it)",
             "idle-after": "idle again, the batch's rollouts stored",
             "bombs": "YAML alias bombs POSTed in a loop", "half-open": f"{half_open} connections with half a head"}
    table = _table(m, names)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    b = m.get("batch_stats")
    fill = "" if b is None else (
            f"The batch: every group was open and the request answered {b['fill_s']:.0f} s after it was sent (the batch "
            f"window lasted that long); the controller's CPU time over it {b['cpu_s']:.0f} s, its peak "
            f"resident memory {b['peak_mb']:.0f} MB, the store {b['store_mb']:.0f} MB on disk after; load "
            f"{b['load']:.1f} at its end. team-b's three slowest calls in that window (s into it, ms): GET "
            f"{m['batch']['get']['worst']}, beat {m['batch']['beat']['worst']}.\n")
    if "bombs" in m:
        x = m["bombed"]
        fill += (f"team-a's bomber (its namespace token, one connection, one request after the other): {x['n']} bombs "
                 f"answered in {x['s']:.1f} s ({x['n'] / x['s']:.0f}/s), {x['refused']} of them 429; the controller's "
                 f"CPU {x['cpu']:.2f} s per s in that window, {x['idle_cpu']:.2f} in the idle one.\n")
    if not quick:
        side = "" if before is None else (
            f"\nThe controller of `{before_rev}`, measured just before in the same run"
            + ("" if b is None else
               f" (the batch took {before['batch_s']:.1f} s to open there, {m['batch_s']:.1f} s here)")
            + f":\n\n{_table(before, names)}")
        if before is not None and "bombs" in before:
            x = before["bombed"]
            side += (f"\nThere, team-a's bomber: {x['n']} bombs answered in {x['s']:.1f} s ({x['n'] / x['s']:.0f}/s); "
                     f"the controller's CPU {x['cpu']:.2f} s per s, {x['idle_cpu']:.2f} idle.\n")
        head = (f"`python -m bench stalls` on {platform.node()} ({platform.machine()}, {os.cpu_count()} cores, shared "
                f"with other jobs, load {load0:.1f}→{os.getloadavg()[0]:.1f}), {stamp}. Windows of {seconds:.0f} s "
                f"each (the batch's: until every group is open), one after the other, in one run; team-b's GET of its "
                f"job and its node's heartbeat in turn.\n\n{table}{side}\n{fill}\nGoal: team-b's p99 within 2× of "
                f"idle in each window.\n")
        _write(head, f"## Windows {', '.join(parts)} only" if parts != PARTS else
               None if groups == DEFAULT_GROUPS else f"## A batch of {groups} groups")
    return [{"benchmark": f"stalls: team-b {kind} p99 while team-a {names[k]}", "ours": f"{m[k][kind]['p99']:.1f} ms",
             "baseline": f"{m['idle'][kind]['p99']:.1f} ms idle",
             "ratio": m[k][kind]["p99"] / m["idle"][kind]["p99"], "target": "≤ 2×",
             "met": m[k][kind]["p99"] <= 2 * m["idle"][kind]["p99"]}
            for k in parts for kind in ("get", "beat")]


def _write(text: str, heading: str | None) -> None:
    """`text` as the results file's top (`heading` None; its `## ` sections kept) or as the section `heading`
    (replacing one of that name, else added before the others)."""
    out = HERE / "results" / "RESULTS-stalls.md"
    old = out.read_text() if out.exists() else ""
    cut = old.find("\n## ")
    top, sections = (old[:cut + 1], old[cut + 1:]) if cut >= 0 else (old, "")
    if heading is None:
        out.write_text(f"# Stalls (issue 36)\n\n{text}\n{sections}")
        return
    parts = [p for p in sections.split("\n## ") if p.strip()]
    parts = ["## " + p.removeprefix("## ") for p in parts]
    parts = [p for p in parts if not p.startswith(heading + "\n")]
    out.write_text(top.rstrip("\n") + "\n\n" + "\n".join([f"{heading}\n\n{text}", *parts]).rstrip("\n") + "\n")


if __name__ == "__main__":
    print(run())
