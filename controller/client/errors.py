"""Typed errors of the trainer client, one per Kubernetes `Status` code the controller answers.

Raised by both clients (`sync`, `aio`) from `status_error` (an HTTP error answer) or `unreachable`
(no answer at all); every one carries the server's Status so a caller can read `reason` and `causes`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only annotations: `rolloutctl get`'s fast path reads these errors without httpx
    import httpx

from rolloutd.crds import errors as taxonomy


class RolloutdError(taxonomy.StatusError):
    """A failure of a controller call (the client's root, beneath the product's `rolloutd.crds.errors`
    root of the same name: a 4xx is the caller's configuration, the rest infrastructure). `status` is the server's Kubernetes `Status` object
    (`{kind: Status, reason, message, code, details: {causes: [{field, reason, message}]}}`) or
    `{}` when the controller never answered (see `ConnectionFailed`)."""

    def __init__(self, message: str, status: dict[str, Any] | None = None):
        super().__init__(message)
        self.message = message
        self.status = status or {}

    @property
    def code(self) -> int | None:
        return self.status.get("code")

    @property
    def reason(self) -> str | None:
        return self.status.get("reason")

    @property
    def causes(self) -> list[dict[str, Any]]:
        return list((self.status.get("details") or {}).get("causes") or [])


class BadRequest(RolloutdError):
    """400: malformed body or parameters."""


class Unauthorized(RolloutdError):
    """401: missing or wrong token."""


class NotFound(RolloutdError):
    """404: no such job (or batch, or backend)."""


class Conflict(RolloutdError):
    """409: already exists, or a concurrent update won."""


class Gone(RolloutdError):
    """410: a watch resumed from a version the server no longer keeps."""


class Invalid(RolloutdError):
    """422: the job does not validate; `causes` name each field."""


class ConnectionFailed(RolloutdError):
    """The controller could not be reached (or a stream kept failing after retries)."""


class WaitTimeout(RolloutdError, TimeoutError):
    """A client-side wait ended before its condition held. `last` is the last state seen
    (the job object, or the `Batch` for `next_batch`)."""

    def __init__(self, message: str, last: Any = None):
        super().__init__(message)
        self.last = last


class JobEnded(RolloutdError):
    """`wait` for a condition on a job that ended (Failed/Cancelled/deleted) without it."""

    def __init__(self, message: str, job: dict[str, Any] | None = None):
        super().__init__(message)
        self.job = job


_BY_CODE: dict[int, type[RolloutdError]] = {400: BadRequest, 401: Unauthorized, 404: NotFound, 409: Conflict,
                                            410: Gone, 422: Invalid}


def status_error(r: httpx.Response) -> RolloutdError:
    """The typed error for a ≥400 response (its body read already)."""
    try:
        status = r.json()
    except ValueError:
        status = None
    if not isinstance(status, dict) or status.get("kind") != "Status":
        cls = _BY_CODE.get(r.status_code, RolloutdError)
        return cls(f"HTTP {r.status_code} from the controller: {r.text[:200]}",
                   {"code": r.status_code, "reason": r.reason_phrase, "message": r.text[:200]})
    status.setdefault("code", r.status_code)
    cls = _BY_CODE.get(int(status["code"]), RolloutdError)
    return cls(f"Error from server ({status.get('reason', r.status_code)}): {status.get('message', '')}", status)


def unreachable(server: str, e: Exception) -> ConnectionFailed:
    return ConnectionFailed(f"cannot reach the controller at {server}: {e} "
                            "(is `rolloutd controller` running? see server= / ROLLOUTD_SERVER)")
