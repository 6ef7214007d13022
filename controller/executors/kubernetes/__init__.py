"""The Kubernetes executor: a RolloutJob's node daemons as one Indexed Job (`executor.KubernetesExecutor`).

Modules: `executor` (decides and calls the API), `manifests` (the Job and Secret it creates, pure),
`clients` (the API client factories it is made with), `pods` (its pods' states and logs).
"""
