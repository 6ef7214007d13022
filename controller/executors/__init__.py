"""Executors turn a RolloutJob's `executor` section into running node daemons.

One interface (`base.py`: `Executor` — ensure / observe / release / shutdown — and the daemon
launch kit every kind shares), one module per kind: `local.py` (daemons as subprocesses of the
controller, the embedded default) and `slurm/` (sbatch / squeue / scancel).
"""
