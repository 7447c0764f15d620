"""Calling an agent's `POST /run`: the retry policy and the failure classes (docs/reference/failures.md).

A connection that was never established is always retried (bounded, exponential backoff with
jitter): the agent never saw the request. A request that was sent and then failed (read timeout,
reset, 502/504) is replayed only with `retry_requests`, up to the attempt limit. Every failed
attempt becomes a failure row; nothing here raises for an agent's fault. A 429 or 503 is no
failed attempt: the call ends with `CallOutcome.rate_limited` and the engine waits it out without
holding a slot (`workers/rollout/backpressure.py`).

Replies are bounded: the body is read in chunks and cut as soon as it passes `max_reply_bytes`
(decompressed), a body silent for `read_idle_timeout_s` fails as a timeout, and a redirect is
never followed (the client hands the 3xx back; it is an `agent_run_error` naming its `Location`).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import orjson
from pydantic import JsonValue

from infra import jsonl, telemetry
from infra.backoff import RATE_LIMIT_STATUSES, parse_retry_after
from infra.http import PostClient, StreamedReply, heartbeat
from infra.telemetry import ROLLOUT_ID, client_span
from schemas import fields as F
from schemas.messages import CallPolicy
from schemas.outcomes import RolloutFailureRecord
from schemas.records import FailureRow
from workers.rollout.backpressure import RateLimited
from workers.rollout.episodes import InvalidEpisodeReply, episode_body, episode_record
from workers.tracing import run_latency

GATEWAY_STATUSES = frozenset({429, 502, 503, 504})
BODY_LIMIT = 2000
# Bytes of a body decoded for a failure row: BODY_LIMIT characters of UTF-8, and one more.
ERROR_BODY_BYTES = 4 * BODY_LIMIT + 4
BACKOFF_CAP_S = 30.0


class AttemptFailed(Exception):
    """Raised inside this module for one failed attempt; it carries the failure row's fields."""

    def __init__(self, failure: FailureRow, *, sent: bool, replayable: bool) -> None:
        super().__init__(failure.failure_message)
        self.failure = failure
        self.sent = sent
        self.replayable = replayable


class RateLimitedReply(AttemptFailed):
    """Raised inside this module for a 429/503 reply; it carries its `Retry-After` in seconds."""

    def __init__(self, failure: FailureRow, retry_after_s: float | None) -> None:
        super().__init__(failure, sent=True, replayable=False)
        self.retry_after_s = retry_after_s


@dataclass
class CallOutcome:
    """What one rollout's calls produced: a result or a final failure, plus earlier failed attempts."""

    result: dict[str, Any] | None = None
    final_failure: dict[str, Any] | None = None
    failures: list[dict[str, Any]] = field(default_factory=list)
    requests_sent: int = 0
    rate_limited: RateLimited | None = None
    """Set when the last reply was a 429/503: the engine waits and calls again (no final failure)."""


def truncate_body(text: str | None) -> str | None:
    if text is None or text == "":
        return None
    return text if len(text) <= BODY_LIMIT else text[: BODY_LIMIT - 1] + "…"


def _message(exc: BaseException) -> str:
    return str(exc) or repr(exc)


def classify_exception(exc: BaseException) -> AttemptFailed:
    """The failure row of a transport error, and whether the request had been sent."""
    name = type(exc).__name__
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        kind, sent = "transport_unreachable", False
    elif isinstance(exc, httpx.PoolTimeout):
        kind, sent = "transport_local_resource", False
    elif isinstance(exc, httpx.TimeoutException | TimeoutError):
        kind, sent = "transport_timeout", True
    else:
        kind, sent = "transport_peer_drop", True
    failure = FailureRow(
        _ng_failure_class="agent_request_failed",
        _ng_failure_type=name,
        _ng_failure_message=_message(exc),
        failure_kind=kind,
    )
    return AttemptFailed(failure, sent=sent, replayable=sent)


def _bad_reply(status: int, text: str, type_: str, message: str) -> FailureRow:
    """The failure row of an HTTP 2xx reply that is not a JSON object."""
    return FailureRow(
        _ng_failure_class="agent_request_failed",
        _ng_failure_type=type_,
        _ng_failure_message=message,
        _ng_failure_http_status=status,
        _ng_failure_response_body=truncate_body(text),
        failure_kind="agent_request_failed",
    )


def _body_text(content: bytes | bytearray) -> str:
    """Enough of a body, decoded, for the failure row's ≤ BODY_LIMIT characters."""
    return bytes(content[:ERROR_BODY_BYTES]).decode("utf-8", errors="replace")


def classify_reply(
    status: int, content: bytes | bytearray, headers: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The result object of a reply, or AttemptFailed for an HTTP error or a reply of the wrong shape.

    A 3xx names its `Location`: the client never follows a redirect.
    """
    if not 200 <= status < 300:
        gateway = status in GATEWAY_STATUSES
        message = f"/run returned HTTP {status}"
        if 300 <= status < 400:
            location = (headers or {}).get("location")
            where = f"redirect to {location}" if location else "redirect with no Location"
            message += f" {where}; redirects are not followed"
        failure = FailureRow(
            _ng_failure_class="agent_request_failed" if gateway else "agent_run_error",
            _ng_failure_type="HTTPStatusError",
            _ng_failure_message=message,
            _ng_failure_http_status=status,
            _ng_failure_response_body=truncate_body(_body_text(content)),
            failure_kind="agent_request_failed" if gateway else "agent_run_error",
        )
        if status in RATE_LIMIT_STATUSES:
            raise RateLimitedReply(failure, parse_retry_after((headers or {}).get("retry-after")))
        raise AttemptFailed(failure, sent=True, replayable=gateway)
    try:
        value = orjson.loads(content)
    except orjson.JSONDecodeError as exc:
        failure = _bad_reply(
            status, _body_text(content), "JSONDecodeError", f"/run reply is not JSON: {exc}"
        )
        raise AttemptFailed(failure, sent=True, replayable=False) from None
    if not isinstance(value, dict):
        failure = _bad_reply(
            status,
            _body_text(content),
            "InvalidResultShape",
            f"/run reply is a JSON {type(value).__name__}, not an object",
        )
        raise AttemptFailed(failure, sent=True, replayable=False)
    return value


async def read_body(reply: StreamedReply, policy: CallPolicy) -> bytes:
    """A reply's body, read chunk by chunk under the reply size limit and the read-idle timeout.

    A 2xx body past `max_reply_bytes` (decompressed) fails the attempt as soon as the limit is
    passed, holding no more than the limit; an error status's body is read only as far as its
    failure row keeps. A body that stays silent for `read_idle_timeout_s` fails as a timeout.
    The chunks are joined once at the end (a body that came in one chunk is not copied).
    """
    status = reply.status_code
    ok = 200 <= status < 300
    limit = policy.max_reply_bytes if ok else ERROR_BODY_BYTES
    parts: list[bytes] = []
    size = 0
    chunks = aiter(reply.aiter_bytes())
    while True:
        try:
            async with asyncio.timeout(policy.read_idle_timeout_s):
                chunk = await anext(chunks)
        except StopAsyncIteration:
            return _joined(parts)
        except TimeoutError:
            failure = FailureRow(
                _ng_failure_class="agent_request_failed",
                _ng_failure_type="ReadIdleTimeout",
                _ng_failure_message=(
                    f"/run reply sent nothing for {policy.read_idle_timeout_s:g}s after "
                    f"{size} bytes (read_idle_timeout_s)"
                ),
                _ng_failure_http_status=status,
                failure_kind="transport_timeout",
            )
            raise AttemptFailed(failure, sent=True, replayable=True) from None
        if size + len(chunk) > limit:
            if not ok:
                parts.append(chunk[: limit - size])
                return _joined(parts)
            failure = _bad_reply(
                status,
                _body_text(_joined(parts)),
                "ReplyTooLarge",
                f"/run reply is larger than max_reply_bytes={policy.max_reply_bytes} "
                f"(decompressed); it was cut off after {size + len(chunk)} bytes",
            )
            raise AttemptFailed(failure, sent=True, replayable=False)
        parts.append(chunk)
        size += len(chunk)


def _joined(parts: list[bytes]) -> bytes:
    return parts[0] if len(parts) == 1 else b"".join(parts)


def backoff_s(policy: CallPolicy, retry: int) -> float:
    """Full-jitter exponential backoff."""
    return random.uniform(0, min(BACKOFF_CAP_S, policy.backoff_base_s * (2**retry)))


def identity_of(row: dict[str, Any]) -> dict[str, Any]:
    """The identity every record of the row carries (a task row's: its `_ng_task_id` too)."""
    identity = {k: row[k] for k in F.IDENTITY_FIELDS if k in row}
    if F.is_task_row(row):
        identity[F.NG_TASK_ID] = row[F.TASK_ID]
    return identity


def failure_row(row: dict[str, Any], failure: FailureRow) -> dict[str, JsonValue]:
    """The planned row's identity plus the failure fields."""
    return {**identity_of(row), **failure.fields()}


def stamp_failure_records(
    failures: list[dict[str, Any]], run_id: str, agent_row: dict[str, Any] | None = None
) -> None:
    """Give each failure row NeMo Gym's canonical `_ng_failure_record` (and the reply's body, if
    any, as the bounded `_ng_failure_response`). `agent_row`: the agent's own failure row among
    them (a reply of HTTP 200 that names a failure class), which its environment observed."""
    for row in failures:
        source: Literal["environment", "collector"] = (
            "environment" if row is agent_row else "collector"
        )
        fallback = f"{row.get(F.TASK_INDEX)}-{row.get(F.ROLLOUT_INDEX)}"
        record = RolloutFailureRecord.from_failure_row(row, run_id or "unknown", fallback, source)
        row[F.FAILURE_RECORD] = record.canonical()
        body = row.get(F.FAILURE_RESPONSE_BODY)
        if isinstance(body, str) and body and row is not agent_row:
            row[F.FAILURE_RESPONSE] = body[:BODY_LIMIT]


def with_attempt(row: dict[str, Any], attempt: int) -> dict[str, Any]:
    if attempt > 0:
        return {**row, F.ATTEMPT_INDEX: attempt}
    if F.ATTEMPT_INDEX in row:
        return {k: v for k, v in row.items() if k != F.ATTEMPT_INDEX}
    return row


async def _post(
    client: PostClient, url: str, body: bytes, policy: CallPolicy, row: dict[str, Any]
) -> dict[str, Any]:
    """One `/run` attempt: an HTTP client span when this process traces the rollout, whose
    `traceparent` the request carries (`workers/tracing.py`); the failure class on the span
    when it fails. Without the SDK the request carries the `traceparent` the rollout was
    delivered with; an untraced rollout's carries none."""
    if telemetry.tracer() is None or telemetry.current_parent() is None:
        headers = _json_headers()
        telemetry.inject(headers)
        return await _attempt(client, url, body, policy, headers)
    rollout = F.rollout_id(row)
    with client_span("POST", url, {ROLLOUT_ID: rollout} if rollout else None) as span:
        started = time.monotonic()
        try:
            result = await _attempt(client, url, body, policy, span.headers(_json_headers()))
        except AttemptFailed as failed:
            f = failed.failure
            span.set("rollouts.failure_class", f.failure_class)
            span.set("rollouts.failure_kind", f.failure_kind)
            span.set("error.type", f.failure_type)
            if f.http_status is not None:
                span.status(f.http_status)
            run_latency(time.monotonic() - started, f.http_status)
            raise
        span.status(200)
        run_latency(time.monotonic() - started, 200)
        return result


def _json_headers() -> dict[str, str]:
    return {"content-type": "application/json"}


@contextlib.asynccontextmanager
async def _streamed(
    client: PostClient, url: str, body: bytes, headers: dict[str, str], heartbeat_s: float | None
) -> AsyncIterator[StreamedReply]:
    """The reply of a POST whose connection carries a heartbeat until the reply begins
    (`infra/http.py`), when `heartbeat_s` is set."""
    with heartbeat(heartbeat_s):
        async with client.stream("POST", url, content=body, headers=headers) as reply:
            yield reply


async def _attempt(
    client: PostClient, url: str, body: bytes, policy: CallPolicy, request_headers: dict[str, str]
) -> dict[str, Any]:
    try:
        async with (
            asyncio.timeout(policy.timeout_s),
            _streamed(client, url, body, request_headers, policy.heartbeat_s) as reply,
        ):
            status, headers = reply.status_code, reply.headers
            content = await read_body(reply, policy)
    except TimeoutError as exc:
        failure = FailureRow(
            _ng_failure_class="agent_request_failed",
            _ng_failure_type="TimeoutError",
            _ng_failure_message=(
                f"/run did not finish within the rollout time limit of {policy.timeout_s:g}s"
            ),
            failure_kind="agent_timeout",
        )
        raise AttemptFailed(failure, sent=True, replayable=True) from exc
    except httpx.HTTPError as exc:
        raise classify_exception(exc) from exc
    return classify_reply(status, content, headers)


def invalid_episode(exc: InvalidEpisodeReply) -> AttemptFailed:
    """The failed attempt of an episode request answered with no episode response."""
    failure = _bad_reply(
        200,
        orjson.dumps(exc.reply)[:ERROR_BODY_BYTES].decode("utf-8", "replace"),
        "InvalidEpisodeReply",
        str(exc),
    )
    return AttemptFailed(failure, sent=True, replayable=False)


async def call_run(
    client: PostClient, agent_url: str, row: dict[str, Any], policy: CallPolicy
) -> CallOutcome:
    """Run one rollout: POST the planned row to `{agent_url}/run` under the policy (a task row:
    its episode request to its environment server's, `workers/rollout/episodes.py`)."""
    url = agent_url.rstrip("/") + "/run"
    attempt = int(row.get(F.ATTEMPT_INDEX) or 0)
    episode = F.is_task_row(row)
    outcome = CallOutcome()
    connect_retries = 0
    replays = 0
    while True:
        sent_row = with_attempt(row, attempt)
        # Held for the whole call (and its replays): in an allocation of its own length.
        body = jsonl.kept(episode_body(sent_row) if episode else orjson.dumps(sent_row))
        try:
            result = await _post(client, url, body, policy, sent_row)
            if episode:
                try:
                    result = episode_record(result, sent_row)
                except InvalidEpisodeReply as exc:
                    raise invalid_episode(exc) from None
        except AttemptFailed as failed:
            if not failed.sent:
                if connect_retries < policy.connect_retries:
                    await asyncio.sleep(backoff_s(policy, connect_retries))
                    connect_retries += 1
                    continue
                outcome.final_failure = failure_row(sent_row, failed.failure)
                return outcome
            outcome.requests_sent += 1
            row_out = failure_row(sent_row, failed.failure)
            if isinstance(failed, RateLimitedReply):
                status = failed.failure.http_status or 429
                outcome.rate_limited = RateLimited(status, failed.retry_after_s, row_out, attempt)
                return outcome
            if failed.replayable and policy.retry_requests and attempt + 1 < policy.max_attempts:
                outcome.failures.append(row_out)
                await asyncio.sleep(backoff_s(policy, replays))
                replays += 1
                attempt += 1
                continue
            outcome.final_failure = row_out
            return outcome
        outcome.requests_sent += 1
        outcome.result = stamp_identity(result, sent_row)
        return outcome


def stamp_identity(result: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """The agent's result with the identity fields taken from the planned row, not from the echo."""
    stamped = dict(result)
    for key in F.IDENTITY_FIELDS:
        if key in row:
            stamped[key] = row[key]
        else:
            stamped.pop(key, None)
    return stamped
