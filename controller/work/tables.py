"""The work core's tables (SQLite or PostgreSQL, beside the store's jobs): tasks, items, trajectories, nodes, policies, batches.

Created by `create` when the scheduler starts; `queue`, `nodes`, `feed`, `policy` and `batches` read and write them.
"""
from __future__ import annotations

from sqlalchemy.engine import Engine
from sqlmodel import Field, Session, SQLModel

from ..dialects import columns, index_columns, is_pg
from ..store.replica_tables import delete_owners

from .states import BatchState, DaemonState, GroupState, ItemState


class TaskRow(SQLModel, table=True):
    __tablename__ = "tasks"
    job: str = Field(primary_key=True)
    prompt: int = Field(primary_key=True)
    data: str  # JSON: the dataset row


class ItemRow(SQLModel, table=True):
    __tablename__ = "items"
    id: int | None = Field(default=None, primary_key=True)
    job: str  # indexed with state below, as is state with deadline: no index of their own
    prompt: int
    sample: int
    state: str = ItemState.queued  # an ItemState
    stage: str | None = None  # leased | init | run | eval (while leased)
    attempt: int = 0
    attempt_id: str | None = Field(default=None, index=True)
    node_id: str | None = None  # not indexed: the leases a node holds are counted in memory (`held_leases`)
    deadline: float | None = None
    backend: str | None = None
    holds_backend: bool = False  # counted in the backend min-heap (pinned, RUN not over)
    queued_at: float = 0.0
    last_error: str = ""
    group_id: int | None = Field(default=None, index=True)  # batch mode: the group (GroupRow)


class TrajectoryRow(SQLModel, table=True):
    __tablename__ = "trajectories"
    seq: int | None = Field(default=None, primary_key=True)
    job: str = Field(index=True)
    item: int = Field(unique=True)
    prompt: int
    sample: int
    reward: float | None = None
    failure: str = "none"
    # what the UI sums up over a whole job (`work/stats.py`), copied out of `data` when stored: reading `data` back
    # for 100 000 rollouts takes seconds; the numbers sit in the covering index `ix_trajectories_facts`
    task_id: str | None = None
    policy: str | None = None  # JSON: the policy version
    reason: str = ""  # the failure's reason, its first FACT_REASON characters
    t_queue: float | None = None
    t_init: float | None = None
    t_run: float | None = None
    t_eval: float | None = None
    t_end: float | None = None  # epoch seconds the rollout ended (its end stamp, else when it was delivered)
    # the length and turn curves' (`ui/jobview.py`): generated tokens, turns, tool errors, 1 when cut at the token limit
    generated: int | None = None
    turns: int | None = None
    tool_errors: int | None = None
    truncated: int | None = None
    data: str  # JSON, wire form of the Trajectory
    group_id: int | None = Field(default=None, index=True)


class PolicyRow(SQLModel, table=True):
    __tablename__ = "policies"
    job: str = Field(primary_key=True)
    version: str = "null"  # JSON: the current policy version
    history: str = "[]"  # JSON: every version announced, in order (staleness is measured in this list)
    paused: bool = False


class NodeRow(SQLModel, table=True):
    __tablename__ = "nodes"
    id: str = Field(primary_key=True)
    job: str = Field(index=True)
    name: str
    host: str = ""
    pid: int = 0
    slot: int | None = None
    slurm_job_id: str | None = None
    slurm_node_id: int | None = None
    registered: float
    last_seen: float
    state: str = DaemonState.active  # a DaemonState
    features: str = ""  # the node-protocol features it registered with, comma-separated (crds.node.FEATURES)


class ExpansionRow(SQLModel, table=True):
    __tablename__ = "expansions"
    job: str = Field(primary_key=True)
    uid: str
    prompts: int
    total: int
    error: str = ""
    reason: str = ""  # the condition's reason when `error` fails the job (QuotaExceeded, WorkFailed)
    pending: int = 0  # prompts not expanded yet (`expansion.Expansions.admit` goes on from prompts - pending)


class GroupRow(SQLModel, table=True):
    __tablename__ = "groups"
    id: int | None = Field(default=None, primary_key=True)
    job: str = Field(index=True)
    batch: int = Field(index=True)
    prompt: int  # dataset index
    state: str = GroupState.running  # a GroupState
    rewards: str = "[]"
    opened: float = 0.0
    settled: float | None = None


class BatchRow(SQLModel, table=True):
    __tablename__ = "batches"
    job: str = Field(primary_key=True)
    k: int = Field(primary_key=True)
    state: str = BatchState.running  # a BatchState
    target: int = 0
    counted: int = 0
    opened_groups: int = 0
    created: float = 0.0
    completed: float | None = None
    cancelled_rollouts: int = 0
    never_started: int = 0
    saved_tokens: int = 0


class BatchPromptsRow(SQLModel, table=True):
    """The prompts a trainer named for a batch (its own table: older databases gain it as is)."""
    __tablename__ = "batch_prompts"
    job: str = Field(primary_key=True)
    k: int = Field(primary_key=True)
    prompts: str = "[]"  # JSON list of dataset indices, in the trainer's order


class CursorRow(SQLModel, table=True):
    __tablename__ = "cursors"
    job: str = Field(primary_key=True)
    next_prompt: int = 0  # grows forever; the dataset index is next_prompt % prompts


class OpenedRow(SQLModel, table=True):
    """The rollouts a batch job has opened over its life (`quotas.itemsPerJob`), kept beside each write that opens
    some (`batches.opened_items`): counting the job's items at every step of a fill grew with the batch (issue 36)."""
    __tablename__ = "opened_items"
    job: str = Field(primary_key=True)
    items: int = 0


FACT_REASON = 200
REAL_MAX = 1e15  # as `feed.real_fact`: seconds past it are not counted (a sum of them would overflow)


def _real(path: str) -> str:
    return f"CASE WHEN abs(json_extract(data, '{path}')) <= {REAL_MAX:.0f} THEN json_extract(data, '{path}') END"


FACTS = {"task_id": "json_extract(data, '$.taskId')", "policy": "json_quote(json_extract(data, '$.policyVersion'))",
         "reason": f"substr(coalesce(json_extract(data, '$.failure.reason'), ''), 1, {FACT_REASON})",
         **{f"t_{stage}": _real(f"$.timings.{stage}") for stage in ("queue", "init", "run", "eval")},
         "t_end": _real("$.timings.stamps.end")}
_FACT_TYPES = {"task_id": "VARCHAR", "policy": "VARCHAR", "reason": "VARCHAR NOT NULL DEFAULT ''"}
# Added later, on either database (column → SQLite's expression, PostgreSQL's): the metrics the agent loop counts,
# else the turns' own slices; a harness's segments are counted by the feed (`feed.facts`), not by this fill
# PostgreSQL reads a stored document as `json` through this: its json functions refuse the escape of a NUL (\u0000,
# which a node's text may hold: `store.nul_text`). The 6 characters of the escape become those of U+FFFD's, a valid
# escape too (and after an escaped backslash, plain letters): only strings change, never a count or a number
PG_DOC = r"replace(data, '\u0000', '\ufffd')::json"
COUNT_MAX = 2**31 - 1  # as `feed._count`: a count past it is not counted (PostgreSQL's columns are 32-bit)
# the turns' slices summed (0 without turns), past COUNT_MAX NULL; as floats (SQLite) and numerics (PostgreSQL): an
# integer sum past 2^63 was an error that stopped the fill
_SLICES = "total(json_extract(value, '$.generatedEnd') - json_extract(value, '$.generatedStart'))"
_TURN_SUM = f"(SELECT CASE WHEN abs({_SLICES}) <= {COUNT_MAX} THEN CAST({_SLICES} AS INTEGER) END " \
            "FROM json_each(data, '$.turns'))"
_PG_SLICES = "coalesce(sum((x ->> 'generatedEnd')::numeric - (x ->> 'generatedStart')::numeric), 0)"
_PG_TURN_SUM = f"(SELECT CASE WHEN abs({_PG_SLICES}) <= {COUNT_MAX} THEN trunc({_PG_SLICES})::int END " \
               f"FROM json_array_elements({PG_DOC} -> 'turns') AS x)"


def _metric(name: str) -> tuple[str, str]:
    """metrics.<name> when it is a number within ±COUNT_MAX (truncated to an integer, as `feed.length_facts` does),
    else NULL."""
    value, pg_value = f"json_extract(data, '$.metrics.{name}')", f"({PG_DOC} #>> '{{metrics,{name}}}')::numeric"
    return (f"CASE WHEN json_type(data, '$.metrics.{name}') IN ('integer', 'real') AND abs({value}) <= {COUNT_MAX} "
            f"THEN CAST({value} AS INTEGER) END",
            f"CASE WHEN json_typeof({PG_DOC} #> '{{metrics,{name}}}') = 'number' "
            f"THEN CASE WHEN abs({pg_value}) <= {COUNT_MAX} THEN trunc({pg_value})::int END END")


_GEN, _TURNS, _ERRORS = _metric("generated_tokens"), _metric("turns"), _metric("tool_errors")
LENGTH_FACTS = {
    "generated": (f"coalesce({_GEN[0]}, {_TURN_SUM})", f"coalesce({_GEN[1]}, {_PG_TURN_SUM})"),
    "turns": (f"coalesce({_TURNS[0]}, json_array_length(data, '$.turns'), 0)",
              f"coalesce({_TURNS[1]}, json_array_length({PG_DOC} -> 'turns'), 0)"),
    "tool_errors": _ERRORS,
    "truncated": ("CASE WHEN json_extract(data, '$.finishReason') = 'length' THEN 1 ELSE 0 END",
                  f"CASE WHEN {PG_DOC} ->> 'finishReason' = 'length' THEN 1 ELSE 0 END")}

CREATE_LOCK = 0x776F726B  # PostgreSQL advisory lock key held by `create` ("work")
PER_JOB = (TaskRow, ItemRow, TrajectoryRow, NodeRow, ExpansionRow, GroupRow, BatchRow, BatchPromptsRow, CursorRow,
           PolicyRow, OpenedRow)


def create(engine: Engine) -> None:
    """Create the work tables and indexes that are missing (older databases gain them as they are)."""
    with engine.begin() as c:
        if is_pg(c):  # controllers starting together on one server create these one after another
            c.exec_driver_sql(f"SELECT pg_advisory_xact_lock({CREATE_LOCK})")
        SQLModel.metadata.create_all(c, tables=[model.__table__ for model in PER_JOB])
        # "a job's live items": leases, completion (also in older databases). SQLite's index holds the rowid (`id`),
        # so a lease's `ORDER BY id LIMIT n` reads the queued items in order; PostgreSQL's must name `id`, else it
        # walks the primary key past every item already leased or done (81 ms a lease with 160 000 before the first
        # queued one, against 0.3 ms: tests/controller/work/test_item_indexes.py)
        if is_pg(c):
            c.exec_driver_sql("CREATE INDEX IF NOT EXISTS ix_items_job_state_id ON items (job, state, id)")
            c.exec_driver_sql("DROP INDEX IF EXISTS ix_items_job_state")
        else:
            c.exec_driver_sql("CREATE INDEX IF NOT EXISTS ix_items_job_state ON items (job, state)")
        # expire() every 0.5 s finds the overdue leases, not every live one (64 000 at 1000 nodes)
        c.exec_driver_sql("CREATE INDEX IF NOT EXISTS ix_items_state_deadline ON items (state, deadline)")
        # a batch's running groups, counted at every step of its fill: this index alone, not the job's every group
        c.exec_driver_sql("CREATE INDEX IF NOT EXISTS ix_groups_job_batch_state ON groups (job, batch, state)")
        # every index an item's state change rewrites is WAL pages written; these two repeat the prefixes above
        c.exec_driver_sql("DROP INDEX IF EXISTS ix_items_job")
        c.exec_driver_sql("DROP INDEX IF EXISTS ix_items_state")
        c.exec_driver_sql("DROP INDEX IF EXISTS ix_items_node_id")  # a lease wrote it at the node's place in it
        if "features" not in columns(c, "nodes"):  # older databases
            c.exec_driver_sql("ALTER TABLE nodes ADD COLUMN features VARCHAR NOT NULL DEFAULT ''")
        have = columns(c, "expansions")  # older databases: complete
        for column, ddl in (("reason", "VARCHAR NOT NULL DEFAULT ''"), ("pending", "INTEGER NOT NULL DEFAULT 0")):
            if column not in have:
                c.exec_driver_sql(f"ALTER TABLE expansions ADD COLUMN {column} {ddl}")
        _add_facts(c)
        # the UI's: a job's sums read from this index alone (never `data`), and a prompt's GRPO group
        # (task_id and reason stay out of it: text made each insert ~25 µs dearer; they are read from the rows)
        # (t_end: the throughput over time; LENGTH_FACTS last: the length curves; an index from before is made again)
        if "truncated" not in index_columns(c, "ix_trajectories_facts"):
            c.exec_driver_sql("DROP INDEX IF EXISTS ix_trajectories_facts")
        c.exec_driver_sql("CREATE INDEX IF NOT EXISTS ix_trajectories_facts ON trajectories (job, failure, reward, "
                          f"policy, t_queue, t_init, t_run, t_eval, t_end, {', '.join(LENGTH_FACTS)})")
        c.exec_driver_sql("CREATE INDEX IF NOT EXISTS ix_trajectories_job_prompt ON trajectories (job, prompt, sample)")


def _add_facts(c) -> None:
    """An older database's trajectories gain the FACTS columns (and LENGTH_FACTS, on either database), filled once
    from their documents."""
    have = columns(c, "trajectories")
    missing = [col for col in FACTS if col not in have]
    if missing and is_pg(c):  # PostgreSQL stores began with every column (FACTS are SQLite's JSON functions)
        raise RuntimeError(f"trajectories lacks {missing}: this PostgreSQL database was not made by rolloutd")
    for col in missing:
        c.exec_driver_sql(f"ALTER TABLE trajectories ADD COLUMN {col} {_FACT_TYPES.get(col, 'FLOAT')}")
    if missing:
        sets = ", ".join(f"{col} = {expr}" for col, expr in FACTS.items())
        c.exec_driver_sql(f"UPDATE trajectories SET {sets} WHERE json_valid(data)")
    later = [col for col in LENGTH_FACTS if col not in have]  # either database, once
    for col in later:
        c.exec_driver_sql(f"ALTER TABLE trajectories ADD COLUMN {col} INTEGER")
    if later:
        pg = is_pg(c)
        sets = ", ".join(f"{col} = {LENGTH_FACTS[col][pg]}" for col in later)
        # (PostgreSQL: a document that is not JSON would stop the fill; rolloutd writes only JSON)
        c.exec_driver_sql(f"UPDATE trajectories SET {sets}" + ("" if pg else " WHERE json_valid(data)"))


def purge(s: Session, job: str) -> None:
    """Delete every row of `job` from the work tables (a deleted job, or one re-created under its name), and the owner
    rows of its nodes (node shards: the replicas' views drop them at their next refresh, `shards.Shards._rows`)."""
    c = s.connection()
    delete_owners(c, job, is_pg(c))
    for model in PER_JOB:
        s.exec(model.__table__.delete().where(model.job == job))
