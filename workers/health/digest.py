"""A record's digest: what the combine step needs of it, small enough to spool millions of.

A digest is written as one compact JSON array (no check names, flags as bits) so that a run's
digests cost tens of bytes each on scratch storage and nothing in memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from schemas.health import ALL_CHECKS

Finding = tuple[str, dict[str, Any] | None, dict[str, Any]]
CHECK_NUMBER = {check: i for i, check in enumerate(ALL_CHECKS)}

_CAPTURE, _POLICY, _ENDED, _SCORED, _UNREADABLE = 1, 2, 4, 8, 16
POSITIONAL = 32
"""Flag of a record keyed by its place in the input (no task index of its own)."""


@dataclass(slots=True)
class Digest:
    """One physical record, judged on its own."""

    task: Any
    """`_ng_task_index` as found (None when absent: the global ordinal stands in)."""
    rollout: Any
    """`_ng_rollout_index` (0 when absent)."""
    stage: Any
    """`stage_index`, when the record has one."""
    rollout_id: str | None = None
    """An explicit id (`_ng_rollout_id` or the trajectory's); None means `<task>-<rollout>`."""
    unreadable: bool = False
    """The line is not a JSON object."""
    positional: bool = False
    """Keyed by its ordinal or line number: no rollout of the inventory is its own."""
    unobserved: int = 0
    """Bit mask of the rollout checks left unobserved."""
    findings: list[Finding] = field(default_factory=list)
    """(check, locator, detail) in registry order."""
    scored: bool = False
    """The record carries a numeric reward."""
    capture_observed: bool = False
    policy_calls_observed: bool = False
    model_calls: int = 0
    successful_model_calls: int = 0
    model_call_errors: int = 0
    errors_by_status: dict[str, int] = field(default_factory=dict)
    ended_on_error: bool = False
    duplicated_calls: int = 0
    transcript_prompt: int = 0
    transcript_completion: int = 0
    capture_prompt: int = 0
    capture_completion: int = 0
    selected: list[str] | None = None
    """Call ids of the model calls judged for faults; None when no call was (none captured, or
    the population unknown)."""
    faulted: list[str] | None = None
    """Call ids of the selected calls with a fault (cut or empty)."""

    def payload(self) -> list[Any]:
        flags = (
            (_CAPTURE if self.capture_observed else 0)
            | (_POLICY if self.policy_calls_observed else 0)
            | (_ENDED if self.ended_on_error else 0)
            | (_SCORED if self.scored else 0)
            | (_UNREADABLE if self.unreadable else 0)
            | (POSITIONAL if self.positional else 0)
        )
        return [
            self.rollout_id,
            self.unobserved,
            [[CHECK_NUMBER[c], loc, det] for c, loc, det in self.findings],
            flags,
            self.model_calls,
            self.successful_model_calls,
            self.model_call_errors,
            self.errors_by_status or None,
            self.duplicated_calls,
            self.transcript_prompt,
            self.transcript_completion,
            self.capture_prompt,
            self.capture_completion,
            self.selected,
            self.faulted,
        ]

    @classmethod
    def from_payload(cls, task: Any, rollout: Any, stage: Any, p: list[Any]) -> Digest:
        flags = p[3]
        return cls(
            task=task,
            rollout=rollout,
            stage=stage,
            rollout_id=p[0],
            unreadable=bool(flags & _UNREADABLE),
            positional=bool(flags & POSITIONAL),
            unobserved=p[1],
            findings=[(ALL_CHECKS[n], loc, det) for n, loc, det in p[2]],
            scored=bool(flags & _SCORED),
            capture_observed=bool(flags & _CAPTURE),
            policy_calls_observed=bool(flags & _POLICY),
            model_calls=p[4],
            successful_model_calls=p[5],
            model_call_errors=p[6],
            errors_by_status=p[7] or {},
            ended_on_error=bool(flags & _ENDED),
            duplicated_calls=p[8],
            transcript_prompt=p[9],
            transcript_completion=p[10],
            capture_prompt=p[11],
            capture_completion=p[12],
            selected=p[13],
            faulted=p[14],
        )
