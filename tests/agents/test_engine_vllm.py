"""Real engines end to end: a backend killed mid-request, the serve-model command, the agent loop
on the tiny model (token exactness through several turns), the chat template vs vLLM's own."""
import asyncio
import contextlib
import os
import signal
import subprocess
import sys

import httpx
import pytest

from support.engine_fixtures import LOG_REQUESTS, fresh_engine, wait_engine_took
from rolloutd.agents.engine.server import live_group_members
from rolloutd.agents.llm import BackendError, SamplingParams
from rolloutd.agents.vllm_backend import VLLMBackend
from rolloutd.agents.loop.run import run_agent_loop
from rolloutd.agents.engine.model_dirs import model_dir
from rolloutd.agents.tokenizer import ChatTokenizer
from rolloutd.agents.loop.tools import tool_specs
from rolloutd.agents.loop.rollout import AgentConfig, RolloutContext
from rolloutd.crds.trajectory import FailureKind

from support.agent_fakes import FakeSandbox
from support.waiting import wait_until

MESSAGES = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "List the files."}]


def test_backend_killed_mid_request_is_an_infra_failure_never_a_reward():
    tok = ChatTokenizer(model_dir("tiny"))
    with fresh_engine("tiny", extra_args=LOG_REQUESTS) as engine:
        pgid = engine.proc.pid

        async def go():
            async with VLLMBackend(engine.url) as llm:
                config = AgentConfig(max_turns=2, max_tokens_per_turn=3500, max_total_tokens=4000, tools=["bash"],
                                     sampling=SamplingParams(ignore_eos=True, seed=1), backend_wait=1.0)
                loop = asyncio.create_task(run_agent_loop(
                    MESSAGES, sandbox=FakeSandbox(), llm=llm, tokenizer=tok, config=config,
                    ctx=RolloutContext(job="kill", prompt=0, sample=0)))
                await asyncio.to_thread(wait_engine_took, engine, loop, 0)
                engine.kill()  # SIGKILL the whole engine process group mid-request
                result = await loop
                # and a fresh request to the dead backend is an infra error too
                with pytest.raises(BackendError):
                    await llm.generate([1, 2, 3], SamplingParams(max_tokens=2), "after")
                return result

        result = asyncio.run(go())
        traj = result.trajectory
        assert traj.failure.kind == FailureKind.infra and "LLM backend" in traj.failure.reason
        assert traj.reward is None
        assert traj.turns == [] and sum(traj.loss_mask) == 0  # nothing half-recorded
        assert not engine.alive()
        assert live_group_members(pgid) == []  # the whole group is gone


def test_agent_loop_on_a_real_engine_is_token_exact(tiny_engine, monkeypatch):
    """Several real turns: the engine saw exactly prompt + generated + observation ids each turn, and
    re-scoring the final sequence gives back every reported logprob at the masked positions.

    The tiny random model cannot write tool calls, so the parser is told that its first two turns
    were bash calls; the generated ids themselves are the engine's, verbatim."""
    import rolloutd.agents.loop.run as loop_mod
    from rolloutd.agents.loop.tools import ToolCall

    tok = ChatTokenizer(model_dir("tiny"))
    parsed: list[str] = []

    def parse(text, allowed, *_format):
        parsed.append(text)
        return [ToolCall("bash", {"command": f"echo turn {len(parsed)}"})] if len(parsed) <= 2 else []

    monkeypatch.setattr(loop_mod, "parse_tool_calls", parse)
    sandbox = FakeSandbox()
    sent: list[list[int]] = []

    async def go():
        async with VLLMBackend(tiny_engine.url) as llm:
            real_generate = llm.generate

            async def generate(prompt_ids, sampling, request_id):
                sent.append(list(prompt_ids))
                return await real_generate(prompt_ids, sampling, request_id)

            llm.generate = generate  # type: ignore[method-assign]
            # a random model rarely says EOS: 400 of its 1024 ids end a turn (a stop id is kept in the
            # output, but is no end-of-turn token, so the observation ids also close the turn)
            config = AgentConfig(max_turns=4, max_tokens_per_turn=64, tools=["bash", "submit"],
                                 sampling=SamplingParams(seed=7, stop_token_ids=list(range(100, 500))),
                                 drift_check=True)
            return await run_agent_loop(MESSAGES, sandbox=sandbox, llm=llm, tokenizer=tok, config=config,
                                        ctx=RolloutContext(job="exact", prompt=1, sample=2))

    result = asyncio.run(go())
    traj = result.trajectory
    assert traj.failure.kind != FailureKind.infra
    assert len(traj.turns) == 3 and sandbox.commands == ["echo turn 1", "echo turn 2"]
    assert sent[0] == traj.token_ids[: traj.prompt_length] == tok.encode_chat(MESSAGES, tools=tool_specs(["bash", "submit"]))
    for i, turn in enumerate(traj.turns):
        assert sent[i] == traj.token_ids[: turn.generated_start]
        if i < 2:
            obs = tok.decode(traj.token_ids[turn.observation_start:turn.observation_end])
            assert f"turn {i + 1}" in obs and obs.endswith("<|im_start|>assistant\n")
    generated = [i for i, m in enumerate(traj.loss_mask) if m]
    assert len(generated) == sum(t.generated_end - t.generated_start for t in traj.turns) > 0
    r = httpx.post(f"{tiny_engine.url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": traj.token_ids, "max_tokens": 1, "prompt_logprobs": 0, "return_token_ids": True,
    }).json()["choices"][0]
    assert r["prompt_token_ids"] == traj.token_ids
    rescored = [r["prompt_logprobs"][i][str(traj.token_ids[i])]["logprob"] for i in generated]
    assert rescored == pytest.approx([traj.logprobs[i] for i in generated], abs=1e-3)
    assert all(traj.logprobs[i] is None for i in range(len(traj.token_ids)) if not traj.loss_mask[i])
    assert traj.metrics["drift_mismatches"] >= 0


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_chat_template_matches_the_engines(model, request):
    """Our prompt ids are the ids vLLM's own chat rendering gives (same template, same tokenizer)."""
    engine = request.getfixturevalue(f"{model}_engine")
    tok = ChatTokenizer(model_dir(model))
    r = httpx.post(f"{engine.url}/tokenize", timeout=60,
                   json={"model": engine.served_name, "messages": MESSAGES, "add_generation_prompt": True})
    assert r.status_code == 200, r.text
    assert tok.encode_chat(MESSAGES) == r.json()["tokens"]


def test_serve_model_command_serves_and_stops_on_sigterm(tmp_path):
    """`rolloutd serve-model --model tiny` prints its URL once it answers; SIGTERM stops the engine."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rolloutd.controller.main", "serve-model", "--model", "tiny", "--port", "0"],
        stdout=subprocess.PIPE, stderr=open(tmp_path / "err", "wb"), text=True, start_new_session=True)
    try:
        url = proc.stdout.readline().strip()  # printed only once /health answered
        assert url.startswith("http://127.0.0.1:"), (tmp_path / "err").read_text()[-2000:]
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == ["tiny"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/health", timeout=5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def _processes() -> dict[int, tuple[int, int, str]]:
    """Live (non-zombie) processes: pid → (parent pid, session id, name)."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    stat = fh.read()
            except OSError:
                continue
            name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
            if fields[0] not in ("Z", "X"):
                out[int(entry)] = (int(fields[1]), int(fields[3]), name)
    return out


def test_kill_9_of_serve_model_takes_every_engine_process_with_it(tmp_path):
    """vLLM's EngineCore is a grandchild of serve-model (PR_SET_PDEATHSIG alone cannot reach it):
    `kill -9` of serve-model while the engine starts (EngineCore up, model loading) must leave no
    process of the engine's session alive, reparented to PID 1."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rolloutd.controller.main", "serve-model", "--model", "tiny", "--port", "0"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "err", "wb"), start_new_session=True)

    def engine_session() -> int | None:
        """The engine's session (its own, apart from serve-model's) once EngineCore runs."""
        assert proc.poll() is None, (tmp_path / "err").read_text()[-2000:]
        procs = _processes()
        for pid, (ppid, sid, name) in procs.items():
            if name.startswith("VLLM::EngineCor") and sid != proc.pid:
                while ppid in procs and ppid != proc.pid:  # EngineCore descends from serve-model
                    ppid = procs[ppid][0]
                if ppid == proc.pid:
                    return sid
        return None

    def members(sid: int) -> list[int]:
        return [pid for pid, (_, s, _) in _processes().items() if s == sid]

    sid = None
    try:
        sid = wait_until(engine_session, 600, "vLLM's EngineCore to start", every=0.1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        wait_until(lambda: not members(sid), 60, "every engine process to end", every=0.1)
    finally:
        for pid in [proc.pid, *(members(sid) if sid else [])]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_the_tiny_model_takes_a_harness_sized_prompt(tiny_engine):
    """A real harness's first call is long (Claude Code's: ~20k tokens): the tiny model serves 65 536
    positions on the CPU engine's default KV budget, and a 30k-token prompt gets an answer, the same ids
    again with the same seed (the second time from the prefix cache)."""
    tok = ChatTokenizer(model_dir("tiny"))
    models = httpx.get(f"{tiny_engine.url}/v1/models", timeout=30).json()["data"]
    assert models[0]["max_model_len"] == 65536
    prompt = tok.encode_chat([{"role": "user", "content": "count the words " * 5000}])
    assert len(prompt) > 20000

    def answer():
        return httpx.post(f"{tiny_engine.url}/v1/completions", timeout=600, json={
            "model": "tiny", "prompt": prompt, "max_tokens": 8, "seed": 1, "ignore_eos": True,
            "return_token_ids": True}).json()

    first, again = answer(), answer()
    assert first["usage"]["prompt_tokens"] == len(prompt) and len(first["choices"][0]["token_ids"]) == 8
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
