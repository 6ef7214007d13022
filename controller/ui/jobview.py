"""The job page's deeper views, built when the page asks (never in the live build): the spec as written with its
secrets redacted, reward, pass-rate, response-length, turn, tool-error and truncation curves per policy version and
over time, pass rates per prompt, zero-variance groups, and a sortable page of trajectories with their tokens, turns
and duration.

Called by `ui/app.py` (…/config, …/curves, …/trajectories) in a worker thread. The curves read only the covering
index `ix_trajectories_facts` (job, failure, reward, policy, t_end, generated, turns, tool_errors, truncated; the
rowid is seq); pass rates and groups the job's rows by prompt. A job's curves are kept until its newest seq changes.
"Passed" means reward ≥ PASS (full marks: rolloutd's handlers score 0–1); only scored and agent-failed rollouts
count (infra-failed and cancelled carry no reward).
Next step: percentiles of the response length (p50/p95) beside its mean.
"""
from __future__ import annotations

import json
import re
from typing import Any

from sqlalchemy.engine import Engine

from ..dialects import PgRaw, is_pg, raw
from ..work.tables import PG_DOC

PASS = 1.0
CURVE_BUCKETS = 60
PROMPTS_SHOWN = 200  # per-prompt pass rates listed (the hardest first); the count covers them all
GROUPS_SHOWN = 100  # zero-variance groups listed (their count covers them all)
REDACTED = "(redacted)"
_SECRET_NAME = re.compile(r"(?i)(key|token|secret|pass|pwd|credential|auth|cookie|session|private)")
_SECRET_VALUE = re.compile(r"\b(sk-[A-Za-z0-9_-]{8,}|hf_[A-Za-z0-9]{8,}|gh[pousr]_[A-Za-z0-9]{8,}|"
                           r"xox[abp]-[A-Za-z0-9-]{8,}|AKIA[0-9A-Z]{12,}|eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_.-]+)")
_ASSIGN = re.compile(r"(?P<name>\b[A-Za-z_][A-Za-z0-9_]*)=(?P<value>'[^']*'|\"[^\"]*\"|\S+)")
_USERINFO = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)[^/@\s]+@", re.I)
SCORED = "failure IN ('none', 'agent') AND reward IS NOT NULL"
PASSED = "sum(CASE WHEN reward >= ? THEN 1 ELSE 0 END)"  # (SQLite sums a comparison; PostgreSQL no boolean)
# mean generated tokens, mean turns, the share with a tool error (of those whose agent counts them), the share cut
# at the token limit (floats: PostgreSQL's avg of integers is a numeric)
LENGTHS = ("avg(CAST(generated AS FLOAT)), avg(CAST(turns AS FLOAT)), "
           "avg(CASE WHEN tool_errors > 0 THEN 1.0 WHEN tool_errors = 0 THEN 0.0 END), avg(CAST(truncated AS FLOAT))")
SORTS = {"seq": "seq", "reward": "reward", "duration": "coalesce(t_queue, 0) + coalesce(t_init, 0) + "
         "coalesce(t_run, 0) + coalesce(t_eval, 0)"}


# ------------------------------------------------------------ the config panel

def redact(value: Any, name: str = "") -> Any:
    """`value` (a spec, as stored) with what may be a secret replaced by REDACTED: the value of any key whose name
    looks like one (…key, …token but not `tokenizer`, password, credential, …), every `env` value whose name does,
    a URL's user:password@, and in free text (a harness command) `NAME=value` with such a name and values shaped
    like well-known tokens (sk-…, hf_…, ghp_…, AKIA…, JWTs)."""
    if isinstance(value, dict):
        return {k: (REDACTED if _secret_name(k) and not isinstance(v, (dict, list)) and v not in (None, "")
                    else redact(v, k)) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v, name) for v in value]
    if isinstance(value, str):
        text = _USERINFO.sub(lambda m: m.group("scheme") + REDACTED + "@", value)
        text = _ASSIGN.sub(lambda m: f"{m.group('name')}={REDACTED}" if _secret_name(m.group("name")) else m.group(0),
                           text)
        return _SECRET_VALUE.sub(REDACTED, text)
    return value


def _secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name)) and name.lower() not in ("tokenizer", "maxtokens", "maxtotaltokens",
                                                                   "maxtokensperturn", "mintokens")


def config(job: dict[str, Any]) -> dict[str, Any]:
    """The job as its user wrote it (metadata's name, namespace, labels; the spec), secrets redacted."""
    meta = job.get("metadata") or {}
    return {"metadata": redact({k: meta[k] for k in ("name", "namespace", "labels") if k in meta}),
            "spec": redact(job.get("spec") or {}), "generation": meta.get("generation")}


# ------------------------------------------------------------ curves, pass rates, groups

def _max_seq(c, job: str) -> int:
    return c.execute("SELECT max(seq) FROM trajectories WHERE job = ?", (job,)).fetchone()[0] or 0


class Curves:
    """Per job: the numbers of `curves`, kept until a trajectory arrives (the newest seq changes)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._kept: dict[str, tuple[str, int, dict[str, Any]]] = {}  # job → (uid, max seq, numbers)

    def get(self, job: str, uid: str, samples: int) -> dict[str, Any]:
        with self.engine.connect() as conn:
            db = raw(conn)
            top = _max_seq(db, job)
            kept = self._kept.get(job)
            if kept is not None and kept[0] == uid and kept[1] == top:
                return kept[2]
            out = curves(db, job, samples)
        self._kept[job] = (uid, top, out)
        while len(self._kept) > 256:
            self._kept.pop(next(iter(self._kept)))
        return out


def curves(db, job: str, samples: int) -> dict[str, Any]:
    """Reward mean, pass rate and LENGTHS (mean generated tokens and turns, tool-error and truncation rates) per
    policy version (in the order versions first appeared) and per time bucket (by each rollout's end), pass rates per prompt, and the complete groups (`samples` rewards, or the batch group's)
    whose rewards are all equal: zero variance, nothing for GRPO to learn from."""
    q = f"FROM trajectories INDEXED BY ix_trajectories_facts WHERE job = ? AND {SCORED}"
    by_policy = [{"policyVersion": json.loads(v) if v else None, "n": n, "rewardMean": _r(mean), "passRate": _r(p / n),
                  **_lengths(rest)}
                 for v, n, mean, p, _first, *rest in db.execute(
                     f"SELECT policy, count(*), avg(reward), {PASSED}, min(seq), {LENGTHS} {q} GROUP BY policy "
                     "ORDER BY min(seq)", (PASS, job))]
    lo, hi = db.execute(f"SELECT min(t_end), max(t_end) {q} AND t_end IS NOT NULL", (job,)).fetchone()
    over_time: dict[str, Any] = {"start": lo, "bucketSeconds": None, "points": []}
    if lo is not None:
        width = max((hi - lo) / CURVE_BUCKETS, 1.0)
        # (t_end - lo) / width ≥ 0: SQLite's CAST truncates it; PostgreSQL's rounds (floor first), and has LEAST
        bucket = (f"LEAST(CAST(floor((t_end - ?) / ?) AS INTEGER), {CURVE_BUCKETS - 1})" if isinstance(db, PgRaw)
                  else f"min(CAST((t_end - ?) / ? AS INTEGER), {CURVE_BUCKETS - 1})")
        over_time["bucketSeconds"] = round(width, 3)
        over_time["points"] = [{"bucket": int(b), "n": n, "rewardMean": _r(mean), "passRate": _r(p / n),
                                **_lengths(rest)}
                               for b, n, mean, p, *rest in db.execute(
                                   f"SELECT {bucket} AS b, count(*), avg(reward), {PASSED}, {LENGTHS} {q} "
                                   "AND t_end IS NOT NULL GROUP BY b ORDER BY b", (lo, width, PASS, job))]
    prompts = [{"prompt": pr, "taskId": task, "n": n, "passed": p, "passRate": _r(p / n), "rewardMean": _r(mean)}
               for pr, task, n, p, mean in db.execute(
                   f"SELECT prompt, max(task_id), count(*), {PASSED}, avg(reward) FROM trajectories "
                   f"WHERE job = ? AND {SCORED} GROUP BY prompt", (PASS, job))]
    prompts.sort(key=lambda p: (p["passRate"], p["prompt"]))
    groups = []
    for gid, pr, task, n, low, high, first in db.execute(
            f"SELECT group_id, min(prompt), max(task_id), count(*), min(reward), max(reward), min(seq) FROM trajectories "
            f"WHERE job = ? AND {SCORED} GROUP BY group_id, CASE WHEN group_id IS NULL THEN prompt END", (job,)):
        if n >= max(samples, 2) and low == high:
            groups.append({"group": gid, "prompt": pr, "taskId": task, "n": n, "reward": low, "seq": first})
    groups.sort(key=lambda g: g["seq"])
    scored_groups = db.execute(
        f"SELECT count(*) FROM (SELECT count(*) AS n FROM trajectories WHERE job = ? AND {SCORED} "
        "GROUP BY group_id, CASE WHEN group_id IS NULL THEN prompt END HAVING count(*) >= ?) AS g",
        (job, max(samples, 2))
    ).fetchone()[0]
    return {"passAt": PASS, "byPolicy": by_policy, "overTime": over_time,
            "prompts": {"total": len(prompts), "items": prompts[:PROMPTS_SHOWN],
                        "passed": sum(1 for p in prompts if p["passed"] > 0)},
            "zeroVariance": {"count": len(groups), "completeGroups": scored_groups, "items": groups[:GROUPS_SHOWN]}}


def behind(version: Any, history: list) -> int | None:
    """How many versions `version` is behind the newest announced (None: never announced, or nothing was)."""
    return len(history) - 1 - history.index(version) if version in history else None


def _r(x: float | None) -> float | None:
    return None if x is None else round(float(x), 4)


def _lengths(row: list) -> dict[str, float | None]:
    """LENGTHS' four numbers by name (None: no rollout in the set counts that one)."""
    return dict(zip(("generatedMean", "turnsMean", "toolErrorRate", "truncationRate"), (_r(x) for x in row)))


# ------------------------------------------------------------ the trajectories table, sorted

# tokens out of the stored document, in each database's JSON functions; generated tokens and turns from their columns
SQLITE_COUNTS = "json_array_length(data, '$.tokenIds'), generated, turns"
PG_COUNTS = f"json_array_length({PG_DOC} -> 'tokenIds'), generated, turns"


def search(engine: Engine, job: str, *, after: int = 0, offset: int = 0, limit: int = 50, sort: str = "seq",
           reward_min: float | None = None, reward_max: float | None = None, failure: str | None = None,
           task: str | None = None, text: str | None = None) -> dict[str, Any]:
    """One page of the job's trajectories matching every filter (and seq > `after`), sorted by `sort` (seq, reward
    or duration; a leading "-" descends; ties by seq), from `offset`; each with its tokens, generated tokens, turns and duration."""
    desc = sort.startswith("-")
    column = SORTS.get(sort.lstrip("-"))
    if column is None:
        raise ValueError(f"sort must be one of {', '.join(SORTS)} (a leading '-' descends)")
    where, args = ["job = ?", "seq > ?"], [job, after]
    for cond, value in (("reward >= ?", reward_min), ("reward <= ?", reward_max), ("failure = ?", failure or None),
                        ("task_id = ?", task or None), ("instr(data, ?) > 0", text or None)):
        cond = cond.replace("instr(", "strpos(") if is_pg(engine) else cond
        if value is not None:
            where.append(cond)
            args.append(value)
    order = f"{column} {'DESC' if desc else 'ASC'} NULLS LAST, seq {'DESC' if desc else 'ASC'}"
    sql = (f"SELECT seq, prompt, sample, reward, failure, task_id, policy, reason, {SORTS['duration']}, "
           f"{PG_COUNTS if is_pg(engine) else SQLITE_COUNTS} "
           f"FROM trajectories WHERE {' AND '.join(where)} ORDER BY {order} LIMIT ? OFFSET ?")
    with engine.connect() as c:
        rows = raw(c).execute(sql, (*args, limit + 1, offset)).fetchall()
    items = [{"seq": seq, "prompt": prompt, "sample": sample, "reward": reward, "failure": fail, "taskId": task_id,
              "policyVersion": json.loads(version) if version else None, "reason": reason,
              "seconds": round(seconds, 3) if seconds is not None else None, "tokens": tokens,
              "generatedTokens": generated, "turns": turns}
             for seq, prompt, sample, reward, fail, task_id, version, reason, seconds, tokens, generated, turns
             in rows[:limit]]
    return {"items": items, "next": offset + limit if len(rows) > limit else None}
