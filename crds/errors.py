"""The failure taxonomy: one root, three families, one `classify(exc) -> FailureKind`.

Where it sits: the bottom layer (`crds/`), so every part may import it. Every exception class of the product
derives from `RolloutdError` through one family; its built-in base (`ValueError`, `RuntimeError`, ...) stays as
a second base, as SWE-ReX's `exceptions.py` does, so existing `except ValueError` keep working:

* `InfraError` — our machinery failed (a sandbox died, a backend did not answer, EVAL crashed, the controller
  is unreachable): retried or excluded, never a reward.
* `ConfigurationError` — the job's (or the node's) configuration cannot work (a bad dataset, a spec field, a
  request the backend refuses): never a reward, the job fails with the field named.
* `AgentError` — the policy's own doing (a tool request that fails for a reason it controls): a legitimate
  outcome, shown to the agent or scored.

`classify(exc)` is the only mapping from an exception to a `FailureKind` (the agent loop and the node
pipeline both use it); `FailureKind` lives here so that the trainer client, which imports no pydantic, can
use the taxonomy too. Anything outside the taxonomy — a bug, an OS error, a timeout — classifies as
`infra`: an exception is never a reward of 0. The next step: `crds/trajectory.py` (`Failure`: the record a failure leaves).
"""
from __future__ import annotations

from enum import Enum


class FailureKind(str, Enum):
    """What a rollout's failure was (`Failure.kind` of crds/trajectory.py)."""

    none = "none"
    agent = "agent"   # the policy's fault: bad format, turn or token limit; a legitimate reward
    infra = "infra"   # our fault: sandbox died, backend unreachable, INIT/EVAL crashed; never a reward
    config = "config"  # the job's configuration: the prompt exceeds the token budget or the model's
    #                    context, the backend refuses the request; never a reward, fails the job


class RolloutdError(Exception):
    """The root of every rolloutd exception. `kind`: the `FailureKind` a rollout that met it carries."""

    kind: FailureKind = FailureKind.infra


class InfraError(RolloutdError):
    """Our machinery failed, not the policy nor the job: retried or excluded, never a reward."""

    kind = FailureKind.infra


class ConfigurationError(RolloutdError):
    """The configuration cannot work (the message names the field at fault): never a reward, fails the job."""

    kind = FailureKind.config


class AgentError(RolloutdError):
    """The policy's own doing: a legitimate outcome (an observation, a scored failure)."""

    kind = FailureKind.agent


class StatusError(RolloutdError):
    """An error that carries an HTTP status (the API's, the client's, the node's calls to the controller): not a
    fourth family but a split between two by the status: 4xx but 429 is the caller's configuration, the rest
    (5xx, 429, no answer at all) our infrastructure. Subclasses set `code` or
    answer it from the server's `status`."""

    code: int | None = None

    @property
    def kind(self) -> FailureKind:  # type: ignore[override]
        code = self.code
        if isinstance(code, int) and 400 <= code < 500 and code != 429:
            return FailureKind.config
        return FailureKind.infra


def classify(exc: BaseException) -> FailureKind:
    """The `FailureKind` of a rollout that ended with `exc`: the taxonomy's family, `infra` for anything else."""
    if isinstance(exc, RolloutdError):
        return exc.kind
    return FailureKind.infra
