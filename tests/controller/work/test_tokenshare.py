"""The token-share rule on the controller (issue 36): the budget (the operator's, else the engine's KV cache from
`/server_info`, else the fallback), each job's priority part, lending while the backend has room (held only when it
is full and the job is over its part), and a reply naming every backend the job may use (0: no cap)."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import httpx

from rolloutd.controller.work import tokenshare
from rolloutd.controller.work.admission import Admission
from rolloutd.controller.work.backend_health import HealthProbe
from rolloutd.controller.work.backend_http import BackendHttp
from rolloutd.controller.work.backends import BackendPool
from rolloutd.controller.work.tokenshare import FALLBACK_TOKENS, REPORT_SECONDS, budget, shares
from rolloutd.crds.node import Heartbeat

from .test_admission import URL as JOB_URL, lease, make, reg

URL, OTHER = "http://engine", "http://spare"


def _shared(clock=time.time) -> Admission:
    """ns/a (priority 30, 4 episodes) and ns/b (priority 10, 2 episodes) on URL; ns/a may use OTHER too."""
    adm = Admission(clock, default=8)
    adm.set_job("ns/a", [URL, OTHER], None, 30)
    adm.set_job("ns/b", [URL], None, 10)
    for _ in range(4):
        adm.take(URL, "ns/a")
    for _ in range(2):
        adm.take(URL, "ns/b")
    return adm


def test_alone_means_no_cap_on_every_backend_the_job_may_use():
    adm = Admission(time.time, default=8)
    adm.set_job("ns/a", [URL, OTHER], None, 30)
    assert shares(adm, "ns/a", 1000) == {URL: 0, OTHER: 0}  # named before any episode: its nodes never wait
    adm.take(URL, "ns/a")
    assert shares(adm, "ns/a", 1000) == {URL: 0, OTHER: 0}
    adm.set_job("ns/b", [URL], None, 10)
    adm.take(URL, "ns/b")
    adm.give(URL, "ns/b")
    assert shares(adm, "ns/a", 1000) == {URL: 0, OTHER: 0}  # b left: a is alone again


def test_a_full_backend_holds_each_job_to_its_priority_part():
    adm = _shared()
    tokenshare.note(adm, "a1", "ns/a", {URL: 900})
    tokenshare.note(adm, "b1", "ns/b", {URL: 100})  # 1000 in flight: full
    assert shares(adm, "ns/a", 1000) == {URL: 750 // 4, OTHER: 0}  # 3/4 over its 4 episodes, no cap on OTHER
    assert shares(adm, "ns/b", 1000) == {URL: 250 // 2}  # under its part: may grow to it, not beyond
    assert shares(adm, "ns/c", 1000) == {}  # no episode and no backend: nothing to name


def test_a_node_cannot_fill_a_backend_its_job_may_not_use():
    adm = _shared()
    tokenshare.note(adm, "b1", "ns/b", {OTHER: 10**9, "http://anywhere": 10**9})  # ns/b may use URL only
    assert tokenshare.in_flight(adm, OTHER) == {} and adm.token_sums.get("http://anywhere") is None
    assert shares(adm, "ns/a", 1000) == {URL: 1000 // 4, OTHER: 0}  # nothing in flight on URL: all its room lent


def test_unused_tokens_are_lent_while_the_backend_has_room():
    clock = SimpleNamespace(t=1000.0)
    adm = _shared(lambda: clock.t)
    tokenshare.note(adm, "b1", "ns/b", {URL: 50})  # b sends almost nothing
    tokenshare.note(adm, "a1", "ns/a", {URL: 400})
    tokenshare.note(adm, "a2", "ns/a", {URL: 200})  # a: 600 in flight over two nodes, room 1000 − 650 = 350
    assert shares(adm, "ns/a", 1000)[URL] == (600 + 350) // 4  # past its part (750) by the room left
    assert shares(adm, "ns/b", 1000)[URL] == (50 + 350) // 2  # its own part is 250: room lent to it too
    tokenshare.note(adm, "b1", "ns/b", {URL: 50 + 400})  # b's gate now holds a call it may not send: full
    assert shares(adm, "ns/a", 1000)[URL] == 750 // 4  # a, over its part, is brought back to it
    assert shares(adm, "ns/b", 1000)[URL] == 250 // 2
    tokenshare.note(adm, "b1", "ns/b", {URL: 50})
    tokenshare.note(adm, "a2", "ns/a", {})  # a node's beat with nothing in flight replaces its report
    assert shares(adm, "ns/a", 1000)[URL] == (400 + 550) // 4
    clock.t += REPORT_SECONDS + 1  # b1 and a2 went silent (dead nodes): their reports lapse at a1's next beat
    tokenshare.note(adm, "a1", "ns/a", {URL: 400})
    assert adm.node_tokens.keys() == {"a1"} and shares(adm, "ns/a", 1000)[URL] == (400 + 600) // 4
    tokenshare.note(adm, "b1", "ns/b", {URL: 50})
    adm.forget_job("ns/b")  # a deleted job's reports go with it
    assert adm.node_tokens.keys() == {"a1"} and tokenshare.in_flight(adm, URL) == {"ns/a": 400}


def test_the_budget_is_the_operators_else_the_engines_kv_cache_else_the_fallback():
    adm = Admission(time.time, default=8)
    assert budget(adm, URL) == FALLBACK_TOKENS
    adm.learned(URL, 256, 2_000_000)
    assert budget(adm, URL) == 2_000_000
    adm.replicas = 2  # node shards: each replica shares its half
    assert budget(adm, URL) == 1_000_000
    adm.replicas, adm.tokens = 1, 8192  # ROLLOUTD_BACKEND_TOKENS overrides the engine
    assert budget(adm, URL) == 8192
    adm.tokens = None
    adm.unlearn(URL)  # the engine went down: it may come back with another cache
    assert budget(adm, URL) == FALLBACK_TOKENS


def test_the_health_probe_learns_the_kv_cache_from_server_info():
    def engine(request: httpx.Request) -> httpx.Response:  # vLLM's dev-mode answer, trimmed
        return httpx.Response(200, json={"vllm_config": {"scheduler_config": {"max_num_seqs": 64},
                                                         "cache_config": {"num_gpu_blocks": 1000, "block_size": 16}}})

    async def go() -> Admission:
        pool = BackendPool(Admission(time.time))
        http = BackendHttp()
        http._client = httpx.AsyncClient(transport=httpx.MockTransport(engine))
        await HealthProbe(pool, http, time.time)._learn_max_num_seqs(URL)
        return pool.admission

    adm = asyncio.run(go())
    assert adm.reported[URL] == 64 and budget(adm, URL) == 16_000


def test_a_beat_reports_tokens_in_flight_and_its_reply_names_every_backend(tmp_path, store_location):
    _, sched, _ = make(tmp_path, store_location, {"a": dict(prompts=10, priority=3), "b": dict(prompts=10)},
                       max_episodes=8, backend_tokens=1000)
    na, nb = reg(sched, "a", "na"), reg(sched, "b", "nb")
    url = JOB_URL
    first = sched.work.calls.heartbeat(na, Heartbeat())
    assert first.llm_tokens == {url: 0}  # before any episode: named, no cap
    got_a, got_b = lease(sched, na, 2), lease(sched, nb, 1)
    assert len(got_a) == 2 and len(got_b) == 1
    stages = {la.attempt_id: "run" for la in got_a}
    sched.work.calls.heartbeat(nb, Heartbeat(stages={got_b[0].attempt_id: "run"}, llm_tokens={url: 10}))
    full = sched.work.calls.heartbeat(na, Heartbeat(stages=stages, llm_tokens={url: 990}))
    assert full.llm_tokens == {url: 750 // 2}  # full: its part (3/4) over its 2 episodes
    light = sched.work.calls.heartbeat(na, Heartbeat(stages=stages, llm_tokens={url: 100}))
    assert light.llm_tokens == {url: (100 + 890) // 2}  # room left: lent past its part
