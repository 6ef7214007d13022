"""One controller, a simulated cluster: N node daemons × 64 slots against a real `rolloutd controller`.

For each N (10, 100, 300, 1000; `$ROLLOUTD_SCALE_NODES`): a fresh controller process (the
production one: uvicorn, SQLite WAL, the local executor asked for 0 nodes), one `bench-noop` job
with 4 backends (a `/health` stub) and enough items for the run, and N simulated daemons
(`tests/support/sim/simnodes.py`, 1–2 processes) speaking the real node protocol with the daemon's own timing:
rollouts last lognormal(median 40 s, σ 0.5) / `$ROLLOUTD_SCALE_TIME_FACTOR` (default 1); leases
ride on beat and results replies (a 1.5 s long-poll after a short answer); beats every
`heartbeatSeconds` (from registration) and on stage changes at most every `heartbeat_min_gap`;
results coalesced by `crds.node.result_coalesce` (5 ms up to 100 nodes, 250 ms at 1000), ≤ 64 per
call (every daemon timing is divided
by the same factor). The first 64 rollouts of each node start at a random point of their life,
so the cluster is in a steady state from the first second and a 30 s window measures it.

Reported per N, over the window (after a warm-up): rollouts/s accepted, controller CPU (cores,
ms per rollout and per call, the kernel's part, /proc/PID/stat), client-side p50/p99 of lease, heartbeat and results
calls, bytes the controller wrote (/proc/PID/io write_bytes: the db, its WAL, checkpoints) per
rollout, the db + WAL size, and an audit of the trajectories the controller serves against the
results it accepted (lost, duplicated, phantom: all must be 0). With py-spy (`pip install
py-spy`) the largest N is also profiled for 15 s after its window (top frames in the JSON).
`$ROLLOUTD_SCALE_BEFORE=REV` runs that revision's controller first at every N (side by side);
`$ROLLOUTD_SCALE_NICE=-10` (root) prioritises the bench's sessions on a shared box. The controller's event loop
lag (`controller/health/looplag.py`, read from /metrics every 2 s as `bench ui_live` does) is reported beside the
p99s: the largest lag of the window and the samples late by more than 5 and 20 ms. `$ROLLOUTD_SCALE_STALLS=1` turns on the
controller's stall sampler (`controller/health/stalls.py`: the functions the loop ran while it stalled > 20 ms, over the
window, in the JSON's `stalls`; it costs a little: compare timings without it). Raw numbers:
`bench/results/scale-results/$ROLLOUTD_SCALE_LABEL.json` (default `latest`); `plot_scale.py` draws them,
`python -m bench.bench_scale --table FILE` prints the table. Results: bench/results/RESULTS-scale.md.
Goals (issue 16): at 1000 nodes p99 ≤ 50 ms for every node call, the controller below one core,
≥ 1000 rollouts/s sustained.
"""
from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench import scale_replicas, scale_stores
from bench.bench_pipeline import NOOP, PLUGINS, REPO, _cpu_seconds, _cpu_times, _port, _wait_http
from support.sim import module_command
from support.sim.noop import SLOTS, HealthServer, noop_job as _job
from support.sim.ledger import audit, delivered

P = "/apis/rolloutd.io/v1alpha1"
HERE = Path(__file__).resolve().parent
MEDIAN_SECONDS, SIGMA = 40.0, 0.5


def _prioritize(pid: int) -> None:
    """`$ROLLOUTD_SCALE_NICE` (e.g. -10, as root) for a process the bench started in a session of its
    own. With autogroup scheduling (sched_autogroup_enabled=1) a session shares the CPU equally with
    every other busy session, whatever its processes' nice: on a box where other sessions keep ten
    processes busy the controller got 0.2–0.4 of a core. The session's autogroup nice is what counts."""
    nice = os.environ.get("ROLLOUTD_SCALE_NICE")
    if nice:
        try:
            Path(f"/proc/{pid}/autogroup").write_text(nice)
            os.setpriority(os.PRIO_PROCESS, pid, int(nice))
        except OSError as e:
            print(f"   cannot set nice {nice} on {pid}: {e}", file=sys.stderr)


@contextlib.contextmanager
def older_source(rev: str):
    """`rev`'s packages (from `git archive`), importable as `rolloutd.*` when the yielded folder
    leads PYTHONPATH: the same bench drives the older controller, side by side with this one."""
    tmp = Path(tempfile.mkdtemp(prefix="rolloutd-scale-src-"))
    tree, shim = tmp / "tree", tmp / "shim" / "rolloutd"
    tree.mkdir()
    try:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        shim.mkdir(parents=True)
        for name, folder in (("controller", "controller"), ("crds", "crds"), ("agents", "agents"),
                             ("sandbox", "sandbox"), ("client", "controller/client")):
            (shim / name).symlink_to(tree / folder)
        yield shim.parent
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    return 0


GROUP_COUNTERS = ("node_call_groups", "node_calls_grouped", "node_call_group_seconds", "node_call_group_wait_seconds")


def _groups_delta(before: list[dict | None], after: list[dict | None], window: float) -> dict | None:
    """The window's node-call groups, every replica's together: calls a group, a group's time, a call's wait for
    its group, and the share of the window some group ran (`busy`, summed over replicas: near 1 each, a full lane)."""
    if any(d is None for d in before + after):
        return None
    d = {name: sum(a[name] - b[name] for a, b in zip(after, before)) for name in GROUP_COUNTERS}
    groups, calls = max(d["node_call_groups"], 1), max(d["node_calls_grouped"], 1)
    return {"calls_per_group": round(d["node_calls_grouped"] / groups, 1),
            "group_ms": round(d["node_call_group_seconds"] / groups * 1e3, 2),
            "wait_ms_per_call": round(d["node_call_group_wait_seconds"] / calls * 1e3, 1),
            "busy": round(d["node_call_group_seconds"] / window, 3)}


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Controller:
    """A `rolloutd controller` process with a fresh data dir."""

    def __init__(self, root: Path, src: Path | None = None, store: str | None = None, data: Path | None = None,
                 port: int | None = None, env: dict[str, str] | None = None) -> None:
        """`store`: a PostgreSQL URL (`--store`); None: the data dir's SQLite file. `data`, `port`, `env`: a
        replica's (`scale_replicas.py`): the shared data dir, its port, ROLLOUTD_REPLICAS;
        `env` also carries a bench's own settings (`bench_fairshare`: a small ROLLOUTD_MAX_EPISODES_PER_BACKEND)."""
        self.root, self.port = root, port or _port()
        self.data = data or root / "data"
        path = [str(src)] if src else []  # an older rolloutd (see `older_source`) instead of this checkout
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [*path, str(PLUGINS), os.environ.get("PYTHONPATH")])),
               # the stub backends report no max_num_seqs: admission would cap them at 4 × 256 episodes
               # (~30 rollouts/s); the bench measures the node protocol, not the admission
               "ROLLOUTD_MAX_EPISODES_PER_BACKEND": "1000000",
               "ROLLOUTD_TOKENIZER_ROOTS": str(root.parent if data else root),  # the job's "tokenizer" (`_job`)
               **(env or {})}
        if os.environ.get("ROLLOUTD_SCALE_STALLS"):  # the loop's stalls attributed (`controller/health/stalls.py`)
            env["ROLLOUTD_STALL_SAMPLES"] = str(root / "stalls.json")
        self.log = open(root / "controller.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rolloutd.controller.main", "controller", "--data-dir", str(self.data),
             "--port", str(self.port), "--log-level", "warning", "--executors", "local",
             *(("--store", store) if store else ())],
            cwd=REPO, env=env, start_new_session=True, stdout=self.log, stderr=subprocess.STDOUT)
        _prioritize(self.proc.pid)
        self.url = f"http://127.0.0.1:{self.port}"
        _wait_http(self.url + "/healthz")
        token = self.token = (self.data / "token").read_text().strip()
        self.api = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=300)

    def node_credential(self, name: str) -> str:
        """What the executor hands a job's daemons: its node credential (a `before` controller older than
        per-job credentials: its controller-wide join token)."""
        old = self.data / "join-token"
        if old.exists():
            return old.read_text().strip()
        r = self.api.post(f"{P}/namespaces/default/rolloutjobs/{name}/nodes/credential")
        r.raise_for_status()
        return r.json()["credential"]

    def stalls(self) -> dict | None:
        """The stall sampler's report so far (None when it is off, or an older controller)."""
        try:
            return json.loads((self.root / "stalls.json").read_text())
        except (OSError, ValueError):
            return None

    def groups(self) -> dict[str, float] | None:
        """The node calls' group counters from /metrics (`work/node_calls.Collector`); None from a controller
        that does not serve them (an older revision) or did not answer."""
        try:
            r = self.api.get("/metrics")
        except httpx.HTTPError:
            return None
        lines = r.text.splitlines() if r.status_code == 200 else []
        found = {name: float(line.split()[-1]) for line in lines for name in GROUP_COUNTERS
                 if line.startswith(f"rolloutd_{name}_total ")}
        return found if len(found) == len(GROUP_COUNTERS) else None

    def db_bytes(self) -> dict[str, int]:
        data = self.data
        return {name: (data / name).stat().st_size if (data / name).exists() else 0
                for name in ("rolloutd.db", "rolloutd.db-wal")}

    def stop(self) -> None:
        self.api.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.log.close()


def _wait_expanded(api: httpx.Client, name: str, items: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = api.get(f"{P}/rolloutjobs/{name}").json().get("status", {})
        if (status.get("counts") or {}).get("total") == items:
            return
        if status.get("phase") == "Failed":
            raise RuntimeError(f"{name} failed: {status}")
        time.sleep(0.2)
    raise RuntimeError(f"{name}: {items} items not expanded within {timeout}s")


def _profile(pid: int, seconds: float, out: Path) -> subprocess.Popen | None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists() and shutil.which(spy) is None:
        return None
    return subprocess.Popen([spy, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "50",
                             "--nonblocking", "--format", "raw", "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


OWN = ("controller", "crds", "agents", "sandbox")  # py-spy names files relative to their sys.path entry


def top_frames(raw: Path, n: int = 15) -> dict:
    """py-spy's collapsed stacks → the frames with the most samples: on top of the stack (`self`),
    and rolloutd's own functions anywhere in it (`total`, inclusive), in % of all samples."""
    own, total, samples = collections.Counter(), collections.Counter(), 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        c = int(count)
        samples += c
        frames = []
        for f in stack.split(";"):
            func, _, where = f.partition(" (")
            path = where.split(":")[0]
            frames.append((f"{func} ({path.rsplit('/', 1)[-1]})", path))
        own[frames[-1][0]] += c
        for label in {label for label, path in frames if path.split("/")[0] in OWN}:
            total[label] += c
    pct = lambda cnt: [(f, round(100 * v / max(samples, 1), 1)) for f, v in cnt.most_common(n)]  # noqa: E731
    return {"samples": samples, "self": pct(own), "total": pct(total)}


class _LoopOnly:
    """A `watch` with the loop's metrics only (no dashboards)."""

    def __init__(self, loop) -> None:
        self.loop = loop

    def report(self, w0: float, w1: float) -> dict:
        return {"loop": self.loop.report(w0, w1), "ui": None}

    def close(self) -> None:
        self.loop.close()


def _stall_delta(a: dict | None, b: dict | None, w0: float, n: int = 25) -> dict | None:
    """The stall sampler's report over the window: its cumulative counters at the window's end less those at its
    start (the file is rewritten every 5 s: the start's may be up to 5 s older), the functions by stalled ms, and
    the longest stalls begun in the window (from `w0`, wall clock: the sampler keeps its last 30 s's)."""
    if not b:
        return None
    a = a or {}
    diff = lambda key: sorted(((f, round(v - a.get(key, {}).get(f, 0.0), 1)) for f, v in b[key].items()),  # noqa: E731
                              key=lambda x: -x[1])[:n]
    return {"stalls": b["stalls"] - a.get("stalls", 0), "stalled_ms": round(b["stalled_ms"] - a.get("stalled_ms", 0), 1),
            "inclusive_ms": diff("inclusive_ms"), "top_ms": diff("top_ms"),
            "longest": [x for x in b["longest"] if x.get("at", 0.0) >= w0][:5]}


def point(nodes: int, time_factor: float, window: float, profile_seconds: float = 0.0, src: Path | None = None,
          variant: str = "after", watch=None, store: str = "sqlite", replicas: int = 1) -> dict:
    """One sweep point: a fresh controller (from `src` if given) on `store` (sqlite, or postgresql: a server of
    the point's own, `scale_stores.py`), a job, `nodes` simulated daemons; with `watch` (url, token, job → an
    object with `report(w0, w1)` and `close()`), something watching the job meanwhile (`bench_ui_live.Dashboards`)."""
    root = Path(tempfile.mkdtemp(prefix=f"rolloutd-bench-scale-{nodes}-"))
    mean = MEDIAN_SECONDS * math.exp(SIGMA ** 2 / 2) / time_factor
    offered = nodes * SLOTS / mean
    # $ROLLOUTD_SCALE_WARMUP: seconds before the window, for a store whose first results come later than the default
    # allows (PostgreSQL at 1000 nodes: its first results came ~50 s in, after the default's window had ended)
    warmup = float(os.environ.get("ROLLOUTD_SCALE_WARMUP") or 5 + nodes / 100)
    run_for = warmup + window + profile_seconds
    items = int(nodes * SLOTS * 1.1 + offered * run_for * 1.3) // 8 * 8 + 8
    source = root / "rows.jsonl"
    source.write_text("".join(f'{{"id":"r{i}"}}\n' for i in range(items // 8)))
    health = HealthServer()
    server = scale_stores.start_server() if store == "postgresql" else None
    if server:  # the database too: prioritised controllers waiting on a starved server measure the server's wait
        _prioritize(server.pid())
    url = server.create_database("scale") if server else None
    try:
        ctls = scale_replicas.start(Controller, root, src, url, replicas) if replicas > 1 else [Controller(root, src, url)]
        ctl = ctls[0]
    except BaseException:
        if server:
            server.stop()
        raise
    shards: list[subprocess.Popen] = []
    watcher = None
    try:
        name = f"scale-{nodes}"
        ctl.api.put(f"{P}/rolloutjobs/{name}", json=_job(name, source, items, health.urls)).raise_for_status()
        t = time.monotonic()
        _wait_expanded(ctl.api, name, items)
        expand_s = time.monotonic() - t
        watcher = watch(ctl.url, ctl.token, name) if watch else None
        if hasattr(watcher, "pid"):  # a watch that reads the controller's CPU itself (`bench_ui_toggle`)
            watcher.pid = ctl.proc.pid
        if watcher is None:  # the event loop's lag from /metrics, as `bench ui_live` reads it
            from bench.bench_ui_live import LoopWatch
            watcher = _LoopOnly(LoopWatch(ctl.url, ctl.token))
        k = 1 if nodes <= 100 else 2
        start_at = time.time() + 2 + nodes / 100
        stop_at = start_at + run_for
        per = [nodes // k + (1 if i < nodes % k else 0) for i in range(k)]
        for i in range(k):
            cfg = {"url": ctl.url, "credential": ctl.node_credential(name), "job": name, "slots": SLOTS, "nodes": per[i],
                   "first": sum(per[:i]), "time_factor": time_factor, "median_seconds": MEDIAN_SECONDS,
                   "sigma": SIGMA, "seed": i, "start_at": start_at, "stop_at": stop_at,
                   # $ROLLOUTD_SCALE_DURATIONS_ONLY=1: the factor scales the rollouts only, the daemons' beats, gaps
                   # and lease waits stay at their real timings (a factor below 1 would stretch gaps past the leases)
                   "durations_only": os.environ.get("ROLLOUTD_SCALE_DURATIONS_ONLY") == "1",
                   # today's daemon against either controller: leases riding on replies and results on paced
                   # beats are asked for, and fall back to the older calls when the controller does not answer
                   # them; $ROLLOUTD_SCALE_OLD_DAEMON=1 for a `before` older than 2026-11-23's third pass (its
                   # daemons beat ≥ 50 ms apart and leased by their own calls only)
                   "scaled_gap": src is None or not os.environ.get("ROLLOUTD_SCALE_OLD_DAEMON"),
                   "piggyback": src is None or not os.environ.get("ROLLOUTD_SCALE_OLD_DAEMON"),
                   "sync": os.environ.get("ROLLOUTD_SCALE_SYNC", "1") != "0"}
            (root / f"shard{i}.json").write_text(json.dumps(cfg))
            argv, env = module_command("simnodes", str(root / f"shard{i}.json"), str(root / f"shard{i}.out.json"))
            shards.append(subprocess.Popen(argv, env=env, cwd=REPO, start_new_session=True))
            _prioritize(shards[-1].pid)
        w0 = start_at + warmup
        time.sleep(max(w0 - time.time(), 0))
        stalls0 = ctl.stalls()
        per0 = [_cpu_seconds(c.proc.pid) for c in ctls]
        sys0 = sum(_cpu_times(c.proc.pid)[1] for c in ctls)
        cpu0, io0, sim0, load0 = (scale_replicas.cpu(ctls), _write_bytes(ctl.proc.pid),
                                  sum(_cpu_seconds(s.pid) for s in shards), os.getloadavg()[0])
        db0 = scale_stores.server_usage(server)
        groups0 = [c.groups() for c in ctls]
        scale_stores.statements_reset(server, url)
        time.sleep(max(w0 + window - time.time(), 0))
        groups1 = [c.groups() for c in ctls]
        statements = scale_stores.statements(server, url)
        per1 = [_cpu_seconds(c.proc.pid) for c in ctls]
        sys1 = sum(_cpu_times(c.proc.pid)[1] for c in ctls)
        cpu1, io1, sim1, load1 = (scale_replicas.cpu(ctls), _write_bytes(ctl.proc.pid),
                                  sum(_cpu_seconds(s.pid) for s in shards), os.getloadavg()[0])
        db1 = scale_stores.server_usage(server)
        stalls = _stall_delta(stalls0, ctl.stalls(), w0)
        prof = None
        if profile_seconds:
            which = min(int(os.environ.get("ROLLOUTD_SCALE_PROFILE_REPLICA", "0")), len(ctls) - 1)  # 0: the leader
            spy = _profile(ctls[which].proc.pid, profile_seconds - 1, root / "profile.txt")
            if spy is not None:
                spy.wait(profile_seconds + 30)
                if (root / "profile.txt").exists():
                    prof = top_frames(root / "profile.txt")
                    shutil.copy(root / "profile.txt", Path(tempfile.gettempdir()) / f"rolloutd-scale-profile-{nodes}-{variant}.txt")
        watched = watcher.report(w0, w0 + window)
        for s in shards:  # a saturated controller answers their last calls late: the wait grows with N
            s.wait(max(0.0, stop_at - time.time()) + 120 + nodes / 5)
        outs = [json.loads((root / f"shard{i}.out.json").read_text()) for i in range(k)]
        accepted = [tuple(key) for o in outs for key in o["ledger"]["accepted"]]
        check = audit(accepted, delivered(ctl.api, f"{P}/namespaces/default/rolloutjobs", name, limit=20000))
        w1 = w0 + window
        done = sum(1 for o in outs for t_ in o["accepted_at"] if w0 <= t_ < w1)
        # when the first result was accepted, from the nodes' start: a slow first wave is not read as no throughput
        first = min((t_ for o in outs for t_ in o["accepted_at"]), default=None)
        lat = {kind: [d * 1e3 for o in outs for t_, d in o["latency"].get(kind, []) if w0 <= t_ < w1]
               for kind in ("lease", "heartbeat", "results")}
        sizes = ctl.db_bytes() if server is None else {"rolloutd.db": scale_stores.database_bytes(server, url),
                                                         "rolloutd.db-wal": 0}
        split = getattr(watcher, "split", None)  # the calls by the watch's phases (`bench_ui_toggle`)
        phases = split({kind: [(t_, d * 1e3) for o in outs for t_, d in o["latency"].get(kind, [])]
                        for kind in ("heartbeat",)}, w0, w1) if split else None
        return {
            "variant": variant, "store": store, "replicas": replicas, "nodes": nodes,
            "budget_split": replicas > 1 and os.environ.get("ROLLOUTD_SCALE_SPLIT_BUDGET") == "1",
            "replica_cores": [round((c1 - c0) / window, 3) for c0, c1 in zip(per0, per1)],
            "forwarded": sum(o.get("forwarded", 0) for o in outs), "redirected": sum(o.get("redirected", 0) for o in outs),
            "slots": SLOTS, "time_factor": time_factor, "window_s": window, "items": items,
            "expand_s": round(expand_s, 1), "offered_per_s": round(offered, 1),
            "rollouts_per_s": round(done / window, 1), "rollouts": done,
            "first_result_s": None if first is None else round(first - start_at, 1), "warmup_s": warmup,
            "ctl_cores": round((cpu1 - cpu0) / window, 3),
            # the kernel's part of it (the fsyncs' writeback of the store's pages, the sockets)
            "ctl_sys_cores": round((sys1 - sys0) / window, 3),
            "ctl_ms_per_rollout": round((cpu1 - cpu0) / max(done, 1) * 1e3, 3),
            "sim_cores": round((sim1 - sim0) / window, 3),
            "db_cores": round((db1[0] - db0[0]) / window, 3),  # the PostgreSQL server (0: SQLite, in the controller)
            "calls_per_s": {kind: round(len(v) / window, 1) for kind, v in lat.items()},
            "ctl_ms_per_call": round((cpu1 - cpu0) / max(sum(len(v) for v in lat.values()), 1) * 1e3, 3),
            "p50_ms": {kind: round(_pct(v, 0.50), 2) for kind, v in lat.items()},
            "p99_ms": {kind: round(_pct(v, 0.99), 2) for kind, v in lat.items()},
            "max_ms": {kind: round(max(v, default=float("nan")), 1) for kind, v in lat.items()},
            "write_bytes_per_rollout": round((io1 - io0 + db1[1] - db0[1]) / max(done, 1)),
            "db_bytes": sizes["rolloutd.db"], "wal_bytes": sizes["rolloutd.db-wal"],
            "audit": {"accepted": check.accepted, "delivered": check.delivered, "lost": len(check.lost),
                      "duplicated": len(check.duplicated), "phantom": len(check.phantom)},
            "errors": {k2: v for o in outs for k2, v in o["errors"].items()},
            "failed_loops": sum(o["n_failed_loops"] for o in outs),
            "empty_leases": sum(o["empty_leases"] for o in outs), "cancelled": sum(o["cancelled"] for o in outs),
            "piggybacked": sum(o.get("piggybacked", 0) for o in outs),
            "load_avg": [round(load0, 2), round(load1, 2)], "profile": prof, "dashboards": watched.get("ui"),
            "loop": watched.get("loop"), "stalls": stalls, "phases": phases,
            "groups": _groups_delta(groups0, groups1, window), "statements": statements,
        }
    finally:
        if watcher is not None:
            watcher.close()
        for s in shards:
            if s.poll() is None:
                s.kill()
                s.wait(5)
        for c in ctls:
            c.stop()
        health.close()
        if server:
            if os.environ.get("ROLLOUTD_SCALE_KEEP") and server.log.exists():
                shutil.copy(server.log, root / "postgresql.log")  # stop() removes the server's directory
            server.stop()
        if os.environ.get("ROLLOUTD_SCALE_KEEP"):
            print(f"   kept {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)


def sweep(ns: list[int], time_factor: float = 1.0, window: float = 30.0, profile_seconds: float = 15.0,
          before: str | None = None) -> list[dict]:
    """Every N, with this checkout's controller on each store of `$ROLLOUTD_SCALE_STORES` (side by side; its
    PostgreSQL variant is "after-pg", two replicas "after-pg-2r"); with `before` (a git revision) that one's in each
    of the same variants first ("before", "before-pg", …)."""
    points = []
    with contextlib.ExitStack() as stack:
        ours = [("after" if store == "sqlite" else "after-pg", store, 1) for store in scale_stores.stores()]
        ours += [(f"after-pg-{r}r", "postgresql", r) for r in scale_replicas.counts() if r > 1]
        old = stack.enter_context(older_source(before)) if before else None
        variants = [(v.replace("after", "before"), old, store, r) for v, store, r in ours] if before else []
        variants += [(v, None, store, r) for v, store, r in ours]
        for n in ns:
            for variant, src, store, replicas in variants:
                t0 = time.monotonic()
                try:
                    p = point(n, time_factor, window, profile_seconds if n == max(ns) else 0.0, src, variant,
                              store=store, replicas=replicas)
                except Exception as e:  # noqa: BLE001 - one failed point (a busy machine) does not void the others
                    print(f"   N={n} {variant}: failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                    continue
                lp = p["loop"] or {}
                print(f"   N={n} {variant}: {p['rollouts_per_s']}/s, ctl {p['ctl_cores']} cores "
                      f"(kernel {p.get('ctl_sys_cores')}), db {p['db_cores']} cores "
                      f"{p['ctl_ms_per_call']} ms/call, p99 {p['p99_ms']}, loop max {lp.get('max_ms')} ms, "
                      f"lags > 5 ms {lp.get('over_5ms')}, groups {p['groups']}, audit {p['audit']}, "
                      f"load {p['load_avg']} "
                      f"({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
                points.append(p)
    return points


def run(quick: bool = False) -> list[dict]:
    ns = [10, 100] if quick else [int(x) for x in os.environ.get("ROLLOUTD_SCALE_NODES", "10,100,300,1000").split(",")]
    factor = float(os.environ.get("ROLLOUTD_SCALE_TIME_FACTOR", "1"))
    points = sweep(ns, factor, window=10.0 if quick else 30.0, profile_seconds=0.0 if quick else 15.0,
                   before=os.environ.get("ROLLOUTD_SCALE_BEFORE"))
    label = os.environ.get("ROLLOUTD_SCALE_LABEL", "latest")
    if os.environ.get("ROLLOUTD_BENCH_NO_WRITE") != "1":  # `--no-write`: nothing under bench/results changes
        out = HERE / "results" / "scale-results"
        out.mkdir(exist_ok=True)
        (out / f"{label}.json").write_text(json.dumps(
            {"label": label, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "points": points}, indent=1))
    rows = []
    for p in (p for p in points if p["variant"].startswith("after")):
        p99 = p["p99_ms"]
        worst = max((v for v in p99.values() if v == v), default=float("nan"))  # nan: a call kind not made
        big = p["nodes"] >= 1000
        rows.append({
            "benchmark": f"{p['nodes']} simulated nodes × {SLOTS} slots, no-op rollouts "
                         f"(offered {p['offered_per_s']:.0f}/s), {p.get('store', 'sqlite')}"
                         f"{' × %d replicas' % p['replicas'] if p.get('replicas', 1) > 1 else ''} (`scale`)",
            "ours": f"{p['rollouts_per_s']:.0f} rollouts/s, controller {p['ctl_cores']:.2f} cores "
                    f"+ database {p.get('db_cores', 0):.2f} "
                    f"({p['ctl_ms_per_rollout']:.2f} ms/rollout), p99 lease/beat/results "
                    f"{p99['lease']:.0f}/{p99['heartbeat']:.0f}/{p99['results']:.0f} ms, "
                    f"lost/dup {p['audit']['lost']}/{p['audit']['duplicated']}, load {p['load_avg'][1]}",
            "baseline": "-", "ratio": None,
            "target": "≥ 1000/s, < 1 core, p99 ≤ 50 ms, 0 lost" if big else "0 lost/dup",
            "met": (p["rollouts_per_s"] >= 1000 and p["ctl_cores"] < 1 and worst <= 50 and p["audit"]["lost"] == 0
                    and p["audit"]["duplicated"] == 0) if big else (p["audit"]["lost"] == p["audit"]["duplicated"] == 0),
        })
    return rows


def table(points: list[dict]) -> str:
    """The sweep as the markdown table of bench/results/RESULTS-scale.md."""
    out = ["| N × 64 | code | offered/s | rollouts/s | ctl cores | db cores | ctl ms/rollout | ctl ms/call | calls/s lease/beat/results "
           "| p50 ms lease/beat/results | p99 ms lease/beat/results | loop max ms | loop lags > 5 / > 20 ms "
           "| KB written/rollout | db + WAL MB | lost/dup/phantom | load |",
           "|" + "---|" * 17]
    def before_first(p: dict) -> tuple:
        return p["nodes"], not p.get("variant", "").startswith("before"), p.get("variant", "")

    for p in sorted(points, key=before_first):
        c, p50, p99, a = p["calls_per_s"], p["p50_ms"], p["p99_ms"], p["audit"]
        lp = p.get("loop") or {}
        out.append(
            f"| {p['nodes']} | {p.get('variant', '-')} | {p['offered_per_s']:.0f} | {p['rollouts_per_s']:.0f} "
            f"| {p['ctl_cores']:.2f} | {p.get('db_cores', 0):.2f} | {p['ctl_ms_per_rollout']:.2f} | {p.get('ctl_ms_per_call', float('nan')):.2f} "
            f"| {c['lease']:.0f}/{c['heartbeat']:.0f}/{c['results']:.0f} "
            f"| {p50['lease']:.0f}/{p50['heartbeat']:.0f}/{p50['results']:.0f} "
            f"| {p99['lease']:.0f}/{p99['heartbeat']:.0f}/{p99['results']:.0f} "
            f"| {lp.get('max_ms', '-')} | {lp.get('over_5ms', '-')} / {lp.get('over_20ms', '-')} "
            f"| {p['write_bytes_per_rollout'] / 1024:.1f} | {(p['db_bytes'] + p['wal_bytes']) / 2**20:.1f} "
            f"| {a['lost']}/{a['duplicated']}/{a['phantom']} | {p['load_avg'][0]}–{p['load_avg'][1]} |")
    return "\n".join(out)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--table"]:  # python -m bench.bench_scale --table bench/results/scale-results/LABEL.json
        print(table(json.loads(Path(sys.argv[2]).read_text())["points"]))
        sys.exit(0)
    from bench.__main__ import render

    print(render(run(quick="--quick" in sys.argv)))
