"""Reading a record's `ng_trajectory`: observation flags, normalised model calls, call bindings.

The trajectory is validated as NeMo Gym's `TrajectoryRecord` (`schemas/trajectory.py`: unknown
keys, bounds, literals, required timestamps, unique ids), so that what NeMo Gym's health check
cannot read is `record_unreadable` here too, never half-read. Bindings join the references on turns (and, for
"owned" calls, on invocations) to the captured calls: a reference that matches no call is
missing, one that matches several is duplicated, and a binding is complete when it has at least
one reference and neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict

from pydantic import ValidationError

from schemas.trajectory import TrajectoryRecord

INCOMPLETE_CALL_GAPS = frozenset(
    {
        "model_calls_unavailable",
        "model_call_capture_incomplete",
        "model_call_capture_records_unreadable",
        "model_call_capture_unreadable",
    }
)
CONTRADICTION_GAPS = {
    "model_call_reference_unmatched": "missing_captured_call",
    "model_call_reference_ambiguous": "duplicated_captured_call",
    "model_call_reference_conflict": "conflicting_call_ownership",
}
TOOL_CALL_TYPES = frozenset(
    {
        "function_call", "tool_call", "tool_use", "mcp_call", "mcp_list_tools",
        "mcp_approval_request", "file_search_call", "web_search_call", "computer_call",
        "image_generation_call", "code_interpreter_call", "local_shell_call", "custom_tool_call",
    }
)  # fmt: skip
CONTENT_KEYS = (
    "text", "content", "output_text", "answer", "refusal", "encrypted_content",
    "reasoning", "reasoning_content", "summary",
)  # fmt: skip


class TrajectoryInvalid(Exception):
    """Raised when `ng_trajectory` is present but not a readable trajectory."""


def nonempty(value: Any) -> bool:
    """Whether `value` holds any non-blank text, looking through lists and content-like keys."""
    if isinstance(value, str):
        return bool(value.strip())
    if isinstance(value, list | tuple):
        return any(nonempty(v) for v in value)
    if isinstance(value, dict):
        return any(nonempty(value.get(k)) for k in CONTENT_KEYS)
    return False


def has_tool_call(item: Any) -> bool:
    if isinstance(item, list | tuple):
        return any(has_tool_call(v) for v in item)
    if not isinstance(item, dict):
        return False
    return item.get("type") in TOOL_CALL_TYPES or bool(item.get("tool_calls"))


def response_has_content(response: Any) -> bool:
    """Whether a model call's raw response carries any output at all."""
    if not isinstance(response, dict):
        return False
    if nonempty(response.get("output_text")) or nonempty(response.get("content")):
        return True
    if nonempty(response.get("output")):
        return True
    return any(
        nonempty(c.get("text")) or nonempty((c.get("message") or {}).get("content"))
        for c in response.get("choices") or []
        if isinstance(c, dict)
    )


class ServerRef(TypedDict):
    """A `ModelServerRef` as NeMo Gym reads it: its type and name, whatever the record holds."""

    type: object
    name: object


@dataclass(frozen=True, slots=True)
class Call:
    """One captured model call, normalised."""

    position: int
    call_index: int
    model_call_id: str | None
    response_id: str | None
    model_ref: ServerRef | None
    status_code: Any
    response_status: Any
    finish_reason: Any
    error_category: Any
    tokens_in: Any
    tokens_out: Any
    response: Any
    started_at: Any

    @property
    def failed(self) -> bool:
        s = self.status_code
        return (
            (isinstance(s, int) and not isinstance(s, bool) and s >= 400)
            or bool(self.error_category)
            or self.response_status in ("failed", "error", "cancelled")
        )

    @property
    def successful(self) -> bool:
        s = self.status_code
        return not self.failed and (s is None or (isinstance(s, int) and 200 <= s < 400))

    def locator(self, fallback: int) -> dict[str, str]:
        return {"call_id": str(self.model_call_id or self.response_id or fallback)}

    @property
    def identity(self) -> str | None:
        if self.model_call_id:
            return f"call:{self.model_call_id}"
        ref = self.model_ref
        if isinstance(ref, dict) and self.response_id:
            return f"response:{ref.get('type')}:{ref.get('name')}:{self.response_id}"
        return f"response::{self.response_id}" if self.response_id else None


def _server_ref(value: Any) -> ServerRef | None:
    """A `ModelServerRef` as NeMo Gym reads it: its extra keys are ignored."""
    if not isinstance(value, dict):
        return None
    return {"type": value.get("type"), "name": value.get("name")}


def _call(position: int, raw: dict[str, Any]) -> Call:
    meta = raw.get("response_metadata") or {}
    tokens = raw.get("token_stats") or {}
    return Call(
        position=position,
        call_index=position,
        model_call_id=raw.get("model_call_id") or None,
        response_id=meta.get("response_id") or None,
        model_ref=_server_ref(meta.get("model_ref")),
        status_code=meta.get("status_code"),
        response_status=meta.get("response_status"),
        finish_reason=meta.get("finish_reason"),
        error_category=meta.get("error_category"),
        tokens_in=tokens.get("prompt_tokens"),
        tokens_out=tokens.get("completion_tokens"),
        response=raw.get("response"),
        started_at=raw.get("started_at"),
    )


def _response_key(call: Call) -> tuple[str, str, str] | None:
    ref = call.model_ref
    if ref is None or not call.response_id:
        return None
    return str(ref.get("type")), str(ref.get("name")), call.response_id


def ref_key(ref: dict[str, Any]) -> str:
    if ref.get("model_call_id"):
        return f"call:{ref['model_call_id']}"
    model_ref = ref["model_ref"]
    return f"response:{model_ref.get('type')}:{model_ref.get('name')}:{ref['response_id']}"


def _ref_signature(ref: dict[str, Any]) -> tuple[str, str, str, str]:
    found = ref.get("model_ref")
    model_ref: dict[str, Any] = found if isinstance(found, dict) else {}
    return (
        str(ref.get("model_call_id") or ""),
        str(model_ref.get("type") or ""),
        str(model_ref.get("name") or ""),
        str(ref.get("response_id") or ""),
    )


@dataclass(frozen=True, slots=True)
class Binding:
    """References of one view joined to the captured calls."""

    references: tuple[str, ...]
    matched: tuple[Call, ...]
    missing: tuple[str, ...]
    duplicated: tuple[tuple[str, int], ...]

    @property
    def complete(self) -> bool:
        return bool(self.references) and not self.missing and not self.duplicated


class Trajectory:
    """A validated `ng_trajectory` with the views the checks read."""

    def __init__(self, raw: Any) -> None:
        if not isinstance(raw, dict):
            raise TrajectoryInvalid("ng_trajectory is not an object")
        try:
            TrajectoryRecord.model_validate(raw)
        except ValidationError as exc:
            raise TrajectoryInvalid(str(exc)) from exc
        self.turns: list[dict[str, Any]] = raw.get("turns") or []
        self.invocations: list[dict[str, Any]] = raw.get("invocations") or []
        self.gaps: list[dict[str, Any]] = raw.get("gaps") or []
        self.gap_codes = frozenset(g["code"] for g in self.gaps)
        raw_calls: list[dict[str, Any]] = raw.get("model_calls") or []
        self.calls = [_call(i, c) for i, c in enumerate(raw_calls)]
        self.rollout_id = raw.get("rollout_id")
        turn_refs = self._refs(self.turns)
        owned_refs = self._dedupe([*turn_refs, *self._refs(self.invocations)])
        self.bound = self._bind(self._dedupe(turn_refs))
        self.owned = self._bind(owned_refs)

    @property
    def observed(self) -> bool:
        return "trajectory_projection_failed" not in self.gap_codes

    @property
    def turns_observed(self) -> bool:
        return self.observed and "turns_unavailable" not in self.gap_codes

    @property
    def turn_scope_complete(self) -> bool:
        return "turn_model_call_scope_incomplete" not in self.gap_codes

    @property
    def calls_observed(self) -> bool:
        return self.observed and not (self.gap_codes & INCOMPLETE_CALL_GAPS)

    def contradictions(self) -> list[dict[str, Any]]:
        return [g for g in self.gaps if g["code"] in CONTRADICTION_GAPS]

    @staticmethod
    def _refs(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [ref for item in items for ref in item.get("model_calls") or []]

    @staticmethod
    def _dedupe(refs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        seen: set[tuple[str, str, str, str]] = set()
        out = []
        for ref in refs:
            sig = _ref_signature(ref)
            if sig not in seen:
                seen.add(sig)
                out.append(ref)
        return out

    def _matches(self, ref: dict[str, Any]) -> list[Call]:
        if ref.get("model_call_id"):
            want_ref, want_resp = _server_ref(ref.get("model_ref")), ref.get("response_id")
            return [
                c
                for c in self.calls
                if c.model_call_id == ref["model_call_id"]
                and (want_ref is None or want_ref == c.model_ref)
                and (want_resp is None or want_resp == c.response_id)
            ]
        model_ref = ref["model_ref"]
        key = (str(model_ref.get("type")), str(model_ref.get("name")), str(ref["response_id"]))
        return [c for c in self.calls if _response_key(c) == key]

    def _bind(self, refs: list[dict[str, Any]]) -> Binding:
        matched: dict[int, Call] = {}
        missing: list[str] = []
        duplicated: list[tuple[str, int]] = []
        for ref in refs:
            found = self._matches(ref)
            if not found:
                missing.append(ref_key(ref))
            elif len(found) > 1:
                duplicated.append((ref_key(ref), len(found)))
            else:
                matched.setdefault(found[0].position, found[0])
        return Binding(
            references=tuple(ref_key(r) for r in refs),
            matched=tuple(matched[p] for p in sorted(matched)),
            missing=tuple(missing),
            duplicated=tuple(duplicated),
        )
