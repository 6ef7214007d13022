"""One job's trajectories read back for the web UI's trajectory page: one stored document and its GRPO group.

Called by `ui/app.py` in a worker thread (the sortable, filtered page of them is `ui/jobview.search`). Reads the trajectories table the feed writes
(`work/tables.py`) and hands the rows back as JSON-ready dicts; the running sums over a whole job are `stats.py`'s.
"""
from __future__ import annotations

import json
import math
from typing import Any

from sqlalchemy.engine import Engine

from ..dialects import raw


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
