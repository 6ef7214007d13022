"""A node's beats and results, each in a transaction: alone (tools, tests) or committed with the other node calls
of this turn of the loop (`group_commit.GroupCommit`, the node routes). `attempts.Attempts` does the work."""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily
from sqlalchemy.engine import Engine

from rolloutd.crds.node import Heartbeat, HeartbeatResponse, ResultAck, ResultBatch

from . import hot_sql
from .attempts import Attempts, BeatReads
from .group_commit import GroupCommit
from .first_tokens import FirstTokens
from .job_state import Jobs
from .node_registry import NodeRegistry


class NodeCalls:
    def __init__(self, engine: Engine, jobs: Jobs, registry: NodeRegistry, attempts: Attempts,
                 first_tokens: FirstTokens) -> None:
        """`first_tokens`: the model calls' time to first token of every reported result (a metric)."""
        self.engine, self.jobs, self.registry, self.attempts = engine, jobs, registry, attempts
        self.first_tokens = first_tokens
        self.group = GroupCommit(engine)  # node calls committed together

    def heartbeat(self, node_id: str, hb: Heartbeat, lease: int | None = None) -> HeartbeatResponse:
        """A beat in a transaction of its own; with `lease` (the node's free slots) the next leases ride on it."""
        return hot_sql.run_alone(self.engine, self._beat(node_id, hb, lease))

    async def heartbeat_grouped(self, node_id: str, hb: Heartbeat, lease: int | None = None) -> HeartbeatResponse:
        """`heartbeat`, its transaction committed with the other calls of this turn of the loop."""
        return await self.group.submit(self._beat(node_id, hb, lease))

    def _beat(self, node_id: str, hb: Heartbeat, lease: int | None) -> "_Beat":
        job = self.jobs.find(self.registry.job_of(node_id))  # read before: the group must not wait on the store
        self.first_tokens.observe_all(hb.results)
        return _Beat(self.attempts, node_id, hb, lease, job)

    def results(self, node_id: str, batch: ResultBatch, lease: int | None = None) -> ResultAck:
        """A batch of results; with `lease` (the node's free slots) the next leases ride on the reply."""
        return hot_sql.run_alone(self.engine, self._results(node_id, batch, lease))

    async def results_grouped(self, node_id: str, batch: ResultBatch, lease: int | None = None) -> ResultAck:
        """`results`, committed with the other calls of this turn of the loop."""
        return await self.group.submit(self._results(node_id, batch, lease))

    def _results(self, node_id: str, batch: ResultBatch, lease: int | None) -> "_Results":
        job = self.jobs.find(self.registry.job_of(node_id))  # read before: the group must not wait on the store
        self.first_tokens.observe_all(batch.results)
        return _Results(lambda tx: self.attempts.results(tx, node_id, batch, job, lease),
                        (node_id, [r.attempt_id for r in batch.results]))


class _Results:
    """A results call's work (`hot_sql.Work`), with the node and attempts it touches (`group_reads.GroupReads`)."""

    def __init__(self, work: hot_sql.Work, claims: tuple[str, list[str]]) -> None:
        self.work, self.claims = work, claims

    def __call__(self, tx: hot_sql.Tx) -> tuple[ResultAck, hot_sql.Done]:
        return self.work(tx)


class _Beat:
    """A beat's work (`hot_sql.Work`); in a PostgreSQL group its reads are sent before the group's calls run
    (`send`), and used at its turn unless the group's ORM ran meanwhile (`group_reads.GroupReads.stale`)."""

    def __init__(self, attempts: Attempts, node_id: str, hb: Heartbeat, lease: int | None, job) -> None:
        self.attempts, self.node_id, self.hb, self.lease, self.job = attempts, node_id, hb, lease, job
        self.claims = (node_id, [r.attempt_id for r in hb.results])
        self.sent: BeatReads | None = None

    def send(self, tx: hot_sql.Tx) -> None:
        self.sent = self.attempts.beat_reads(tx, self.node_id, self.hb, self.lease, self.job)

    def __call__(self, tx: hot_sql.Tx) -> tuple[HeartbeatResponse, hot_sql.Done]:
        sent = self.sent if tx.group is not None and not tx.group.stale else None
        return self.attempts.beat(tx, self.node_id, self.hb, self.lease, self.job, sent)


class Collector:
    """/metrics: the node calls' groups (`group_commit.GroupCommit`), how long each call waited for its group, how long
    the groups ran, and how many rolled back whole. Waits growing while the groups' own time does not: the calls queue
    for one lane of groups."""

    def __init__(self, group: GroupCommit) -> None:
        self.group = group

    def collect(self):
        g = self.group
        yield CounterMetricFamily("rolloutd_node_call_groups", "transactions that committed node calls together",
                                  value=g.groups)
        yield CounterMetricFamily("rolloutd_node_calls_grouped", "node calls (beats, results) committed in them",
                                  value=g.calls)
        yield CounterMetricFamily("rolloutd_node_call_group_seconds", "seconds the event loop ran those groups",
                                  value=g.seconds)
        yield CounterMetricFamily("rolloutd_node_call_group_wait_seconds", "node calls' seconds from their arrival "
                                  "to their group's start, summed", value=g.waited)
        yield CounterMetricFamily("rolloutd_node_call_groups_rolled_back", "PostgreSQL groups rolled back whole (a "
                                  "statement refused in their one pipeline; each call answered 503)",
                                  value=g.rolled_back)
