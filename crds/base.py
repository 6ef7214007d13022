"""Shared pydantic base for every resource model: camelCase on the wire, snake_case in Python,
unknown fields, non-finite floats (NaN, ±Infinity: JSON has none) and integers beyond int64 rejected. Used by every model
in this folder (`trajectory.py` lets its floats be non-finite: see there)."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator
from pydantic.alias_generators import to_camel


class Model(BaseModel):
    """Base of all wire models. `model_dump(by_alias=True)` gives the YAML/JSON form."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
        allow_inf_nan=False,
    )

    @field_validator("*", mode="after")
    @classmethod
    def _int64(cls, value: Any) -> Any:
        """Integers are stored in SQLite (int64) and compared there: a bigger one is refused here."""
        if type(value) is int and not -(1 << 63) <= value < (1 << 63):
            raise ValueError("integer out of range (the limit is ±2^63)")
        return value

    def wire(self, **kw) -> dict:
        """The JSON-able camelCase form (what the API returns and YAML shows)."""
        return self.model_dump(mode="json", by_alias=True, **kw)
