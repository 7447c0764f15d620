"""What every JSON document of a shard begins with: its layout version and the shard it is of."""

from __future__ import annotations

from pydantic import BaseModel


class ShardDocument(BaseModel):
    """The first fields of a shard's manifest and coverage record, in this order."""

    schema_version: int = 1
    """Layout version of this record."""
    run_id: str
    """The run's id."""
    shard: str
    """The shard label."""
