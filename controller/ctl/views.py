"""What `rolloutctl` shows: job tables, the `describe` text, the live progress table, trajectory and
backend lines. Pure functions from the API's wire objects to text or rich tables; `app.py` calls them.
"""
from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from rolloutd.crds.columns import REWARD_MEAN

from .table import age, cell, counts, jobs_table  # noqa: F401 - the views' one namespace for app.py

# one vocabulary everywhere (`crds.job_status.StageCounts`): the live table, describe, the job table, kubectl
STAGES = ("queued", "init", "run", "eval", "scored", "agentFailed", "infraFailed", "cancelled")
LABELS = {"agentFailed": "agent-failed", "infraFailed": "infra-failed"}
TRAJECTORY_HEADER = (f"{'SEQ':>5} {'PROMPT':>6} {'SAMPLE':>6} {'REWARD':>7} {'FAILURE':<8} {'TURNS':>5} {'TOKENS':>6} "
                     f"{'NODE':<14} REASON")


def print_obj(out: Console, obj: Any, output: str) -> None:
    if output == "json":
        out.print_json(json.dumps(obj)) if sys.stdout.isatty() else print(json.dumps(obj, indent=2))
    else:
        import yaml

        print(yaml.safe_dump(obj, sort_keys=False), end="")


def describe_text(obj: dict[str, Any], events: list[dict[str, Any]], stats: dict[str, Any] | None = None) -> str:
    """kubectl describe's layout; `stats`: the job's `GET …/stats` (reward mean, per-stage p50/p95)."""
    m, spec, st = obj["metadata"], obj["spec"], obj.get("status", {})
    labels = ",".join(f"{k}={v}" for k, v in (m.get("labels") or {}).items()) or "<none>"
    lines = [
        f"Name:          {m['name']}",
        f"Labels:        {labels}",
        f"UID:           {m.get('uid')}",
        f"Generation:    {m.get('generation')} (observed {st.get('observedGeneration', 0)})",
        f"Created:       {m.get('creationTimestamp')}",
    ]
    if m.get("deletionTimestamp"):
        lines.append(f"Deleting since: {m['deletionTimestamp']}")
    smp = spec["agent"]["sampling"]
    lines += [
        "Spec:",
        f"  Tasks:       {spec['tasks']['kind']} from {spec['tasks']['source']}"
        + (f" (first {spec['tasks']['limit']})" if spec['tasks'].get('limit') else ""),
        f"  Samples:     {spec['samplesPerPrompt']} per prompt"
        + (f"; DAPO target {spec['dapo']['targetGroups']} informative groups" if spec['dapo']['enabled'] else ""),
        f"  Agent:       {spec['agent'].get('kind', 'loop')}, {spec['agent']['maxTurns']} turns, tools {', '.join(spec['agent']['tools'])}; "
        f"temperature {smp['temperature']}, {smp['maxTokensPerTurn']} tokens/turn, seed {smp.get('seed')}",
        f"  LLM:         {len(spec['llm']['backends'])} backend(s): "
        + (", ".join(b["url"] for b in spec["llm"]["backends"]) or "<none>"),
        f"  Sandbox:     {spec['sandbox']['runtime']} image={spec['sandbox']['image']} "
        f"network={'on' if spec['sandbox']['network'] else 'off'}",
        f"  Executor:    {spec['executor']['kind']}, {spec['executor']['nodes']} node(s)",
        "Status:",
        f"  Phase:       {st.get('phase', 'Pending')}",
        f"  Nodes:       {st.get('nodes', 0)}",
        f"  Started:     {st.get('startTime') or '-'}",
        f"  Completed:   {st.get('completionTime') or '-'}",
        "  Rollouts:    " + ", ".join(f"{LABELS.get(k, k)} {counts(obj).get(k, 0)}" for k in STAGES)
        + f"; total {counts(obj).get('total', 0)}",
        f"  Reward:      {'-' if st.get('rewardMean') is None else st['rewardMean']} ({REWARD_MEAN})",
        *stage_lines(stats),
        "Conditions:",
    ]
    for c in st.get("conditions", []):
        lines.append(f"  {c['type']:<14} {c['status']:<7} {c.get('reason', ''):<22} {c.get('message', '')}")
    if not st.get("conditions"):
        lines.append("  <none>")
    lines.append("Events:")
    for e in events[-20:]:
        lines.append(f"  {e['time']}  {e['type']:<7} {e['reason']:<16} {e['message']}")
    if not events:
        lines.append("  <none>")
    return "\n".join(lines)


def stage_lines(stats: dict[str, Any] | None) -> list[str]:
    """Each stage's p50 / p95 in seconds over the rollouts that ran to the end (`GET …/stats`)."""
    if not stats:
        return []

    def sec(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"
    out = ["  Stages:      p50 / p95 seconds (rollouts that ran to the end)"]
    for s in stats.get("stages", []):
        out.append(f"    {s['stage']:<6} {sec(s.get('p50')):>9} / {sec(s.get('p95')):<9} n={s.get('n', 0)}")
    return out


def progress_table(obj: dict[str, Any]) -> Table:
    st, c = obj.get("status", {}), counts(obj)
    total = max(c.get("total", 0), 1)
    table = Table(title=f"rolloutjob/{obj['metadata']['name']}  phase {st.get('phase', 'Pending')}  "
                        f"nodes {st.get('nodes', 0)}/{obj['spec']['executor']['nodes']}", title_justify="left")
    table.add_column("stage")
    table.add_column("rollouts", justify="right")
    table.add_column("", min_width=30)
    for stage in STAGES:
        n = c.get(stage, 0)
        bar = "█" * round(30 * n / total)
        table.add_row(LABELS.get(stage, stage), str(n), bar)
    table.add_row("total", str(c.get("total", 0)), "")
    return table


def progress_line(obj: dict[str, Any]) -> str:
    """`watch`'s line per change when stdout is not a terminal (a Slurm log, a pipe)."""
    st, c = obj.get("status", {}), counts(obj)
    stages = " ".join(f"{LABELS.get(s, s)}={c.get(s, 0)}" for s in STAGES)
    message = f"  {st['message']}" if st.get("message") else ""
    return (f"rolloutjob/{obj['metadata']['name']} phase {st.get('phase', 'Pending')} nodes={st.get('nodes', 0)}/"
            f"{obj['spec']['executor']['nodes']} {stages} total={c.get('total', 0)}{message}")


def trajectory_line(t: dict[str, Any]) -> str:
    reward = "-" if t.get("reward") is None else f"{t['reward']:.3g}"
    fail = t.get("failure", {})
    return (f"{t['seq']:>5} {t['prompt']:>6} {t['sample']:>6} {reward:>7} {fail.get('kind', 'none'):<8} "
            f"{len(t.get('turns') or []):>5} {len(t.get('tokenIds', [])):>6} {str(t.get('node') or '-'):<14} "
            f"{fail.get('reason', '')}")


def print_backends(items: list[dict[str, Any]]) -> None:
    print(f"{'URL':<40} {'HEALTHY':<8} {'INFLIGHT':>8} {'PINNED':>7}  REASON")
    for b in items:
        print(f"{b['url']:<40} {str(b['healthy']).lower():<8} {b['inflight']:>8} {b['pinnedToJob']:>7}  {b['reason']}")
