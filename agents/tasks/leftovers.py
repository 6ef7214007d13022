"""What the agent leaves running in its sandbox, kept away from a same-sandbox EVAL: a process left running has
the tests' user and could rewrite what they write (a JUnit report, a reward file) before it is read. Either
every such process ends before EVAL (`end_agent_processes`: `code.py`; `harbor.py` before a verifier gets the
network), or the agent is confined from RUN on and its processes may go on serving (`confine_agent`: Harbor).
Next step: the handler stages the tests and runs them in its own session.
"""
from __future__ import annotations

import logging

from .base import EvalError
from .seams import Sandbox

log = logging.getLogger("rolloutd.tasks")

# `kill -9 -1` until nothing but this session's shell and init (the server) runs: one pass can miss a child forked
# while it runs. A zombie counts as ended: it runs nothing, and init reaps it within a moment.
END_AGENT_PROCESSES = r"""_rolloutd_end_agent() {
  local _ stat line pid state left
  for _ in $(seq 200); do
    kill -9 -1 2>/dev/null; left=
    for stat in /proc/[0-9]*/stat; do
      read -r line < "$stat" 2>/dev/null || continue
      pid=${line%% *}; state=${line##*) }; state=${state%% *}
      [ "$pid" = 1 ] || [ "$pid" = $$ ] || [ "$state" = Z ] || [ "$state" = X ] || left="$left $pid"
    done
    [ -z "$left" ] && return 0
    sleep 0.05
  done
  echo "still running:$left"; return 1
}; _rolloutd_end_agent"""


def has_own_pids(sandbox: Sandbox) -> bool:
    """Whether the sandbox has a pid namespace of its own: not the `process` runtime, where `kill -1` would
    reach every process of the node's user."""
    return (getattr(sandbox, "limits", None) or {}).get("isolation") != "none"


async def end_agent_processes(sandbox: Sandbox, session: dict, what: str) -> bool:
    """Kill every process of the sandbox but `session`'s shell and the server (sessions, background jobs,
    the IPython kernel). False, doing nothing, where the sandbox has no pid namespace of its own."""
    if not has_own_pids(sandbox):
        return False
    result = await sandbox.bash(END_AGENT_PROCESSES, timeout=30, **session)
    if result.timed_out or result.exit_code != 0:
        raise EvalError(f"{what}: the agent's processes would not end: {result.output[-1000:]}")
    return True


async def confine_agent(sandbox: Sandbox, eval_session: dict, what: str) -> bool:
    """Before the agent runs, every session but `eval_session` is confined (sandbox/server/confine.py): nothing
    it leaves can write the control directory, where the verifier's files are, or signal the verifier. False
    where the kernel has no Landlock (a warning: such a process could then still rewrite the reward)."""
    result = await sandbox.confine([eval_session["session"]])
    if not result.confined:
        log.warning("%s: the agent runs unconfined (%s): a process it leaves could rewrite the reward",
                    what, result.reason)
    return bool(result.confined)


__all__ = ["END_AGENT_PROCESSES", "confine_agent", "end_agent_processes", "has_own_pids"]
