"""The job's sampling parameters as the engine gets them, and the per-request seed derived from the job's own.

Built by the daemon from `spec.agent.sampling` (agents/daemon/jobconfig.py); the LLM client
(agents/vllm_backend.py) sends `request_fields()` with every generation request."""
from __future__ import annotations

import hashlib
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    """The job's sampling parameters. Every field that is set is sent to the engine; None = the
    engine's default. `seed` is the job's base seed (see `derive_seed`)."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int = 256
    min_tokens: int | None = None
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def request_fields(self) -> dict[str, Any]:
        """The /v1/completions fields for these parameters (unset optional fields left out)."""
        body = self.model_dump(exclude_none=True)
        for key in ("stop", "stop_token_ids"):
            if not body.get(key):
                body.pop(key, None)
        return body


def derive_seed(base: int | None, *parts: int | str) -> int | None:
    """A deterministic per-request seed from the job's base seed and (prompt, sample, turn):
    distinct samples of a group get distinct streams, a rerun of the job gets the same ones."""
    if base is None:
        return None
    digest = hashlib.sha256(":".join(map(str, (base, *parts))).encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF
