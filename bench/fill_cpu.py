"""Micro-bench of a batch's fill (issue 36): rollouts opened per CPU second by `Scheduler._fill_step`, this tree
beside an older revision, each in a process of its own on the same box.

    python -m bench.fill_cpu [--groups 2000] [--samples 8] [--before main] [--store sqlite|postgresql-URL]

Each process makes a store in a temporary folder, applies the example job in batch mode with `--groups` groups,
requests batch 1 (its first step runs inside the request, as the API does) and then runs the fill's steps in
its own thread until none opens a group (the request's first step is not counted), timing them with the thread's CPU clock (`time.thread_time`): the Python
and SQLite work the fill thread holds the GIL for. Prints one row per revision and the ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench.bench_scale import older_source

REPO = Path(__file__).resolve().parents[1]
_CHILD = r"""
import json, sys, tempfile, time, os
from pathlib import Path
import yaml
from rolloutd.crds.spec_paths import resolve_paths
from rolloutd.crds.rolloutjob import RolloutJob
from rolloutd.controller.store import Store
from rolloutd.controller.work.core import build_work
from rolloutd.controller.work.scheduler import Scheduler
from rolloutd.controller.work.tables import ItemRow, GroupRow
from sqlmodel import Session, select, func

groups, samples, location = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
example = Path(sys.argv[4])
tmp = Path(tempfile.mkdtemp(prefix="rolloutd-fill-"))
data = tmp / "data.jsonl"
data.write_text("".join(json.dumps({"id": f"q{i}", "question": f"{i}?", "answer": "1"}) + "\n" for i in range(500)))
doc = resolve_paths(yaml.safe_load(example.read_text()), example.parent)
doc["spec"]["tasks"] = {"kind": "math", "source": str(data)}
doc["spec"]["samplesPerPrompt"] = samples
doc["spec"]["llm"]["backends"] = [{"url": "http://a"}]
doc["spec"]["dapo"] = {"enabled": False}
doc["spec"]["batches"] = {"groups": groups}
store = Store(location if location != "sqlite" else str(tmp / "db.sqlite"))
store.apply(RolloutJob.model_validate(doc))
sched = Scheduler(build_work(store))
sched.request_batch("math-demo")
job = sched.work.jobs.get("math-demo")
with Session(store.engine) as s:
    first = s.exec(select(func.count()).select_from(ItemRow)).one()
steps, c0, w0 = 0, time.thread_time(), time.perf_counter()
while sched._fill_step(job, 1):
    steps += 1
cpu, wall = time.thread_time() - c0, time.perf_counter() - w0
with Session(store.engine) as s:
    items = s.exec(select(func.count()).select_from(ItemRow)).one()
    opened = s.exec(select(func.count()).select_from(GroupRow)).one()
print(json.dumps({"steps": steps, "cpu": cpu, "wall": wall, "items": items - first, "groups": opened}))
"""


def one(src: Path | None, groups: int, samples: int, store: str) -> dict:
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = f"{src}{os.pathsep}{env.get('PYTHONPATH', '')}"
    example = (src / "rolloutd" / "controller").resolve().parent / "examples" if src else REPO / "examples"
    out = subprocess.run([sys.executable, "-c", _CHILD, str(groups), str(samples), store,
                          str(example / "math-demo.yaml")], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fill_cpu")
    ap.add_argument("--groups", type=int, default=2000)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--before", default="main")
    ap.add_argument("--store", default="sqlite")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    rows = []
    with older_source(a.before) as before:
        for _ in range(a.repeat):  # alternated, so both see the same load
            for label, src in ((a.before, before), ("this tree", None)):
                r = one(src, a.groups, a.samples, a.store)
                rows.append((label, r))
                print(f"{label:>10}: {r['items']} rollouts ({r['groups']} groups) in {r['steps']} steps, "
                      f"{r['cpu']:.2f} s CPU (fill thread), {r['wall']:.2f} s wall: "
                      f"{r['items'] / r['cpu']:.0f} rollouts/CPU s", flush=True)
    best = {label: min(r["cpu"] for lab, r in rows if lab == label) for label in (a.before, "this tree")}
    items = rows[-1][1]["items"]
    print(f"best of {a.repeat}: {a.before} {items / best[a.before]:.0f} rollouts/CPU s, this tree "
          f"{items / best['this tree']:.0f} rollouts/CPU s: {best[a.before] / best['this tree']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
