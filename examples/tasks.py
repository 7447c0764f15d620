"""Built-in task sets and a deterministic stand-in model whose accuracy differs by task.

Two families: `arithmetic` (addition is easy, multiplication of larger numbers is hard) and
`counting` (count a letter in a word; longer words are harder). The model's answer for a
rollout is a pure function of the question and the rollout index, so runs are reproducible and
repeats of one task disagree as a real sampled model's would.
"""

from __future__ import annotations

import hashlib
import random
import time
from typing import Any

WORDS = [
    "strawberry", "banana", "mississippi", "bookkeeper", "committee", "parallel",
    "assessment", "occurrence", "necessary", "embarrass", "millennium", "accommodate",
    "rhythm", "successful", "possession", "tomorrow", "address", "balloon",
]  # fmt: skip


def _unit(*parts: object) -> float:
    """A number in [0, 1) determined by `parts`."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def arithmetic_task(i: int) -> dict[str, Any]:
    rng = random.Random(i)
    op = "+" if i % 3 else "*"
    digits = 1 + (i % 4)
    a, b = rng.randint(10 ** (digits - 1), 10**digits - 1), rng.randint(2, 10**digits - 1)
    answer = a + b if op == "+" else a * b
    return {
        "task_id": f"arith-{i:04d}",
        "question": f"What is {a} {op} {b}?",
        "expected_answer": str(answer),
        "difficulty": round(min(0.9, (0.15 if op == "+" else 0.35) + 0.12 * (digits - 1)), 2),
    }


def counting_task(i: int) -> dict[str, Any]:
    word = WORDS[i % len(WORDS)]
    letter = sorted(set(word))[(i // len(WORDS)) % len(set(word))]
    return {
        "task_id": f"count-{i:04d}",
        "question": f"How many times does the letter '{letter}' appear in '{word}'?",
        "expected_answer": str(word.count(letter)),
        "difficulty": round(min(0.9, 0.05 * len(word)), 2),
    }


FAMILIES = {"arithmetic": arithmetic_task, "counting": counting_task}


def make_row(family: str, i: int, agent: str | None = None) -> dict[str, Any]:
    """A dataset row for task `i` of `family`."""
    task = FAMILIES[family](i)
    row: dict[str, Any] = {
        "responses_create_params": {
            "input": [{"role": "user", "content": task["question"]}],
            "temperature": 1.0,
        },
        "expected_answer": task["expected_answer"],
        "task_id": task["task_id"],
        "difficulty": task["difficulty"],
    }
    if agent is not None:
        row["agent_ref"] = {"name": agent}
    return row


def task_row(taskset: str, family: str, i: int, **task_input: Any) -> dict[str, Any]:
    """A materialized task row of `taskset`: task `i` of `family` as an environment server's
    episode input (NeMo Gym's `{"task_id": {"taskset", "task_id"}, "task_input": {...}}`)."""
    task = FAMILIES[family](i)
    return {
        "task_id": {"taskset": taskset, "task_id": task["task_id"]},
        "task_input": {
            "question": task["question"],
            "expected_answer": task["expected_answer"],
            "difficulty": task["difficulty"],
            **task_input,
        },
    }


def question_of(row: dict[str, Any]) -> str:
    params = row.get("responses_create_params") or {}
    messages = params.get("input")
    if isinstance(messages, str):
        return messages
    if isinstance(messages, list):
        for m in reversed(messages):
            if isinstance(m, dict) and m.get("role") == "user":
                content = m.get("content")
                return content if isinstance(content, str) else str(content)
    return ""


def stand_in_answer(
    row: dict[str, Any], sample_seed: int = 0, wrong_rate: float = 0.0
) -> tuple[str, int]:
    """The model's answer to the row and how many tokens it 'generated'.

    `sample_seed` other than 0 draws other samples of the same model (same accuracy, other
    rollouts right); `wrong_rate` turns that fraction of its right answers wrong (an accuracy
    lower by a known factor: `1 - wrong_rate`).
    """
    question = question_of(row)
    expected = str(row.get("expected_answer", ""))
    difficulty = float(row.get("difficulty", 0.3))
    rollout = row.get("_ng_rollout_index", 0)
    u = _unit(question, rollout) if sample_seed == 0 else _unit(question, rollout, sample_seed)
    spoiled = wrong_rate > 0 and _unit(question, rollout, sample_seed, "wrong") < wrong_rate
    if u >= difficulty and expected and not spoiled:
        answer = expected
    else:
        try:
            answer = str(int(expected) + (1 if _unit(question, rollout, "off") < 0.5 else -1))
        except ValueError:
            answer = "I am not sure."
    return answer, 5 + int(20 * _unit(question, rollout, "len"))


def stand_in_response(
    rid: str,
    answer: str,
    tokens: tuple[int, int],
    model: str = "stand-in-1",
    before: list[dict[str, Any]] | None = None,
    details: bool = False,
) -> dict[str, Any]:
    """A completed Responses API object whose one message says `answer`, after the output items
    `before`; `tokens` is (input, output); `details` adds the usage details a model server
    reports (cached and reasoning tokens, both 0)."""
    in_tokens, out_tokens = tokens
    usage: dict[str, Any] = {"input_tokens": in_tokens, "output_tokens": out_tokens}
    if details:
        usage["input_tokens_details"] = {"cached_tokens": 0}
        usage["output_tokens_details"] = {"reasoning_tokens": 0}
    usage["total_tokens"] = in_tokens + out_tokens
    message = {
        "type": "message",
        "id": f"msg_{rid}",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": answer, "annotations": []}],
    }
    return {
        "id": f"resp_{rid}",
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "status": "completed",
        "output": [*(before or []), message],
        "usage": usage,
    }
