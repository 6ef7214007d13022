"""The node daemon (`python -m rolloutd.agents.daemon`, or `rolloutd node` by hand): one per allocated node;
leases rollouts, runs INIT → RUN → EVAL, reports.

Entry: `__main__.py` → agents/cli.py `node` → `daemon.run_node`; the modules beside it each do one step of the flow.
"""
