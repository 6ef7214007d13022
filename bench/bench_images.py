"""Image benchmarks (`rolloutd image build` and sandboxes started from its images), side by side.

Where it sits: run by the bench runner (`python -m bench images`) through `run(quick)`, or alone as
``python -m bench.bench_images [--quick]``. Rows: ``{benchmark, ours, baseline, ratio, target, met}``.

1. image build with the bookworm base cached (a fresh context each time, so never an image-cache hit):
   FROM debian:bookworm + COPY + WORKDIR + ENV + RUN (no network: the mirror's speed is not ours),
   against a plain `cp -a --reflink=auto` of the base (the floor: every build copies it). The base's own
   one-time build (mmdebstrap) is read from its base.json.
2. a cached build (`build_image` of an existing image: hash the context, read image.json), against
   hashing the context alone.
3. sandbox ready from a built image: `create` → first command answered (then closed, untimed), against
   the same with `image: host`; the two alternate one by one. Target p50 ≤ 100 ms.
4. sandboxed builds (issue 24): an apt-free build (WORKDIR, COPY, four RUNs, USER) and a bare `RUN true`
   step with today's step runner against the one before it (build_isolation.py), alternating in one run.
   ``python -m bench.bench_images --isolation`` runs only these rows.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rolloutd.sandbox import SandboxSpec, get_runtime
from rolloutd.sandbox.image.build import build_image, find_dockerfile, image_key
from rolloutd.crds.kit.settings import SandboxSettings
from rolloutd.sandbox.image.rootfs import base_rootfs, image_cache_dir

DOCKERFILE = "FROM debian:bookworm\nENV APP=/srv/app\nWORKDIR $APP\nCOPY data.txt ./\nRUN wc -l data.txt > lines.txt\n"


def _p(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return statistics.median(xs), xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]


def _context(root: Path, i: int) -> Path:
    ctx = root / f"ctx{i}"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(DOCKERFILE)
    (ctx / "data.txt").write_text(f"run {i} {time.time_ns()}\n")  # a new key every time
    return ctx


def _row(name: str, ours: list[float], base: list[float], unit: str, target: str, met) -> dict:
    (o50, o95), (b50, b95) = _p(ours), _p(base)
    scale, fmt = (1000, "{:.1f} ms") if unit == "ms" else (1, "{:.2f} s")
    return {"benchmark": name, "ours": f"{fmt.format(o50 * scale)} (p95 {fmt.format(o95 * scale)})",
            "baseline": f"{fmt.format(b50 * scale)} (p95 {fmt.format(b95 * scale)})",
            "ratio": o50 / b50 if b50 else None, "target": target, "met": met}


def isolation_rows(quick: bool = False) -> list[dict]:
    from bench.build_isolation import measure  # noqa: PLC0415

    out = measure(2 if quick else 3)
    return [_row("image build, apt-free (4 RUN), sandboxed steps vs before", out["build"]["after"],
                 out["build"]["before"], "s", "small", None),
            _row("one RUN step (true), sandboxed vs before", out["step"]["after"], out["step"]["before"], "ms",
                 "small", None)]


def run(quick: bool = False) -> list[dict]:
    cache = image_cache_dir(SandboxSettings.from_env().images)
    base = base_rootfs(cache)
    base_meta = json.loads((base.parent / "base.json").read_text())
    rows = [{"benchmark": "base rootfs build (mmdebstrap, once per cache)", "ours": f"{base_meta['seconds']:.1f} s",
             "baseline": "-", "ratio": None, "target": "once", "met": None}]
    builds, copies, hits, hashes = [], [], [], []
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        root = Path(tmp)
        made = []
        for i in range(2 if quick else 4):
            t0 = time.perf_counter()
            subprocess.run(["cp", "-a", "--reflink=auto", str(base), str(root / f"copy{i}")], check=True)
            copies.append(time.perf_counter() - t0)
            shutil.rmtree(root / f"copy{i}")
            ctx = _context(root, i)
            t0 = time.perf_counter()
            image = build_image(ctx, cache=cache, log=lambda m: None)
            builds.append(time.perf_counter() - t0)
            made.append((ctx, image))
        for _ in range(5 if quick else 20):
            ctx = made[0][0]
            t0 = time.perf_counter()
            build_image(ctx, cache=cache, log=lambda m: None)
            hits.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            image_key(*find_dockerfile(ctx), {})
            hashes.append(time.perf_counter() - t0)
        ready, host = asyncio.run(_ready(made[0][1].rootfs, 5 if quick else 30))
        for _, image in made:
            shutil.rmtree(image.path, ignore_errors=True)
    rows.append(_row("image build, base cached (COPY, WORKDIR, ENV, RUN)", builds, copies, "s", "fast", None))
    rows.append(_row("image build, cached image", hits, hashes, "ms", "≈ hashing", None))
    rows.append(_row("sandbox ready from a built image (vs image: host)", ready, host, "ms", "p50 ≤ 100 ms",
                     _p(ready)[0] <= 0.100))
    return rows + isolation_rows(quick)


async def _ready(rootfs: Path, n: int) -> tuple[list[float], list[float]]:
    runtime = get_runtime("bwrap")
    specs = {"image": SandboxSpec(image=str(rootfs)), "host": SandboxSpec()}
    times: dict[str, list[float]] = {"image": [], "host": []}
    for i in range(n + 1):
        for name, spec in specs.items():
            t0 = time.perf_counter()
            sandbox = await runtime.create(spec)
            await sandbox.bash("true")
            elapsed = time.perf_counter() - t0
            await sandbox.close()
            if i:  # the first of each is a warm-up (page cache, byte-compiled server)
                times[name].append(elapsed)
    return times["image"], times["host"]


if __name__ == "__main__":
    from bench.__main__ import render

    quick = "--quick" in sys.argv
    print(render(isolation_rows(quick) if "--isolation" in sys.argv else run(quick=quick)))
