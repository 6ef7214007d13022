"""`rolloutctl --version` and `rolloutctl get rolloutjobs` (against a real controller holding 20 jobs) in CPU
seconds per call (user + system of the child, from `resource.getrusage`), side by side with
`kubectl version --client` and the same `get` through the full typer CLI (`controller/ctl/app.py`, what every call paid before
`get`'s fast path, `controller/ctl/fast.py`) in the same run. Target: ≤ 150 ms of CPU per call. Results: bench/results/RESULTS-cli.md.
"""
from __future__ import annotations

import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from bench.bench_pipeline import REPO, start_controller
from rolloutd.crds.kit.paths import rolloutd_home

TARGET = 0.150  # seconds of CPU
P = "/apis/rolloutd.io/v1alpha1"


def cpu_of(argv: list[str], env: dict[str, str]) -> float:
    """The CPU seconds (user + system) one run of `argv` took."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def kubectl() -> str | None:
    path = rolloutd_home() / "kube" / "bin" / "kubectl"
    return str(path) if path.exists() else shutil.which("kubectl")


def run(quick: bool = False) -> list[dict]:
    reps = 5 if quick else 20
    rolloutctl = str(Path(sys.executable).parent / "rolloutctl")
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        port = _free_port()
        ctl, api = start_controller(data, port, dict(os.environ))
        try:
            doc = yaml.safe_load((REPO / "examples" / "math-demo.yaml").read_text())
            doc["spec"]["tasks"]["source"] = str(REPO / "examples" / "math" / "train.jsonl")
            doc["spec"]["llm"]["tokenizer"] = str(rolloutd_home() / "models" / "smollm2")
            doc["spec"]["executor"]["nodes"] = 0
            for i in range(20):
                doc["metadata"]["name"] = f"bench-{i}"
                api.put(f"{P}/rolloutjobs/bench-{i}", json=doc).raise_for_status()
            env = {**os.environ, "ROLLOUTD_SERVER": f"http://127.0.0.1:{port}",
                   "ROLLOUTD_TOKEN_FILE": str(data / "token"), "ROLLOUTD_CONFIG": str(Path(tmp) / "none.yaml")}
            cases = {"version": [rolloutctl, "--version"], "get": [rolloutctl, "get", "rolloutjobs"],
                     "full": [sys.executable, "-m", "rolloutd.controller.ctl", "get", "rolloutjobs"]}
            base = kubectl()
            samples: dict[str, list[float]] = {k: [] for k in [*cases, "kubectl"]}
            for _ in range(reps):  # interleaved: the machine's load falls on every command alike
                for k, argv in cases.items():
                    samples[k].append(cpu_of(argv, env))
                if base:
                    samples["kubectl"].append(cpu_of([base, "version", "--client"], env))
        finally:
            os.killpg(ctl.pid, signal.SIGTERM)
            ctl.wait(30)
    kube = statistics.median(samples["kubectl"]) if samples["kubectl"] else None
    rows = []
    for k, argv in cases.items():
        ours = statistics.median(samples[k])
        what = "`rolloutctl get rolloutjobs` through the full typer CLI" if k == "full" else \
            f"`rolloutctl {' '.join(argv[1:])}`"
        rows.append({"benchmark": f"CPU of {what} (median of {reps})",
                     "ours": f"{ours * 1000:.0f} ms",
                     "baseline": f"kubectl version --client {kube * 1000:.0f} ms" if kube else "kubectl not found",
                     "ratio": ours / kube if kube else None, "target": "≤ 150 ms CPU" if k != "full" else "-", "met": ours <= TARGET if k != "full" else None})
    return rows


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    from bench.__main__ import render

    print(render(run(quick="--quick" in sys.argv)))
