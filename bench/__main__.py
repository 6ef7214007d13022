"""Runs every `bench/bench_*.py` and prints one table of side-by-side ratios.

    python -m bench                 all benchmarks
    python -m bench sandbox         only bench_sandbox.py
    python -m bench --quick         fewer repetitions (a smoke run)

Each module exposes `run(quick: bool = False) -> list[dict]` with rows
`{benchmark, ours, baseline, ratio, target, met}`. The table is also written to
`bench/results/RESULTS.md` (the README quotes it).
"""
from __future__ import annotations

import argparse
import importlib
import platform
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent


def discover(names: list[str]) -> list[str]:
    mods = sorted(p.stem for p in HERE.glob("bench_*.py"))
    if names:
        wanted = {n if n.startswith("bench_") else f"bench_{n}" for n in names}
        unknown = wanted - set(mods)
        if unknown:
            sys.exit(f"unknown benchmark(s): {', '.join(sorted(unknown))}; known: {', '.join(mods)}")
        mods = [m for m in mods if m in wanted]
    return mods


def render(rows: list[dict]) -> str:
    head = "| benchmark | ours | baseline | ratio | target | met |\n|---|---|---|---|---|---|\n"
    body = ""
    for r in rows:
        ratio = f"{r['ratio']:.2f}×" if isinstance(r.get("ratio"), (int, float)) else "-"
        met = {True: "yes", False: "**no**", None: "-"}[r.get("met")]
        body += f"| {r['benchmark']} | {r['ours']} | {r['baseline']} | {ratio} | {r['target']} | {met} |\n"
    return head + body


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench")
    ap.add_argument("names", nargs="*")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-write", action="store_true", help="do not rewrite bench/results/RESULTS.md")
    ap.add_argument("--store", help="scale: the controller's store, sqlite or postgresql, or both side by side "
                                    "(sqlite,postgresql) [default: $ROLLOUTD_SCALE_STORES, else sqlite]")
    args = ap.parse_args()
    if args.no_write:  # benches that write a results file of their own read it too
        __import__("os").environ["ROLLOUTD_BENCH_NO_WRITE"] = "1"
    if args.store:
        __import__("os").environ["ROLLOUTD_SCALE_STORES"] = args.store
    rows: list[dict] = []
    failed = []
    for name in discover(args.names):
        t0 = time.perf_counter()
        print(f"== {name}", file=sys.stderr, flush=True)
        try:
            rows += importlib.import_module(f"bench.{name}").run(quick=args.quick)
        except Exception:  # noqa: BLE001 - report and go on with the others
            traceback.print_exc()
            failed.append(name)
        print(f"   {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    table = render(rows)
    print(table)
    if not args.no_write and not args.names:
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        (HERE / "results" / "RESULTS.md").write_text(
            f"# Benchmark results\n\n`python -m bench` on {platform.node()} ({platform.machine()}, "
            f"{__import__('os').cpu_count()} cores), {stamp}{' (quick)' if args.quick else ''}.\n\n{table}"
        )
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
