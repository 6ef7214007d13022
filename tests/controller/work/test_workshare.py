"""The work-share rule on the controller (issue 36): each job's processed tokens per second on a shared backend, from
its nodes' cumulative counts; the backend's capacity (the largest total rate while shared); a job's part by priority,
claimed by a job with calls in flight or held, lent by one without; no limit alone. A fake clock throughout."""
from __future__ import annotations

from rolloutd.controller.work import tokenshare, workshare
from rolloutd.controller.work.admission import Admission
from rolloutd.controller.work.workshare import WINDOW, Collector, beat, rates

URL, OTHER = "http://engine", "http://spare"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _shared(a_weight: int = 10, b_weight: int = 10) -> tuple[Admission, Clock]:
    """ns-a/big (2 episodes) and ns-b/small (1 episode) on URL; big may use OTHER too."""
    clock = Clock()
    adm = Admission(clock, default=8)
    adm.set_job("ns-a/big", [URL, OTHER], None, a_weight)
    adm.set_job("ns-b/small", [URL], None, b_weight)
    for _ in range(2):
        adm.take(URL, "ns-a/big")
    adm.take(URL, "ns-b/small")
    return adm, clock


def test_alone_or_unmeasured_means_no_limit():
    clock = Clock()
    adm = Admission(clock, default=8)
    adm.set_job("ns-a/big", [URL, OTHER], None, 10)
    adm.take(URL, "ns-a/big")
    beat(adm, "n1", "ns-a/big", {})
    assert beat(adm, "n1", "ns-a/big", {URL: 100_000}) == {URL: 0, OTHER: 0}
    adm.set_job("ns-b/small", [URL], None, 10)
    adm.take(URL, "ns-b/small")
    assert rates(adm, "ns-b/small")[URL] > 0  # shared and measured: limited
    fresh, _ = _shared()
    assert rates(fresh, "ns-a/big") == {URL: 0, OTHER: 0}  # nothing measured yet on either


def test_a_job_beside_a_wanting_job_gets_its_part_of_the_capacity_per_episode():
    adm, clock = _shared()
    beat(adm, "a1", "ns-a/big", {URL: 0})
    beat(adm, "b1", "ns-b/small", {URL: 0})
    clock.t += WINDOW
    beat(adm, "a1", "ns-a/big", {URL: 60 * 1000})  # 1000 tokens/s over the window
    beat(adm, "b1", "ns-b/small", {URL: 60 * 10})  # 10/s: blocked behind big's prefills
    tokenshare.note(adm, "b1", "ns-b/small", {URL: 80})  # small has a call in flight: it wants its part
    got = rates(adm, "ns-a/big")
    assert got[OTHER] == 0 and got[URL] == (1010 / 2) / 2  # half the capacity, over big's two episodes
    assert rates(adm, "ns-b/small")[URL] >= 1010 / 2  # small is under its part: never held


def test_a_job_without_calls_lends_what_it_does_not_use():
    adm, clock = _shared()
    beat(adm, "a1", "ns-a/big", {URL: 0})
    beat(adm, "b1", "ns-b/small", {URL: 0})
    clock.t += WINDOW
    beat(adm, "a1", "ns-a/big", {URL: 60 * 1000})
    beat(adm, "b1", "ns-b/small", {URL: 60 * 10})  # nothing in flight or held: it claims its rate only
    assert rates(adm, "ns-a/big")[URL] == (1010 - 10) / 2


def test_priorities_weigh_the_parts():
    adm, clock = _shared(a_weight=30, b_weight=10)
    beat(adm, "a1", "ns-a/big", {URL: 0})
    beat(adm, "b1", "ns-b/small", {URL: 0})
    clock.t += WINDOW
    beat(adm, "a1", "ns-a/big", {URL: 60 * 800})
    beat(adm, "b1", "ns-b/small", {URL: 60 * 200})
    tokenshare.note(adm, "a1", "ns-a/big", {URL: 1})
    tokenshare.note(adm, "b1", "ns-b/small", {URL: 1})
    assert rates(adm, "ns-a/big")[URL] == 1000 * 3 / 4 / 2
    assert rates(adm, "ns-b/small")[URL] == 1000 / 4


def test_the_capacity_does_not_shrink_while_shared_and_follows_the_total_once_alone():
    adm, clock = _shared()
    tokenshare.note(adm, "b1", "ns-b/small", {URL: 80})
    beat(adm, "a1", "ns-a/big", {URL: 0})
    beat(adm, "b1", "ns-b/small", {URL: 0})
    clock.t += WINDOW
    beat(adm, "a1", "ns-a/big", {URL: 60 * 1000})
    assert rates(adm, "ns-a/big")[URL] == 1000 / 2 / 2
    clock.t += WINDOW + 1  # big is held: it processes less, small trickles; the capacity stays what the engine did
    beat(adm, "a1", "ns-a/big", {URL: 60 * 1000 + 60 * 100})
    beat(adm, "b1", "ns-b/small", {URL: 60 * 5})
    assert rates(adm, "ns-a/big")[URL] == 1000 / 2 / 2
    adm.give(URL, "ns-b/small")  # small's episode ends: big alone, no limit
    assert rates(adm, "ns-a/big")[URL] == 0
    clock.t += WINDOW + 1
    beat(adm, "a1", "ns-a/big", {URL: 60 * 1100 + 60 * 300})
    rates(adm, "ns-a/big")  # alone for a window: the capacity is the total again
    assert workshare.state(adm).backends[URL].capacity == 300.0


def test_counts_are_cumulative_per_node_a_restart_counts_anew_and_a_foreign_backend_counts_nothing():
    adm, clock = _shared()
    beat(adm, "a1", "ns-a/big", {URL: 10**9})  # first heard of (the controller restarted): its counts so far are
    beat(adm, "a2", "ns-a/big", {})            # not this window's
    beat(adm, "b1", "ns-b/small", {})
    beat(adm, "a1", "ns-a/big", {URL: 10**9 + 800})
    beat(adm, "a2", "ns-a/big", {URL: 100})
    beat(adm, "a1", "ns-a/big", {URL: 50})  # a1's daemon restarted: its 50 are new
    beat(adm, "b1", "ns-b/small", {URL: 10, "http://not-mine": 10**9})
    assert dict(workshare.state(adm).backends[URL].sums) == {"ns-a/big": 950, "ns-b/small": 10}
    assert "http://not-mine" not in workshare.state(adm).backends
    clock.t += WINDOW + 1
    rates(adm, "ns-a/big")
    assert dict(workshare.state(adm).backends[URL].sums) == {}  # out of the window


def test_held_calls_and_seconds_are_counted_per_namespace_on_metrics():
    adm, _ = _shared()
    beat(adm, "a1", "ns-a/big", {}, [0, 0.0])
    beat(adm, "a2", "ns-a/big", {}, [0, 0.0])
    beat(adm, "a1", "ns-a/big", {}, [2, 3.5])
    beat(adm, "a1", "ns-a/big", {}, [5, 10.0])
    beat(adm, "a2", "ns-a/big", {}, [1, 1.0])
    families = {f.name: {s.labels["namespace"]: s.value for s in f.samples} for f in Collector(adm).collect()}
    assert families == {"rolloutd_llm_rate_held_calls": {"ns-a": 6.0},
                        "rolloutd_llm_rate_held_seconds": {"ns-a": 11.0}}


def test_a_beat_carries_processed_tokens_and_its_reply_the_jobs_allowance(tmp_path, store_location):
    """Through the controller's own beat (`attempts.Attempts.beat`): the counts noted, the allowance answered."""
    from .test_admission import URL as JOB_URL, lease, make, reg
    from rolloutd.crds.node import Heartbeat

    _, sched, _ = make(tmp_path, store_location, {"a": dict(prompts=10, priority=3), "b": dict(prompts=10)},
                       max_episodes=8)
    na, nb = reg(sched, "a", "na"), reg(sched, "b", "nb")
    url = JOB_URL
    assert sched.work.calls.heartbeat(na, Heartbeat()).llm_rates == {url: 0}  # named, no limit
    sched.work.calls.heartbeat(nb, Heartbeat())
    got_a, got_b = lease(sched, na, 2), lease(sched, nb, 1)
    stages = {la.attempt_id: "run" for la in got_a}
    sched.work.calls.heartbeat(nb, Heartbeat(stages={got_b[0].attempt_id: "run"}, llm_tokens={url: 10},
                                             llm_processed={url: 100}))  # b has a call in flight: it claims
    reply = sched.work.calls.heartbeat(na, Heartbeat(stages=stages, llm_processed={url: 40_000},
                                                     llm_rate_held=[3, 1.5]))
    capacity = workshare.state(sched.work.pool.admission).backends[url].capacity
    assert capacity > 0 and reply.llm_rates[url] == round(capacity * 3 / 4 / 2, 3)  # its part, over 2 episodes
    assert dict(workshare.state(sched.work.pool.admission).held_calls) == {"default": 3.0}
