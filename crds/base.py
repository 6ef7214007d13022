"""Shared pydantic base for every resource model: camelCase on the wire, snake_case in Python,
unknown fields rejected. Used by `rolloutjob.py` and `trajectory.py`."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class Model(BaseModel):
    """Base of all wire models. `model_dump(by_alias=True)` gives the YAML/JSON form."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
    )

    def wire(self, **kw) -> dict:
        """The JSON-able camelCase form (what the API returns and YAML shows)."""
        return self.model_dump(mode="json", by_alias=True, **kw)
