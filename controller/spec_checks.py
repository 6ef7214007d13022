"""What the API checks of a RolloutJob's spec beyond its schema, before storing it: things a job could not do.

Called by the write routes' validation (`kube/validate.py`, after the controller's policy) so that a job that
cannot run is a 422 naming the field at apply, not a job that fails, or silently "succeeds", later:
- the task kind is one this controller knows (it reads the dataset with that kind's handler) and runs the job's
  `agent.kind` (`TaskHandler.agent_kinds`; e.g. math runs the loop only);
- on create by the admin (`check_dataset`, from `kube/admit.py`): `tasks.source` exists and the controller may
  read it (a tenant's job reads beneath its data roots without following links: a stat here would tell it which
  files exist elsewhere, so its load fails the job instead, naming spec.tasks.source);
- `tasks.source` is an absolute path (a relative one would resolve against whichever directory the controller
  or a daemon runs in; `rolloutctl apply -f` resolves it against the file's directory before sending);
- `llm.tokenizer` is an absolute path (`allowlists.tokenizer_problem`) and, where the controller sees the node's
  filesystem (the local executor, when this controller runs it), a directory: tokenizers load offline only, so a model hub name cannot load.
A Slurm or Kubernetes node checks its tokenizer itself: a config error naming spec.llm.tokenizer fails the job.
Next step: the reconcile (`operator/reconcile.py`).
"""
from __future__ import annotations

import os

from rolloutd.agents.tasks.registry import UnknownTaskKind, get_handler, handler_options
from rolloutd.crds.rolloutjob import RolloutJob

from .errors import Invalid


def spec_problems(job: RolloutJob, shared_filesystem: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """(camelCase field, why) for each thing in the spec that cannot work. `shared_filesystem`: the executor kinds
    whose nodes see this controller's files (`Executor.shares_files`): their jobs' tokenizer directories are checked."""
    spec, problems = job.spec, []
    try:
        kinds = type(get_handler(spec.tasks.kind)).agent_kinds
    except UnknownTaskKind as e:  # this controller reads the dataset with the kind's handler: it can never run
        problems.append(("spec.tasks.kind", str(e)))
        kinds = None
    except TypeError:
        kinds = None
    if kinds is not None and spec.tasks.options:
        try:
            get_handler(spec.tasks.kind, **handler_options(spec.tasks.options))
        except (TypeError, ValueError) as e:  # an option the handler does not take, or a value it refuses
            problems.append(("spec.tasks.options", f"task kind {spec.tasks.kind!r}: {e}"))
    if kinds is not None and spec.agent.kind not in kinds:
        problems.append(("spec.agent.kind", f"task kind {spec.tasks.kind!r} (spec.tasks.kind) runs agent.kind "
                                            f"{' or '.join(kinds)}, not {spec.agent.kind!r}"))
    if not os.path.isabs(spec.tasks.source):
        problems.append(("spec.tasks.source", f"{spec.tasks.source!r} is not an absolute path (a relative path would "
                                              "resolve against the controller's working directory); `rolloutctl "
                                              "apply -f FILE` resolves it against FILE's directory"))
    tokenizer = spec.llm.tokenizer
    if tokenizer and os.path.isabs(tokenizer) and spec.executor.kind in shared_filesystem \
            and not os.path.isdir(tokenizer):
        problems.append(("spec.llm.tokenizer", f"{tokenizer} is not a directory on this machine (tokenizers load "
                                               "offline only, from the directory holding tokenizer.json)"))
    return problems


def check_dataset(job: RolloutJob) -> None:
    """422 naming spec.tasks.source when the controller, which reads the dataset to expand the job, cannot."""
    source = job.spec.tasks.source
    why = unreadable(source) if os.path.isabs(source) else None
    if why is not None:
        raise Invalid(f"RolloutJob is invalid: spec.tasks.source: {source}: {why}", name=job.metadata.name,
                      causes=[{"field": "spec.tasks.source", "reason": "FieldValueInvalid", "message": f"{source}: {why}"}])


def unreadable(path: str) -> str | None:
    """Why the controller cannot read the dataset at `path` (checked after the tenant's data roots), or None."""
    if not os.path.exists(path):
        return "no such file or directory on the controller (it reads the dataset to expand the job)"
    if not os.access(path, os.R_OK):
        return "the controller may not read it (permission denied)"
    return None


def check_spec(job: RolloutJob, shared_filesystem: frozenset[str] = frozenset()) -> None:
    """422 naming every field of `spec_problems`."""
    causes = [{"field": f, "reason": "FieldValueInvalid", "message": m} for f, m in spec_problems(job, shared_filesystem)]
    if causes:
        raise Invalid("RolloutJob is invalid: " + "; ".join(f"{c['field']}: {c['message']}" for c in causes),
                      causes=causes, name=job.metadata.name)
