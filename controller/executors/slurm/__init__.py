"""The Slurm executor: RolloutJobs' node daemons as Slurm allocations (`executor.SlurmExecutor`).

Modules: `executor` (decides), `script` (what sbatch submits), `cli` (Slurm's commands),
`retire` (taking allocations away), `state` (what it remembers across restarts).
"""
