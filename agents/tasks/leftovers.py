"""Ends every process the agent left in its sandbox before EVAL runs tests there: a process left running has
the tests' user and could rewrite what they write (a JUnit report, a reward file) before it is read.

Used by the handlers whose EVAL shares the RUN sandbox (`code.py`; `harbor.py` before a verifier gets the
network). Next step: the handler stages the tests and runs them in its own session.
"""
from __future__ import annotations

from typing import Any

from .base import EvalError

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


def has_own_pids(sandbox: Any) -> bool:
    """Whether the sandbox has a pid namespace of its own: not the `process` runtime, where `kill -1` would
    reach every process of the node's user."""
    return (getattr(sandbox, "limits", None) or {}).get("isolation") != "none"


async def end_agent_processes(sandbox: Any, session: dict, what: str) -> bool:
    """Kill every process of the sandbox but `session`'s shell and the server (sessions, background jobs,
    the IPython kernel). False, doing nothing, where the sandbox has no pid namespace of its own."""
    if not has_own_pids(sandbox):
        return False
    result = await sandbox.bash(END_AGENT_PROCESSES, timeout=30, **session)
    if result.timed_out or result.exit_code != 0:
        raise EvalError(f"{what}: the agent's processes would not end: {result.output[-1000:]}")
    return True


__all__ = ["END_AGENT_PROCESSES", "end_agent_processes", "has_own_pids"]
