"""The controller's own Prometheus collectors: jobs by phase, the store's syncs, the running sums kept in memory, the
staleness bound's and the rollouts' counters since the controller started (no job or rollout is a label).

Registered by `api.create_app` on the root's registry; /metrics (`generate_latest`) asks each one at every scrape.
"""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rolloutd.crds.job_status import Phase

from .store import Store


class JobsCollector:
    """The jobs by phase as `refresh` last read them: /metrics refreshes in a worker thread before it asks the
    collectors, so that a stalled database holds the scrape, never the event loop."""

    def __init__(self, store: Store):
        self.store = store
        self.counts: dict[str, int] = {p.value: 0 for p in Phase}

    def refresh(self) -> None:
        counts = {p.value: 0 for p in Phase}
        for item in self.store.list_wire()[0]:
            counts[item["status"].get("phase", "Pending")] += 1
        self.counts = counts

    def collect(self):
        g = GaugeMetricFamily("rolloutd_jobs", "RolloutJobs by phase", labels=["phase"])
        for phase, n in self.counts.items():
            g.add_metric([phase], n)
        yield g


class DurableCollector:
    """The syncs that make acknowledged writes durable (`durability.Durable`), since the controller started."""

    def __init__(self, durable):
        self.durable = durable

    def collect(self):
        d = self.durable
        yield CounterMetricFamily("rolloutd_store_syncs", "fsyncs of the store's WAL before acknowledging writes",
                                  value=d.syncs)
        yield CounterMetricFamily("rolloutd_store_synced_writes", "Acknowledged writes that waited for a sync",
                                  value=d.settled)
        yield CounterMetricFamily("rolloutd_store_sync_seconds", "Seconds spent in those fsyncs", value=d.sync_seconds)
        yield CounterMetricFamily("rolloutd_store_sync_wait_seconds", "Seconds writes waited for their sync, summed",
                                  value=d.wait_seconds)


class StatsCollector:
    """What the trajectories' running sums (`work/stats.JobStats`) hold in memory."""

    def __init__(self, job_stats):
        self.job_stats = job_stats

    def collect(self):
        kept = self.job_stats.kept()
        g = GaugeMetricFamily("rolloutd_job_stats_jobs", "Jobs whose trajectory numbers the controller keeps in "
                              "memory: running sums, or a finished job's rendered numbers", labels=["kind"])
        for kind in ("running", "final"):
            g.add_metric([kind], kept[kind])
        yield g
        yield GaugeMetricFamily("rolloutd_job_stats_stage_times", "Stage times kept for the running sums' percentiles",
                                value=kept["stage_times"])


class StalenessCollector:
    """The staleness bound's work since the controller started (`work/staleness.StaleGroups`), all jobs together."""

    def __init__(self, stale):
        self.stale = stale

    def collect(self):
        yield CounterMetricFamily("rolloutd_stale_rollouts_cancelled", "Rollouts in flight cancelled on the daemons "
                                  "at an announce: leased more than spec.policy.maxStaleness versions before it",
                                  value=self.stale.totals["cancelledRollouts"])
        yield CounterMetricFamily("rolloutd_stale_groups_swept", "Counted groups taken out of a running batch at an "
                                  "announce: admitted more than maxStaleness versions before it",
                                  value=self.stale.totals["sweptGroups"])
        yield CounterMetricFamily("rolloutd_stale_groups_gated", "Groups not opened by the capacity gate: (S + v + 1)"
                                  " x the batch's groups accepted or running at most", value=self.stale.totals["gated"])
        yield CounterMetricFamily("rolloutd_stale_rollouts_rerun", "Results that came back more than "
                                  "spec.policy.maxStaleness versions old, their samples run again with the current "
                                  "policy", value=self.stale.totals["rerun"])


class RolloutsCollector:
    """Retries, masked samples, cleanups and stalls since the controller started, all jobs together
    (`work/queue.ItemQueue.totals`, `work/held_leases.HeldLeases.stalls`): no job or rollout is a label."""

    def __init__(self, queue):
        self.queue = queue

    def collect(self):
        totals = self.queue.totals
        yield CounterMetricFamily("rolloutd_rollout_retries", "Rollout attempts run again after one failed for "
                                  "infrastructure, lost its lease or came back stale", value=totals["retries"])
        yield CounterMetricFamily("rolloutd_rollouts_masked", "Rollouts delivered infra-failed once their attempts "
                                  "were used up: masked samples, no reward", value=totals["masked"])
        yield CounterMetricFamily("rolloutd_rollout_cleanups", "Rollouts in flight cancelled on their nodes (a job "
                                  "deleted or failed, a surplus or stale group): the node stops their sandbox",
                                  value=totals["cleanups"])
        yield CounterMetricFamily("rolloutd_rollout_stalls", "Rollouts that stayed in one stage (or unnamed by their "
                                  "node's beats) for ROLLOUTD_STALLED_AFTER_SECONDS or more, once per stage",
                                  value=self.queue.leases.count_stalls(self.queue.clock()))
