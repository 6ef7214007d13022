"""Harbor task rollouts for tests: `task_sandbox` (a task's sandbox from its own image, INIT done) and
`rollouts` (oracle and no-op rollouts of every task under a directory: JSON `{task_id: {"oracle": reward,
"noop": reward}}` on stdout). Used by tests/agents/tasks/test_harbor.py in process (as root) and as an
unprivileged user (`python harbor_rollouts.py TASKS [SITE_DIR]`; `ROLLOUTD_TEST_COMMAND=...`: that command's
output in each task's sandbox instead), and by tests/agents/test_gateway.py."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import site
import sys


@contextlib.asynccontextmanager
async def task_sandbox(handler, task: dict, env: dict[str, str] | None = None, **spec):
    """A bwrap sandbox in the task's image (`spec`: more of the job's sandbox fields), INIT done; closed on the way out."""
    from rolloutd.sandbox import SandboxSpec, get_runtime

    base = SandboxSpec(env=env or {}, **spec)
    sandbox = await get_runtime("bwrap", handler.scope.sandbox_settings).create(await handler.sandbox_spec(task, base))
    try:
        await handler.init(task, sandbox)
        yield sandbox
    finally:
        await sandbox.close()


def _node_settings():
    """The sandbox settings from this process's environment, as a node daemon hands them to its handler."""
    from rolloutd.crds.kit.settings import SandboxSettings

    return SandboxSettings.from_env()


async def rollouts(source: str, env: dict[str, str] | None = None) -> dict:
    from rolloutd.agents.tasks import HandlerScope, get_handler
    from rolloutd.agents.loop.rollout import AgentConfig, RolloutContext
    from rolloutd.crds.trajectory import Trajectory

    handler = get_handler("harbor")
    handler.bind(HandlerScope(sandbox_settings=_node_settings()))

    async def one(task: dict, agent: str) -> float:
        async with task_sandbox(handler, task, env) as sandbox:
            ctx = RolloutContext(job="harbor-test", prompt=0, sample=0, task_id=task["id"])
            if agent == "oracle":
                trajectory = await handler.run(task, sandbox, None, tokenizer=None,
                                               config=AgentConfig(agent_kind="oracle"), ctx=ctx)
            else:  # the no-op agent: hands in the untouched environment
                trajectory = Trajectory(job="harbor-test", prompt=0, sample=0, task_id=task["id"])
            return (await handler.eval(task, sandbox, trajectory)).value

    tasks = handler.load(source)
    values = await asyncio.gather(*(one(t, a) for t in tasks for a in ("oracle", "noop")))
    return {t["id"]: {"oracle": values[2 * i], "noop": values[2 * i + 1]} for i, t in enumerate(tasks)}


PROBE = ("python3 -c 'import json, os, urllib.request; base = os.environ[\"OPENAI_BASE_URL\"]; "
         "print(json.loads(urllib.request.urlopen(base + \"/models\", timeout=30).read())[\"data\"][0][\"id\"])'")


async def harness_probe(source: str, env: dict[str, str] | None = None) -> dict:
    """A harness that needs no LLM (`agent.kind: harness`, no `llm`) asks the gateway for its models
    from inside each task's sandbox: the socket, the relay and the sandbox user's access to them."""
    from rolloutd.agents.tasks import HandlerScope, get_handler
    from rolloutd.agents.loop.rollout import AgentConfig, RolloutContext

    handler = get_handler("harbor")
    handler.bind(HandlerScope(sandbox_settings=_node_settings()))
    out = {}
    for task in handler.load(source)[:1]:
        async with task_sandbox(handler, task, env) as sandbox:
            trajectory = await handler.run(task, sandbox, None, tokenizer=None,
                                           config=AgentConfig(agent_kind="harness", agent_command=PROBE),
                                           ctx=RolloutContext(job="harbor-test", prompt=0, sample=0, task_id=task["id"]))
            out[task["id"]] = (await sandbox.read_file("/logs/agent/harness.txt")).strip()
    return out


async def probe_command(source: str, command: str, env: dict[str, str] | None = None) -> dict:
    """`command`'s output in each task's sandbox (INIT done): who the sandbox's code is.
    ``ROLLOUTD_TEST_NETWORK=1``: sandboxes with `network: true`."""
    from rolloutd.agents.tasks import HandlerScope, get_handler

    handler = get_handler("harbor")
    handler.bind(HandlerScope(sandbox_settings=_node_settings()))
    out = {}
    network = os.environ.get("ROLLOUTD_TEST_NETWORK") == "1"
    for task in handler.load(source):
        async with task_sandbox(handler, task, env, network=network) as sandbox:
            out[task["id"]] = (await sandbox.bash(command)).output.split()
    return out


if __name__ == "__main__":
    if len(sys.argv) > 2:
        site.addsitedir(sys.argv[2])  # the project's venv, seen by an interpreter outside it
    # an interpreter whose libpython is found through LD_LIBRARY_PATH needs it in the sandbox too
    env = {"LD_LIBRARY_PATH": os.environ["LD_LIBRARY_PATH"]} if os.environ.get("LD_LIBRARY_PATH") else {}
    probe = os.environ.get("ROLLOUTD_TEST_HARNESS_PROBE") == "1"
    if os.environ.get("ROLLOUTD_TEST_COMMAND"):
        print(json.dumps(asyncio.run(probe_command(sys.argv[1], os.environ["ROLLOUTD_TEST_COMMAND"], env))))
    else:
        print(json.dumps(asyncio.run((harness_probe if probe else rollouts)(sys.argv[1], env))))
