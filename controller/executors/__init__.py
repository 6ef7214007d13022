"""Executors turn a RolloutJob's `executor` section into running node daemons.

One interface (`rolloutd.controller.reconciler.Executor`: ensure / observe / release), one
module per kind: `local.py` (daemons as subprocesses of the controller, the embedded default)
and, later, `slurm.py` (sbatch / squeue / scancel).
"""
