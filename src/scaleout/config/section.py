"""The base class of every config section, and the value types sections share."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

# The longest wait a timeout may ask for: a day. Longer is a typo (torch.distributed keeps
# timeouts in a C int of milliseconds, and nothing in a run should wait a day unnoticed).
MAX_TIMEOUT_S = 86_400.0
# The shortest: a second. Workers wait on each other through ordinary pauses (a garbage
# collection, a checkpoint, joining the group), and gloo counts in milliseconds, so a
# shorter timeout only ever stops a healthy run.
MIN_TIMEOUT_S = 1.0

TimeoutSeconds = Annotated[float, Field(ge=MIN_TIMEOUT_S, le=MAX_TIMEOUT_S)]


class Section(BaseModel):
    """A TOML table: unknown keys are errors, assignments are validated, and the object is
    what components receive (typed, validated once, never re-validated from a dict).
    Floats are finite: TOML's `inf` and `nan` are errors, never a learning rate."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
