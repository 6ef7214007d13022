"""Adapters that let third-party trainers use rolloutd as their rollout source (`rolloutd.integrations.*`).

Each lives in its own optional extra (e.g. `pip install 'rolloutd[trl]'`); the core never imports them.
"""
