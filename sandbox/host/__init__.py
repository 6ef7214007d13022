"""Host confinement: what the node does around a sandbox — its rlimits and cgroup (limits.py), its network namespace
and the one way out (netns.py, egress.py), its syscall filter, what of the host it sees (hostview.py) and its
footprint on the host (footprint.py). Used by the runtimes' create template (sandbox/runtimes/base.py).
"""
