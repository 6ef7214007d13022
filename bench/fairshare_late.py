"""Fair share when the other job came first (issue 36): team-b's episodes/s on one real engine after team-a's
long-prompt episodes filled every slot of the backend; a short measurement beside `fairshare_worst`'s "a first".

Slots come from the controller's own classes (`BackendPool.acquire` over `Admission`: a refused node noted waiting,
a slot given back when a short episode ends); each node's calls go through its own `PolicyGate` and `TrackedLLM`, as in
a daemon; a beat loop hands each node's report to `workshare.beat` and `tokenshare.note` and sets its gates from the
answers, as the heartbeat does. team-b alone first (its rate R, every slot its own), then team-a alone until it holds
every slot with a call done, then team-b again, then team-b alone once more: its episodes/s in a window after a
warm-up ÷ its fair share (half of its rate alone, the mean of before and after, equal priorities), the slots it was
lent, and how long after its arrival its first episode ended. team-a alone is not held (work-conserving): on main, when team-b arrives each of team-a's episodes has a long prefill queued in the
engine, served first come, first served; with each node's prefill gate (`gated`, agents/daemon/prefillgate.py) one per
node. Results: `bench/results/RESULTS-fairshare.md`, "a first" explained and "the prefill gate".

    .venv/bin/python -c "from bench import fairshare_late as f; print(f.measure(16000))"
"""
from __future__ import annotations

import asyncio
import collections
import time

import httpx

from rolloutd.agents.daemon.llmgate import TrackedLLM
from rolloutd.agents.daemon.policygate import PolicyGate
from rolloutd.agents.daemon.prefillgate import PrefillGate
from rolloutd.agents.llm import SamplingParams
from rolloutd.agents.vllm_backend import VLLMBackend
from rolloutd.controller.work import tokenshare, workshare
from rolloutd.controller.work.admission import Admission
from rolloutd.controller.work.backend_health import kv_tokens
from rolloutd.controller.work.backends import BackendPool

A, B = "team-a/worst", "team-b/small"
CAP = 4  # the backend's episodes at once
A_NODES = {"a1": 3, "a2": 3}  # team-a's nodes and their RUN workers: more than the cap, so team-a waits for slots too
B_NODES = {"b1": 4}
ALONE_SECONDS, WARM_SECONDS = 30.0, 10.0  # team-b alone: 8 s moved its rate 22-32 episodes/s between runs


def engine_requests(metrics: str) -> float:
    """The requests a vLLM engine runs or queues, from its /metrics text (`fairshare_worst` waits on it too)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")))


def measure(a_prompt: int, window: float = 40.0, gated: bool = True, a_alone: float = 0.0) -> dict:
    """An engine of the tiny model with its whole context, started and stopped here; `late_arrival` on it."""
    from rolloutd.agents.engine.server import EngineServer

    engine = EngineServer("tiny", dtype="float32", max_model_len=65536)
    try:
        engine.start()
        return late_row(engine.url, a_prompt, window, gated, a_alone)
    finally:
        engine.stop()


def late_row(url: str, a_prompt: int, window: float, gated: bool = True, a_alone: float = 0.0) -> dict:
    """`late_arrival` on a running engine, with team-b's ratio to its fair share."""
    m = asyncio.run(late_arrival(url, a_prompt, window, gated, a_alone))
    fair = (m["b_alone"] + m["b_alone_after"]) / 4  # half of team-b's rate alone, before and after the shared window
    return {**m, "a_prompt": a_prompt, "window_s": window, "gated": gated,
            "ratio": m["b_shared"] / fair if fair else float("nan"),
            "ratio_before": 2 * m["b_shared"] / m["b_alone"] if m["b_alone"] else None,
            "ratio_after": 2 * m["b_shared"] / m["b_alone_after"] if m["b_alone_after"] else None,
            "steady_ratio": m["b_steady"] / fair if fair and m["b_steady"] is not None else None}


async def late_arrival(url: str, a_prompt: int, window: float, gated: bool = True, a_alone: float = 0.0) -> dict:
    """`gated=False`: each node's prefill gate lets every long prompt go at once (main before it). `a_alone` > 0:
    team-a's calls/s alone are measured over that many seconds before team-b arrives."""
    adm = Admission(time.monotonic, default=CAP)
    pool = BackendPool(adm)
    kv = kv_tokens(url) or tokenshare.FALLBACK_TOKENS
    for job in (A, B):
        adm.set_job(job, [url], None, 10)
    gates: dict[str, tuple[str, PolicyGate]] = {}
    holding: collections.Counter[str] = collections.Counter()  # node → its episodes holding a slot
    peak = collections.Counter()  # job → the most slots its nodes held at once
    for node, job in [(n, A) for n in A_NODES] + [(n, B) for n in B_NODES]:
        gate = PolicyGate()
        if not gated:
            gate.prefill = PrefillGate.off()
        gate.tokens.episodes = gate.rates.episodes = lambda u, n=node: max(1, holding[n])
        gates[node] = (job, gate)
    episodes: dict[str, list[float]] = {A: [], B: []}  # when each episode (b) or call (a) ended
    stop = {A: asyncio.Event(), B: asyncio.Event()}
    running: set[str] = set()  # nodes started
    drained: list[float] = []  # seconds the engine took to go idle before each of team-b's runs alone

    async def beats() -> None:  # every node's heartbeat, 4 a second
        while True:
            for node, (job, gate) in gates.items():
                if node not in running:
                    continue
                processed, held = gate.rates.report()
                tokenshare.note(adm, node, job, gate.tokens.report(gate.rates.wanted))
                rates = workshare.beat(adm, node, job, processed, held)
                gate.tokens.set(tokenshare.shares(adm, job, kv))
                gate.rates.set(rates)
            await asyncio.sleep(0.25)

    async def slot(node: str, job: str) -> None:
        """A lease: a slot on the backend, asked again every 0.25 s while admission refuses (the node waits)."""
        while pool.acquire([url], job) is None:
            adm.note(node, job, [url])
            await asyncio.sleep(0.25)
        adm.note(node, job, [])
        holding[node] += 1
        peak[job] = max(peak[job], sum(holding[n] for n, (j, _) in gates.items() if j == job))

    async def worker(llm: VLLMBackend, node: str, i: int) -> None:
        job, gate = gates[node]
        n = 0
        while not stop[job].is_set():
            await slot(node, job)
            tracked = TrackedLLM(llm, gate, url=url)
            try:
                if job == A:  # one episode for the whole run: long fresh prompts back to back
                    while not stop[job].is_set():
                        n += 1
                        prompt = [900 + i] + [(7 * j + 13 * n + 31 * i + ord(node[-1])) % 800 + 10
                                              for j in range(a_prompt - 1)]
                        await tracked.generate(prompt, SamplingParams(max_tokens=1, ignore_eos=True),
                                               f"la-{node}-{i}-{n}")
                        episodes[A].append(time.monotonic())
                else:  # a short episode: two calls, then the slot is given back
                    for _ in range(2):
                        n += 1
                        await tracked.generate([11 + i, 12, 13, 14, n % 700 + 20],
                                               SamplingParams(max_tokens=8, ignore_eos=True), f"la-{node}-{i}-{n}")
                    episodes[B].append(time.monotonic())
            finally:
                holding[node] -= 1
                pool.release(url, job)

    def start(llm: VLLMBackend, nodes: dict[str, int]) -> list[asyncio.Task]:
        running.update(nodes)
        return [asyncio.create_task(worker(llm, node, i)) for node, k in nodes.items() for i in range(k)]

    async def end(job: str, tasks: list[asyncio.Task]) -> None:
        stop[job].set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        stop[job].clear()

    def rate(job: str, t0: float, t1: float) -> float:
        return sum(1 for t in episodes[job] if t0 <= t < t1) / (t1 - t0)

    async def until(done, what: str, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, f"no {what} within {timeout:g} s"
            await asyncio.sleep(0.1)

    async def idle() -> float:
        """Seconds until the engine runs and queues nothing: a cancelled call's prefill goes on to the end of its
        engine step (tens of seconds for team-a's 65 000 tokens), which team-b alone must not share."""
        t0 = time.monotonic()
        async with httpx.AsyncClient(timeout=120) as http:
            while True:
                if engine_requests((await http.get(f"{url}/metrics")).text) == 0:
                    return time.monotonic() - t0
                await asyncio.sleep(0.5)

    async def alone_rate() -> float:
        """team-b alone: its first episodes (every slot free again), then its rate over ALONE_SECONDS."""
        drained.append(round(await idle(), 1))
        first = len(episodes[B])
        b_tasks = start(llm, B_NODES)
        await until(lambda: len(episodes[B]) >= first + 4 * sum(B_NODES.values()), "team-b's first episodes alone")
        t0 = time.monotonic()
        await asyncio.sleep(ALONE_SECONDS)
        measured = rate(B, t0, time.monotonic())
        await end(B, b_tasks)
        running.difference_update(B_NODES)
        return measured

    async with VLLMBackend(url) as llm:
        beating = asyncio.create_task(beats())
        alone = await alone_rate()
        peak.clear()
        a_tasks = start(llm, A_NODES)
        await until(lambda: adm.admitted[url][A] == CAP and len(episodes[A]) >= 1, "team-a holding every slot")
        t0 = time.monotonic()
        await asyncio.sleep(a_alone)
        a_rate = rate(A, t0, time.monotonic()) if a_alone > 0 else None
        arrived = time.monotonic()
        b_tasks = start(llm, B_NODES)
        await asyncio.sleep(WARM_SECONDS)
        w0 = time.monotonic()
        await asyncio.sleep(window)
        w1 = time.monotonic()
        slots = dict(adm.admitted[url])
        first = min((t for t in episodes[B] if t >= arrived), default=None)
        await end(B, b_tasks)
        await end(A, a_tasks)
        running.difference_update(A_NODES)
        alone_after = await alone_rate()
        beating.cancel()
    a_gates = [g for j, g in gates.values() if j == A]
    # from team-b's first episode on: its rate once what team-a had queued in the engine before it came is done
    steady = rate(B, max(first, w0), w1) if first is not None and first < w1 - 30 else None
    return {"b_alone": alone, "b_alone_after": alone_after, "b_shared": rate(B, w0, w1), "b_steady": steady,
            "a_calls": rate(A, w0, w1), "slots": slots,
            "b_slots_peak": peak[B],
            "b_first_episode_after_s": None if first is None else round(first - arrived, 1),
            "a_held": sum(g.rates.held_calls for g in a_gates), "a_prefill_held": sum(g.prefill.held for g in a_gates),
            "a_alone": a_rate, "idle_wait_s": drained}
