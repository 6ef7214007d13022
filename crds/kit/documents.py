"""YAML/JSON documents from text, with errors that name the line: once for the API's body parser
(`http.bodies`), `rolloutctl apply` and the trainer client (`rolloutd.client.calls.load_job`).

Import-light (no rolloutd import; PyYAML imported when YAML is parsed): the trainer client uses it.
"""
from __future__ import annotations

import json
from typing import Any


def malformed_yaml(e: Exception, what: str = "YAML") -> str:
    """`malformed YAML at line L, column C: problem` for a PyYAML error (line and column when known)."""
    mark = getattr(e, "problem_mark", None)
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    return f"malformed {what}{at}: {getattr(e, 'problem', None) or e}"


def load_documents(text: str, where: str) -> list[Any]:
    """Every non-empty document in `text` (YAML, or JSON, which is tried first when it starts with `{`).
    ValueError naming `where` and the line for malformed text."""
    if text.lstrip()[:1] == "{":
        try:
            return [json.loads(text)]
        except json.JSONDecodeError:
            pass  # YAML flow mappings start with '{' too
        except (ValueError, RecursionError) as e:  # valid JSON Python cannot read (4300+ digits, deep nesting)
            raise ValueError(f"{where}: {unreadable(e)}") from None
    import yaml

    try:
        return [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
        raise ValueError(f"{where}: {malformed_yaml(e)}") from None
    except (ValueError, RecursionError) as e:  # an integer of 4300+ digits, a date such as 2026-02-30, deep nesting
        raise ValueError(f"{where}: {unreadable(e)}") from None


def unreadable(e: Exception) -> str:
    """Why JSON/YAML that parsed as text is no value Python holds (the one wording of every reader: the API's bodies,
    the gateway's, a dataset's rows, a Dockerfile's JSON form, a model's tool call): a RecursionError is nesting."""
    return "nests too deeply" if isinstance(e, RecursionError) else f"a value cannot be read: {str(e).split(';')[0]}"
