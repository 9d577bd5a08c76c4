"""The base class of every config section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A TOML table: unknown keys are errors, assignments are validated, and the object is
    what components receive (typed, validated once, never re-validated from a dict)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
