"""The Slurm executor's typed record: per RolloutJob, its allocations, the retired ones on their way
out, and the crash-loop count. Kept in `slurm-executor.json` (StateFile) under the keys it always had.

Used by `executor.py` (which decides) and `retire.py` (which takes allocations away). A file written
before the record was typed loads unchanged: every key is the same, missing ones take the defaults.
"""
from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

log = logging.getLogger("rolloutd.executor.slurm")


class _Record(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class Allocation(_Record):
    """A Slurm job that runs (or will run) one daemon per node for a RolloutJob."""
    nodes: int
    submitted: float = 0.0                 # clock() at sbatch (or adoption)
    started: float | None = None           # clock() when first seen running
    nodelist: str = ""
    drained: list[str] = Field(default_factory=list)   # nodes whose daemons drain before going back to Slurm
    drain_at: float = 0.0                  # when they were told to
    left_at: float | None = None           # when the last of them deregistered

    @property
    def size(self) -> int:
        """Nodes the job counts on: the drained ones are on their way out."""
        return self.nodes - len(self.drained)


class Retirement(_Record):
    """An allocation on its way out: SIGTERM at `term_at` if it runs (the daemons drain), a plain
    scancel `grace` later or at once if it is pending; forgotten when Slurm reports it ended."""
    at: float
    term_at: float | None = None           # files of old: None means `at`
    sigterm_sent: bool = Field(default=False, alias="term")
    scancel_sent: bool = Field(default=False, alias="hard")
    scancel_at: float = Field(default=0.0, alias="hard_at")

    @property
    def sigterm_due(self) -> float:
        return self.at if self.term_at is None else self.term_at


class JobRecord(_Record):
    """Everything the executor keeps about one RolloutJob (by name; `uid` tells incarnations apart)."""
    uid: str = ""
    allocs: dict[str, Allocation] = Field(default_factory=dict)
    retired: dict[str, Retirement] = Field(default_factory=dict)
    failures: int = 0                      # allocations lost young / sbatch failures in a row
    next_submit: float = 0.0               # no sbatch before this clock()
    last_error: str = ""
    submits: int = 0
    released: bool = False                 # release() ran: forgotten once nothing is left

    @property
    def size(self) -> int:
        return sum(a.size for a in self.allocs.values())

    def retire(self, alloc_id: str, now: float, delay: float = 0.0) -> None:
        """The one way an allocation leaves a job: SIGTERM after `delay`, scancel after the grace."""
        self.allocs.pop(alloc_id, None)
        self.retired[alloc_id] = Retirement(at=now, term_at=now + delay)


class Records(dict[str, JobRecord]):
    """Every job's record by name; `dirty` when one changed since the state file was written."""
    dirty: bool = False


def load_records(data: Any) -> Records:
    """The state file's content as records. A job's record that cannot be read is dropped with a
    warning: its live allocations carry its tag in Slurm and are adopted again from squeue."""
    records = Records()
    if not isinstance(data, dict):
        return records
    for name, raw in data.items():
        try:
            records[name] = JobRecord.model_validate(raw)
        except ValidationError as e:
            log.warning("ignoring the unreadable record of %s in the Slurm executor's state file: %s", name, e)
    return records


def dump_records(records: dict[str, JobRecord]) -> dict[str, Any]:
    return {name: rec.model_dump(by_alias=True) for name, rec in records.items()}
