"""The member of an admission slot lease (`keys.shard_leases`, `keys.agent_leases`):
`<holder>:<seq>|<agent>|<task>:<rollout>`.

Admission makes it (`workers/rollout/admission.py`); `rollouts status` counts the slots held per
agent from it (`producer/shard/live.py`). The rollout lease's member of `keys.ROLLOUT_LEASES`,
`<sid>|<task>:<rollout>`, is another layout: `workers/shard/leases.py` owns it.
"""

from __future__ import annotations

SEPARATOR = "|"


def slot_member(holder: str, seq: int, agent: str, key: str) -> str:
    """The member of attempt `seq` of process `holder` (`host:pid`) for rollout `key` of `agent`."""
    return f"{holder}:{seq}{SEPARATOR}{agent}{SEPARATOR}{key}"


def slot_agent(member: str) -> str:
    """The agent a slot member names ("" for a member without one)."""
    parts = member.split(SEPARATOR)
    return parts[1] if len(parts) > 1 else ""


def slot_holder(member: str) -> str:
    """The process (`host:pid`) holding a slot."""
    return member.split(SEPARATOR, 1)[0].rsplit(":", 1)[0]
