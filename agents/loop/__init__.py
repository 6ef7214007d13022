"""The agent loop: one rollout's turns (run.py), its tools in the sandbox (tools.py), its limits and identity
(rollout.py). Called by a task handler's `run` (agents/tasks/base.py); the next step is run.py (`run_agent_loop`).
"""
