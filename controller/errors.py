"""Typed API errors and their Kubernetes-style `Status` bodies.

Raised by the store and the API handlers; `api.py` turns each into
`{kind: Status, status: Failure, reason, message, code, details: {causes: [{field, reason, message}]}}`.
Bad input is always a 4xx that names the field; never a 500.
"""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from rolloutd.crds.errors import StatusError


class ApiError(StatusError):
    code = 500
    reason = "InternalError"
    headers: dict[str, str] = {}  # sent with the error's response (`middleware.error_response`)

    def __init__(self, message: str, *, causes: list[dict[str, str]] | None = None, name: str | None = None):
        super().__init__(message)
        self.message = message
        self.causes = causes or []
        self.name = name

    def status(self) -> dict[str, Any]:
        details: dict[str, Any] = {"kind": "rolloutjobs"}
        if self.name:
            details["name"] = self.name
        if self.causes:
            details["causes"] = self.causes
        return {
            "apiVersion": "v1",
            "kind": "Status",
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
            "details": details,
        }


class BadRequest(ApiError):
    code, reason = 400, "BadRequest"


class Unauthorized(ApiError):
    code, reason = 401, "Unauthorized"


class Forbidden(ApiError):
    code, reason = 403, "Forbidden"


class NotFound(ApiError):
    code, reason = 404, "NotFound"


class AlreadyExists(ApiError):
    code, reason = 409, "AlreadyExists"


class Conflict(ApiError):
    code, reason = 409, "Conflict"


class Gone(ApiError):
    code, reason = 410, "Expired"


class TooLarge(ApiError):
    code, reason = 413, "RequestEntityTooLarge"


class UnsupportedMediaType(ApiError):
    code, reason = 415, "UnsupportedMediaType"


class Invalid(ApiError):
    code, reason = 422, "Invalid"


class TooManyRequests(ApiError):
    code, reason = 429, "TooManyRequests"


class ServiceUnavailable(ApiError):
    """Not the request's fault and not a bug, and answered with `Retry-After`: the store's disk is full or
    read-only or its file is gone, or the controller is stopping (a restart: the same call succeeds once it is back)."""
    code, reason = 503, "ServiceUnavailable"


_REASONS = {
    "extra_forbidden": "FieldValueUnknown",
    "missing": "FieldValueRequired",
}


def _field(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def _known_fields(model: type | None, loc: tuple[Any, ...]) -> list[str]:
    """The camelCase field names allowed where an unknown field was found (for a helpful message)."""
    for part in loc[:-1]:
        if model is None or not hasattr(model, "model_fields"):
            return []
        if isinstance(part, int):
            continue
        field = next((f for n, f in model.model_fields.items() if (f.alias or n) == part or n == part), None)
        if field is None:
            return []
        ann = field.annotation
        model = next((a for a in (getattr(ann, "__args__", None) or (ann,)) if hasattr(a, "model_fields")), None)
    if model is None or not hasattr(model, "model_fields"):
        return []
    return [f.alias or n for n, f in model.model_fields.items()]


def from_validation_error(err: ValidationError, *, prefix: tuple[str, ...] = (), name: str | None = None,
                          root: type | None = None) -> Invalid:
    causes = []
    for e in err.errors():
        loc = prefix + tuple(p for p in e["loc"] if p not in ("function-after",))
        field = _field(loc)
        if e["type"] == "extra_forbidden":
            known = _known_fields(root, tuple(e["loc"]))
            message = "unknown field" + (f" (known fields here: {', '.join(known)})" if known else "")
        else:
            message = e["msg"].removeprefix("Value error, ")
        causes.append({"field": field, "reason": _REASONS.get(e["type"], "FieldValueInvalid"), "message": message})
    summary = "; ".join(f"{c['field'] or '<root>'}: {c['message']}" for c in causes)
    what = "RolloutJob" if root is None or root.__name__.startswith("RolloutJob") else root.__name__
    return Invalid(f"{what} is invalid: {summary}", causes=causes, name=name)
