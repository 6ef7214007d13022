"""Test doubles for the node daemon: a scripted task handler and scripted LLM backends.

`ScriptedTask` (kind "scripted") does what each task row asks, using a REAL sandbox when it gets
one: INIT writes `task.txt`, RUN runs bash in it (and leaves `ran.txt`), EVAL reads `ran.txt` back,
so a sandbox not handed from stage to stage fails the rollout. Row keys:
  - mode "loop": RUN is the real agent loop (`TaskHandler.run`) with the daemon's LLM/tokenizer;
  - llm: RUN calls `llm.generate` once (a blocking LLM then holds it in flight);
  - run_file: RUN waits until this file exists (drives a daemon in a subprocess);
  - init_fail, init_config (INIT raises ConfigError), eval_error ("EvalError" | "crash" | "sandbox"), eval_gate (an asyncio.Event name),
    init_gate / run_gate (asyncio.Event names), agent_fail, reward, pad (bytes of padding).
It records per task id the sandbox ids seen by each stage, per rollout the sandbox each stage
used (`chains`, proven by a token INIT leaves in the sandbox), and (monotonic) EVAL intervals.
Used in-process (`NodeDaemon(handler=ScriptedTask())`) and in a `rolloutd node` subprocess through
a test-time entry point (`scripted = scripted_tasks:ScriptedTask`).
"""
from __future__ import annotations

import asyncio
import os
import time
import uuid
from typing import Any, ClassVar

from rolloutd.agents.llm import Generation
from rolloutd.agents.tasks.base import ConfigError, EvalError, Reward, TaskHandler
from rolloutd.crds.trajectory import Failure, FailureKind, Trajectory
from rolloutd.sandbox import SandboxDied


class ScriptedTask(TaskHandler):
    name: ClassVar[str] = "scripted"
    needs_sandbox: ClassVar[bool] = True
    fields: ClassVar[dict] = {"id": (str, int)}

    def __init__(self) -> None:
        self.gates: dict[str, asyncio.Event] = {}
        self.sandbox_ids: dict[str, dict[str, str | None]] = {}
        self.init_tokens: dict[str, str] = {}              # INIT's token → its sandbox id
        self.chains: dict[str, dict[str, str | None]] = {}  # rollout (prompt-sample-attempt) → stage → sandbox
        self.sandboxes: dict[str, Any] = {}
        self.evals: dict[str, list[float]] = {}
        self.ran: list[str] = []

    def gate(self, name: str) -> asyncio.Event:
        return self.gates.setdefault(name, asyncio.Event())

    def messages(self, task: dict, tools: list[str]) -> list[dict]:
        return [{"role": "user", "content": task.get("question", "What is 6 times 7?")}]

    def _seen(self, task: dict, stage: str, sandbox: Any) -> None:
        self.sandbox_ids.setdefault(str(task["id"]), {})[stage] = getattr(sandbox, "id", None)

    async def init(self, task: dict, sandbox: Any) -> None:
        self._seen(task, "init", sandbox)
        self.sandboxes[str(task["id"])] = sandbox
        if task.get("init_gate"):
            await self.gate(task["init_gate"]).wait()
        if task.get("init_fail"):
            raise RuntimeError("task files could not be staged")
        if task.get("init_config"):
            raise ConfigError("spec.tasks.source: row 'cfg' names a repository this handler cannot use")
        await sandbox.write_file("task.txt", str(task["id"]))
        token = uuid.uuid4().hex
        self.init_tokens[token] = sandbox.id
        await sandbox.write_file("init.txt", token)

    async def run(self, task: dict, sandbox: Any, llm: Any, *, tokenizer: Any, config: Any, ctx: Any) -> Trajectory:
        self._seen(task, "run", sandbox)
        self.ran.append(str(task["id"]))
        key = f"{ctx.prompt}-{ctx.sample}-{ctx.attempt}"
        out = await sandbox.bash(f"cat task.txt && echo {key} > ran.txt", timeout=10)
        assert out.output.strip() == str(task["id"]), out
        token = (await sandbox.read_file("init.txt")).strip()
        self.chains[key] = {"init": self.init_tokens.get(token), "run": sandbox.id}
        if task.get("mode") == "loop":
            return await super().run(task, sandbox, llm, tokenizer=tokenizer, config=config, ctx=ctx)
        if task.get("llm"):
            await llm.generate([1, 2, 3], config.sampling, f"req-{task['id']}")
        if task.get("run_gate"):
            await self.gate(task["run_gate"]).wait()
        if task.get("run_file"):
            while not os.path.exists(task["run_file"]):
                await asyncio.sleep(0.02)
        failure = Failure(kind=FailureKind.agent, reason="turn limit") if task.get("agent_fail") else Failure()
        return Trajectory(
            job=ctx.job, prompt=ctx.prompt, sample=ctx.sample, task_id=str(task["id"]),
            token_ids=[5, 6, 7], prompt_length=1, loss_mask=[0, 1, 1], logprobs=[None, -0.5, -0.25],
            messages=[{"role": "assistant", "content": "42" + "x" * int(task.get("pad", 0))}],
            failure=failure, finish_reason="stop",
            node=ctx.node, backend=ctx.backend, attempt=ctx.attempt, policy_version=ctx.policy_version,
            reward_details={"submitted": None if task.get("agent_fail") else "42", "key": key},
        )

    async def eval(self, task: dict, sandbox: Any, trajectory: Trajectory) -> Reward:
        self._seen(task, "eval", sandbox)
        span = self.evals.setdefault(str(task["id"]), [time.monotonic()])
        try:
            if task.get("eval_gate"):
                await self.gate(task["eval_gate"]).wait()
            error = task.get("eval_error")
            if error == "EvalError":
                raise EvalError("the test harness crashed")
            if error == "crash":
                raise ZeroDivisionError("evaluator bug")
            if error == "sandbox":
                raise SandboxDied("the sandbox died during EVAL")
            ran = (await sandbox.read_file("ran.txt")).strip()
            key = trajectory.reward_details.get("key")
            if key is None:  # the real agent loop's trajectory: find the rollout by its sandbox
                key = next(k for k, c in self.chains.items() if c["run"] == sandbox.id)
            if ran != key:
                raise EvalError(f"EVAL got another rollout's sandbox: ran.txt says {ran!r}, expected {key!r}")
            self.chains[key]["eval"] = sandbox.id
            if trajectory.failure.kind == FailureKind.agent:
                return Reward(value=0.0, details={"reason": "no answer"})
            return Reward(value=float(task.get("reward", 1.0)), details={"checked": True})
        finally:
            span.append(time.monotonic())


class ReplyLLM:
    """Answers every turn with the ids of `text` + EOS (real tokenizer), distinct logprobs."""

    def __init__(self, tokenizer: Any, text: str = "The answer is 42.") -> None:
        self.tok, self.text = tokenizer, text
        self.request_ids: list[str] = []
        self.aborted: list[str] = []

    async def generate(self, prompt_ids, sampling, request_id):
        self.request_ids.append(request_id)
        ids = self.tok.encode_text(self.text) + [min(self.tok.eos_token_ids)]
        ids = ids[: sampling.max_tokens]
        return Generation(ids, [-0.01 * (i + 1) for i in range(len(ids))], "stop", list(prompt_ids), 0)

    async def abort(self, request_id):
        self.aborted.append(request_id)


class BlockingLLM:
    """`generate` never returns (a long generation); records what was started and aborted.
    Unlike VLLMBackend it does NOT abort on its own when cancelled: only the daemon can."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.aborted: list[str] = []

    async def generate(self, prompt_ids, sampling, request_id):
        self.started.append(request_id)
        await asyncio.Event().wait()

    async def abort(self, request_id):
        self.aborted.append(request_id)


class FreshEvalTask(ScriptedTask):
    """Like the swe kind: EVAL takes `sandbox_factory` and scores in a FRESH sandbox (which it
    closes); rows with `skip_fresh` never ask for it (the daemon must close the pre-started one)."""

    eval_sandbox: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        self.fresh: dict[str, dict] = {}

    async def eval(self, task: dict, sandbox: Any, trajectory: Trajectory, *, sandbox_factory=None) -> Reward:
        tid = str(task["id"])
        self.fresh[tid] = {"factory": sandbox_factory is not None}
        if task.get("skip_fresh") or sandbox_factory is None:
            return Reward(value=0.5)
        fresh = await sandbox_factory()
        try:
            clean = await fresh.bash("test -e ran.txt && echo dirty || echo clean", timeout=10)
            self.fresh[tid].update(id=fresh.id, root=fresh.root, clean=clean.output.strip())
            return Reward(value=1.0)
        finally:
            await fresh.close()
