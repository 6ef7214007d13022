"""Stand-ins for the world around rolloutd, shared by tests/ and bench/: a real Slurm cluster on one machine
(`minicluster.py`), node daemons simulated by the thousand over the real node protocol (`simnodes.py`), LLM
backends that only answer health checks and a task kind that does nothing (`noop.py`, `plugins/`).

tests/ and bench/ may both import this package; it imports neither (tests/test_structure.py keeps the
three apart). It ships with the controller (`rolloutd.controller.sim`) so a user can load-test or try the
Slurm executor on one machine too (`python -m rolloutd.controller.sim.minicluster start`). Next step: the stub LLM backends of tests/ and bench/ could
join here as one."""
