"""One job's trajectories read back for the web UI: a filtered page of them, one stored document, a GRPO group.

Called by `ui/app.py` (the trajectory page: `trajectory` and its `group`) in a worker thread; `search` filters one
page by seq (the UI's sortable page is `ui/jobview.search`). Reads the trajectories table the feed writes
(`work/tables.py`) and hands the rows back as JSON-ready dicts; the running sums over a whole job are `stats.py`'s.
"""
from __future__ import annotations

import json
import math
from typing import Any

from sqlalchemy.engine import Engine

from ..dialects import is_pg, raw


def search(engine: Engine, job: str, *, after: int = 0, limit: int = 50, reward_min: float | None = None,
           reward_max: float | None = None, failure: str | None = None, task: str | None = None,
           text: str | None = None) -> dict[str, Any]:
    """One page of a job's trajectories (seq > `after`, in order) matching every filter given."""
    where, args = ["job = ?", "seq > ?"], [job, after]
    if reward_min is not None:
        where.append("reward >= ?")
        args.append(reward_min)
    if reward_max is not None:
        where.append("reward <= ?")
        args.append(reward_max)
    if failure:
        where.append("failure = ?")
        args.append(failure)
    if task:
        where.append("task_id = ?")
        args.append(task)
    if text:
        where.append("strpos(data, ?) > 0" if is_pg(engine) else "instr(data, ?) > 0")
        args.append(text)
    sql = ("SELECT seq, prompt, sample, reward, failure, task_id, policy, reason FROM trajectories WHERE "
           + " AND ".join(where) + " ORDER BY seq LIMIT ?")
    with engine.connect() as c:
        rows = raw(c).execute(sql, (*args, limit + 1)).fetchall()
    items = [{"seq": seq, "prompt": prompt, "sample": sample, "reward": reward, "failure": fail, "taskId": task_id,
              "policyVersion": json.loads(version) if version else None, "reason": reason}
             for seq, prompt, sample, reward, fail, task_id, version, reason in rows[:limit]]
    return {"items": items, "next": items[-1]["seq"] if len(rows) > limit else None}


def trajectory(engine: Engine, job: str, seq: int) -> str | None:
    """The stored JSON of trajectory `seq` when it belongs to `job`."""
    with engine.connect() as c:
        row = raw(c).execute("SELECT data FROM trajectories WHERE seq = ? AND job = ?", (seq, job)).fetchone()
    return None if row is None else row[0]


def group(engine: Engine, job: str, prompt: int, group_id: int | None) -> list[dict[str, Any]]:
    """The samples of a GRPO group (the prompt's, or the batch group's) with their rewards and advantages."""
    with engine.connect() as c:
        if group_id is not None:
            rows = raw(c).execute("SELECT seq, sample, reward, failure FROM trajectories WHERE job = ? AND "
                                  "group_id = ? ORDER BY sample", (job, group_id)).fetchall()
        else:
            rows = raw(c).execute("SELECT seq, sample, reward, failure FROM trajectories WHERE job = ? AND "
                                  "prompt = ? AND group_id IS NULL ORDER BY sample", (job, prompt)).fetchall()
    scored = [r[2] for r in rows if r[2] is not None]
    mean = sum(scored) / len(scored) if scored else 0.0
    std = math.sqrt(sum((x - mean) ** 2 for x in scored) / len(scored)) if scored else 0.0
    return [{"seq": seq, "sample": sample, "reward": reward, "failure": fail,
             "advantage": None if reward is None else round((reward - mean) / std, 4) if std > 0 else 0.0}
            for seq, sample, reward, fail in rows]
