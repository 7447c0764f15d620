"""The bases of the contract models that refuse unknown keys: a misspelt or stray key is an error."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A model that refuses unknown keys."""

    model_config = ConfigDict(extra="forbid")


class FrozenModel(StrictModel):
    """A model that refuses unknown keys and cannot be changed once built (so it hashes)."""

    model_config = ConfigDict(frozen=True)
