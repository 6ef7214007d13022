"""Does a dashboard's build in a worker thread delay an event loop that runs SQLite statements? (issue 27)

An asyncio loop commits a group of 30 INSERTs every 10 ms (as the controller's group commit does) while a
"build" (1000 node rows made and JSON-encoded 8 times, every 200 ms) runs: nowhere ("none"), in a worker thread
(`asyncio.to_thread`, as the UI did before), or on the loop in slices of 250 rows ("loop-sliced", as it does now).
Each SQLite statement releases the GIL; with a thread holding it the loop waits for it back. Prints the group's
p50/p99/max and the loop timer's lag. `python -m bench.gil_probe` (about 40 s; results: bench/results/RESULTS-ui.md).
Next step: none planned (a probe, not a benchmark row).
"""
import asyncio
import json
import os
import sqlite3
import sys
import tempfile
import time

ROWS = [{"id": f"n{i:04d}", "name": f"node-{i}", "host": "h", "state": "active", "slot": i, "inflight": 64,
         "secondsSinceBeat": 1.3} for i in range(1000)]

def build():  # ~the old summary build: 1000 rows made and encoded, a few times over
    for _ in range(8):
        json.dumps([dict(r) for r in ROWS])

async def sliced_build():
    for _ in range(8):
        for k in range(0, 1000, 250):
            json.dumps([dict(r) for r in ROWS[k:k + 250]])
            await asyncio.sleep(0)

async def main(mode, seconds=6.0):
    db = sqlite3.connect(os.path.join(tempfile.mkdtemp(), "probe.db"), isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL"); db.execute("CREATE TABLE IF NOT EXISTS t (a INTEGER PRIMARY KEY, b TEXT)")
    stop = time.monotonic() + seconds
    took, lags = [], []
    async def builder():
        while time.monotonic() < stop:
            if mode == "thread":
                await asyncio.to_thread(build)
            elif mode == "loop-sliced":
                await sliced_build()
            await asyncio.sleep(0.2)
    bt = asyncio.create_task(builder()) if mode != "none" else None
    while time.monotonic() < stop:
        t0 = time.perf_counter()
        await asyncio.sleep(0.01)
        lags.append(time.perf_counter() - t0 - 0.01)
        t1 = time.perf_counter()
        db.execute("BEGIN IMMEDIATE")
        for i in range(30):  # a group commit's statements: each releases the GIL
            db.execute("INSERT INTO t (b) VALUES (?)", ("x",))
        db.execute("COMMIT")
        took.append(time.perf_counter() - t1)
    if bt: await bt
    q = lambda xs, p: sorted(xs)[int(p * (len(xs) - 1))] * 1e3
    print(f"{mode:12s} group of 30 statements: p50 {q(took, .5):6.2f} p99 {q(took, .99):6.2f} max {max(took)*1e3:6.1f} ms | "
          f"timer lag p99 {q(lags, .99):6.2f} max {max(lags)*1e3:6.1f} ms ({len(took)} groups)")

if __name__ == "__main__":
    for mode in sys.argv[1:] or ["none", "thread", "loop-sliced", "none", "thread", "loop-sliced"]:
        asyncio.run(main(mode))
