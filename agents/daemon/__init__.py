"""The node daemon (`rolloutd node`): one per allocated node; leases rollouts, runs INIT → RUN → EVAL, reports.

Entry: `daemon.run_node` (from agents/cli.py); the modules beside it each do one step of the flow.
"""
