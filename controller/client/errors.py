"""Typed errors of the trainer client, one per Kubernetes `Status` code the controller answers.

Raised by both clients (`sync`, `aio`) from `status_error` (an HTTP error answer) or `unreachable`
(no answer at all); every one carries the server's Status so a caller can read `reason` and `causes`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only annotations: `rolloutctl get`'s fast path reads these errors without httpx
    import httpx

from rolloutd.crds import errors as taxonomy


# The product's one root (`rolloutd.crds.errors`), under the name the client has always exported: `except
# RolloutdError` catches every error the client raises (each a `ClientError`), and any other of rolloutd's.
RolloutdError = taxonomy.RolloutdError


class ClientError(taxonomy.StatusError):
    """A failure of a controller call or of the client's configuration (the client's root, a `RolloutdError`: a
    4xx is the caller's configuration, the rest infrastructure). `status` is the server's Kubernetes `Status` object
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


class BadRequest(ClientError):
    """400: malformed body or parameters."""


class Unauthorized(ClientError):
    """401: missing or wrong token."""


class NotFound(ClientError):
    """404: no such job (or batch, or backend)."""


class Conflict(ClientError):
    """409: already exists, or a concurrent update won."""


class Gone(ClientError):
    """410: a watch resumed from a version the server no longer keeps."""


class Invalid(ClientError):
    """422: the job does not validate; `causes` name each field."""


class ConnectionFailed(ClientError):
    """The controller could not be reached (or a stream kept failing after retries)."""


class WaitTimeout(ClientError, TimeoutError):
    """A client-side wait ended before its condition held. `last` is the last state seen
    (the job object, or the `Batch` for `next_batch`)."""

    def __init__(self, message: str, last: Any = None):
        super().__init__(message)
        self.last = last


class JobEnded(ClientError):
    """`wait` for a condition on a job that ended (Failed/Cancelled/deleted) without it."""

    def __init__(self, message: str, job: dict[str, Any] | None = None):
        super().__init__(message)
        self.job = job


_BY_CODE: dict[int, type[ClientError]] = {400: BadRequest, 401: Unauthorized, 404: NotFound, 409: Conflict,
                                            410: Gone, 422: Invalid}


def status_error(r: httpx.Response) -> ClientError:
    """The typed error for a ≥400 response (its body read already)."""
    try:
        status = r.json()
    except ValueError:
        status = None
    if not isinstance(status, dict) or status.get("kind") != "Status":
        cls = _BY_CODE.get(r.status_code, ClientError)
        return cls(f"HTTP {r.status_code} from the controller: {r.text[:200]}",
                   {"code": r.status_code, "reason": r.reason_phrase, "message": r.text[:200]})
    status.setdefault("code", r.status_code)
    cls = _BY_CODE.get(int(status["code"]), ClientError)
    return cls(f"Error from server ({status.get('reason', r.status_code)}): {status.get('message', '')}", status)


def unreachable(server: str, e: Exception) -> ConnectionFailed:
    return ConnectionFailed(f"cannot reach the controller at {server}: {e} "
                            "(is `rolloutd controller` running? see server= / ROLLOUTD_SERVER)")
