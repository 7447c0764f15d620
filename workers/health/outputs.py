"""Judging one raw model output, in any of the three dialects: is it usable, cut, a refusal?

The fault checks read a model's raw output (a captured call's `response`, or the record's own
final `response`): `responses` (an `output` list of items), `chat` (`choices[0].message`) and
`messages` (Anthropic `content` blocks). Only the output itself decides; token counts never do.
"""

from __future__ import annotations

from typing import Any

from workers.capture.records import as_dict, finish_reason, first_choice
from workers.health.trajectory import TOOL_CALL_TYPES

LENGTH_REASONS = frozenset({"max_output_tokens", "max_tokens", "length"})
REASONING_TYPES = frozenset({"reasoning", "thinking", "redacted_thinking"})


def _text_of_part(part: Any) -> str | None:
    if isinstance(part, str):
        return part
    if isinstance(part, dict):
        for key in ("text", "refusal"):
            value = part.get(key)
            if isinstance(value, str):
                return value
    return None


def is_refusal(raw: Any) -> bool:
    """Whether the output is a refusal (in any dialect)."""
    d = as_dict(raw)
    message = as_dict(first_choice(d).get("message"))
    if isinstance(message.get("refusal"), str) and message["refusal"].strip():
        return True
    output = d.get("output")
    return isinstance(output, list) and output_is_refusal(output)


def output_is_refusal(output: list[Any]) -> bool:
    """Whether a Responses API `output` list holds a refusal."""
    for item in output:
        if not isinstance(item, dict):
            continue
        if item.get("type") == "refusal" or (
            isinstance(item.get("refusal"), str) and item["refusal"].strip()
        ):
            return True
        content = item.get("content")
        if isinstance(content, list) and any(
            isinstance(p, dict) and p.get("type") == "refusal" for p in content
        ):
            return True
    return False


def output_unusable(output: list[Any]) -> str | None:
    """None when some item of a Responses API `output` is usable, else why not: empty,
    reasoning_only or malformed.

    Read from the end: the answer is the last item of a typical output, after any number of
    reasoning items (the verdict does not depend on the order)."""
    if not output:
        return "empty"
    kinds = set()
    for item in reversed(output):
        if not isinstance(item, dict):
            kinds.add("malformed")
            continue
        kind = item.get("type")
        if kind in TOOL_CALL_TYPES:
            return None
        if kind in REASONING_TYPES:
            kinds.add("reasoning")
            continue
        if kind in ("message", "text") or "content" in item or "text" in item:
            content = item.get("content", item.get("text"))
            if isinstance(content, str):
                parts: list[Any] = [content]
            elif isinstance(content, list):
                parts = content
            else:
                kinds.add("malformed")
                continue
            texts = [t for t in map(_text_of_part, parts) if t is not None]
            if any(t.strip() for t in texts):
                return None
            bad = any(not isinstance(p, dict | str) for p in parts)
            kinds.add("malformed" if bad else "blank")
            continue
        kinds.add("malformed")
    if kinds == {"reasoning"}:
        return "reasoning_only"
    return "malformed" if "malformed" in kinds else "empty"


def _chat_unusable(message: dict[str, Any]) -> str | None:
    if message.get("tool_calls"):
        return None
    content = message.get("content")
    parts = content if isinstance(content, list) else [content]
    texts = [t for t in map(_text_of_part, parts) if t is not None]
    refusal = message.get("refusal")
    if any(t.strip() for t in texts) or (isinstance(refusal, str) and refusal.strip()):
        return None
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str) and reasoning.strip():
        return "reasoning_only"
    return "empty" if content is None or isinstance(content, str | list) else "malformed"


def unusable(raw: Any) -> str | None:
    """None when a raw model output (any dialect) has usable output, else why not: `empty`,
    `reasoning_only` or `malformed` (not an object of a known dialect)."""
    if not isinstance(raw, dict):
        return "malformed"
    if isinstance(raw.get("output_text"), str) and raw["output_text"].strip():
        return None
    if isinstance(raw.get("choices"), list):
        choice = first_choice(raw)
        message = choice.get("message")
        if not isinstance(message, dict):
            text = choice.get("text")  # a completions-style choice
            if isinstance(text, str):
                return None if text.strip() else "empty"
            return "malformed"
        return _chat_unusable(message)
    output = raw.get("output")
    if isinstance(output, list):
        return output_unusable(output)
    content = raw.get("content")
    if isinstance(content, list):  # Anthropic messages: the same item rules as `output`
        return output_unusable(content)
    if "output_text" in raw:
        return "empty"
    return "malformed"


def cut_off(raw: Any, reason: str | None) -> bool:
    """Whether the output was cut by its length limit (`reason`, else its own finish reason),
    whatever came before the cut, unless it is a refusal."""
    reason = reason if reason is not None else finish_reason(raw)
    return reason in LENGTH_REASONS and not is_refusal(raw)
