"""`rolloutctl`, the user's kubectl-shaped CLI: `entry.main` is the command (`--version` and `fast.py`'s plain `get`
before anything heavy is imported), `app.py` the typer app with one module per command group beside it.

Imports nothing, so that the fast path pays for no more than its own modules. Next step: `entry.py`.
"""
