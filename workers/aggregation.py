"""Aggregate metrics per environment server (docs/explanation/contract.md#calling-the-servers): group, strip, POST, label, save.

Rows are grouped by their `_ng_environment_server` stamp (a row without one goes to the server
that fronts its agent), one `POST /aggregate_metrics` per server runs concurrently, and the
file holds one entry per server, sorted by server. A failed request keeps its entry with empty
collections and `aggregation_error`, and the first original exception is handed back so that a
caller that asks for it can re-raise it once the partial file is saved. A 429 or 503 is retried
up to `AGGREGATE_RATE_LIMIT_RETRIES` times, each after at least its `Retry-After` (capped at
`AGGREGATE_MAX_WAIT_S`), else a full-jitter backoff (`infra/backoff.py`).

Each server's rows are kept as their encoded bytes (stripped of the heavy fields), not as
dicts, a few MB in memory and the rest in sorted runs on local disk: the request body is
streamed from their merge (`ServerRows.chunks`) with a `Content-Length` counted as the rows were
added (`ServerRows.body_size`), and the answer (an entry per task) is streamed
to a local file and read a piece at a time (`workers/aggregate_file.py`), so memory does not
grow with the shard.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import os
import ssl
import threading
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from infra import scratch as scratch_dirs
from infra.backoff import RATE_LIMIT_STATUSES, next_wait_s, parse_retry_after
from infra.telemetry import client_span
from schemas import fields as F
from schemas.config import ServersConfig
from schemas.messages import CallPolicy
from schemas.records import AggregationError
from workers.aggregate_file import receive
from workers.health.spool import compact, tagged

AGGREGATE_TIMEOUT_S = 600.0
AGGREGATE_RATE_LIMIT_RETRIES = 5
AGGREGATE_MAX_WAIT_S = 60.0
_AGGREGATE_WAITS = CallPolicy(rate_limit_max_wait_s=AGGREGATE_MAX_WAIT_S)


SPILL_BYTES = 8 << 20
"""Encoded rows a server keeps in memory before it writes them to a sorted run on local disk."""
BODY_CHUNK = 1 << 20
"""Bytes of request body handed to the HTTP client at a time."""
BODY_HEAD = b'{"verify_responses":['
BODY_TAIL = b"]}"


@dataclass
class ServerRows:
    """The stripped, encoded rows of one environment server, and the agents seen in them (first first).

    Rows are buffered up to `SPILL_BYTES`, then written as a sorted run to a local scratch
    folder; the request body is streamed from a merge of the runs (`chunks`), so a shard of any
    size is sent in (task, rollout) order with a few MB in memory. `close` removes the runs.
    """

    rows: list[tuple[Any, bytes]] = field(default_factory=list)
    agents: list[str] = field(default_factory=list)
    count: int = 0
    row_bytes: int = 0
    """The encoded rows' bytes in all (what sizes the request body before it is sent)."""
    _bytes: int = 0
    _runs: list[str] = field(default_factory=list)
    _scratch: str | None = None

    def add(self, key: Any, data: bytes) -> None:
        self.rows.append((key, data))
        self.count += 1
        self.row_bytes += len(data)
        self._bytes += len(data) + 16
        if self._bytes >= SPILL_BYTES:
            self._spill()

    def _spill(self) -> None:
        if not self.rows:
            return
        if self._scratch is None:
            self._scratch = scratch_dirs.make("rollouts-aggregate-")
        self.rows.sort(key=lambda item: item[0])
        path = os.path.join(self._scratch, f"{len(self._runs):05d}.run")
        with open(path, "wb") as f:
            for key, data in self.rows:
                f.write(orjson.dumps(key) + b"\t" + data + b"\n")
        self._runs.append(path)
        self.rows = []
        self._bytes = 0

    def _sorted(self) -> Iterator[bytes]:
        """The rows' bytes in (task, rollout) order."""
        if not self._runs:
            self.rows.sort(key=lambda item: item[0])
            for _, data in self.rows:
                yield data
            return
        self._spill()
        readers = [_read_run(path) for path in self._runs]
        for _, data in heapq.merge(*readers, key=lambda item: item[0]):
            yield data

    @property
    def body_size(self) -> int:
        """The length of the body `chunks` gives, known before it is made: its `Content-Length`."""
        return len(BODY_HEAD) + self.row_bytes + max(self.count - 1, 0) + len(BODY_TAIL)

    def chunks(self) -> Iterator[bytes]:
        """`{"verify_responses": [...]}` with the rows in (task, rollout) order, a chunk at a time."""
        out = bytearray(BODY_HEAD)
        first = True
        for data in self._sorted():
            if not first:
                out += b","
            first = False
            out += data
            if len(out) >= BODY_CHUNK:
                yield bytes(out)
                out.clear()
        out += BODY_TAIL
        yield bytes(out)

    def body(self) -> bytes:
        """The whole request body at once (small groups, tests)."""
        return b"".join(self.chunks())

    def close(self) -> None:
        if self._scratch is not None:
            scratch_dirs.remove(self._scratch)
            self._scratch = None
            self._runs = []


def _read_run(path: str) -> Iterator[tuple[Any, bytes]]:
    with open(path, "rb") as f:
        for line in f:
            key, _, data = line.rstrip(b"\n").partition(b"\t")
            yield _untuple(orjson.loads(key)), data


def _untuple(key: Any) -> Any:
    """A key read back from JSON (lists) in the tuple form it was sorted in."""
    return tuple(_untuple(k) for k in key) if isinstance(key, list) else key


def strip_row(row: dict[str, Any]) -> dict[str, Any]:
    """What /aggregate_metrics receives: no request params, no response beyond usage and incomplete_details."""
    out = {k: v for k, v in row.items() if k not in F.AGGREGATE_STRIPPED and k != "response"}
    response = row.get("response")
    if isinstance(response, dict):
        kept = {k: response[k] for k in ("usage", "incomplete_details") if k in response}
        if kept:
            out["response"] = kept
    return out


def group_rows(rows: Iterable[dict[str, Any]], config: ServersConfig) -> dict[str, ServerRows]:
    groups: dict[str, ServerRows] = defaultdict(ServerRows)
    for row in rows:
        server = config.server_of(row)
        if server is None:
            continue
        group = groups[server]
        key = (tagged(row.get(F.TASK_INDEX, 0)), tagged(row.get(F.ROLLOUT_INDEX, 0)))
        group.add(key, compact(orjson.dumps(strip_row(row))))
        # A task row names no agent: the server's own binding (its agent_server) labels it.
        agent = F.agent_name(row) or config.attributed_agent(server)
        if agent is not None and agent not in group.agents:
            group.agents.append(agent)
    return dict(groups)


def label_servers(first_agent: dict[str, str | None]) -> dict[str, str]:
    """A label per server: its agent's name when no other server shares that agent, else the server name."""
    labels = {server: agent or server for server, agent in first_agent.items()}
    while True:
        seen: dict[str, list[str]] = defaultdict(list)
        for server, label in labels.items():
            seen[label].append(server)
        clashes = [servers for servers in seen.values() if len(servers) > 1]
        if not clashes:
            return labels
        for servers in clashes:
            for server in servers:
                labels[server] = server


EMPTY_COLLECTIONS: tuple[tuple[str, Any], ...] = (
    ("agent_metrics", {}),
    ("key_metrics", {}),
    ("group_level_metrics", []),
    ("repeat_level_metrics", []),
)
"""The collections of an aggregate entry (NeMo Gym's file), each empty when the server gave none."""


def empty_entry(label: str, server: str, error: str | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "agent_ref": {"name": label},
        F.ENVIRONMENT_SERVER: server,
        "agent_metrics": {},
        "key_metrics": {},
        "group_level_metrics": [],
        "repeat_level_metrics": [],
    }
    if error is not None:
        entry["aggregation_error"] = error
    return entry


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The verifying TLS context of the aggregate requests, made once per process (what httpx
    makes for each client by default, `SSL_CERT_FILE` and `SSL_CERT_DIR` honoured): loading the
    CA bundle again for every finish step cost it 30-50 ms of CPU before its first request."""
    return httpx.create_ssl_context()


class UnknownServerError(LookupError):
    """Raised when rows are stamped with an environment server the config does not name."""


async def _request(
    client: httpx.AsyncClient,
    url: str,
    server: str,
    rows: ServerRows,
    answer_path: str,
    sent: Callable[[], None],
) -> dict[str, Any]:
    """POST the rows (retrying a 429/503) and keep the answer at `answer_path` (`receive`);
    `sent()` once a body was sent whole."""
    for retry in range(AGGREGATE_RATE_LIMIT_RETRIES + 1):
        attrs = {"rollouts.environment_server": server}
        with client_span("POST", url, attrs) as span:  # the finish step's trace, if traced
            # Sized up front, so the body streams with a Content-Length: servers and proxies
            # that refuse chunked request bodies (HTTP 411) exist.
            headers = span.headers(
                {"content-type": "application/json", "content-length": str(rows.body_size)}
            )
            body = _stream(rows, sent)
            async with client.stream("POST", url, content=body, headers=headers) as got:
                span.status(got.status_code)
                limited = got.status_code in RATE_LIMIT_STATUSES
                if not limited or retry == AGGREGATE_RATE_LIMIT_RETRIES:
                    got.raise_for_status()
                    return await receive(got, answer_path)
                retry_after = parse_retry_after(got.headers.get("retry-after"))
        await asyncio.sleep(next_wait_s(_AGGREGATE_WAITS, retry_after, retry))
    raise AssertionError("unreachable: the last try returns or raises")


async def _post_one(
    client: httpx.AsyncClient,
    config: ServersConfig,
    label: str,
    server: str,
    rows: ServerRows,
    answer_path: str,
    sent: Callable[[], None],
) -> tuple[dict[str, Any], BaseException | None]:
    """The server's entry: its answer's top level, its lists left at `answer_path`
    (`workers/aggregate_file.py`); or an empty entry with the error, and the error. `sent()`
    once its request body was sent whole, or once it is known none will be."""
    try:
        if server not in config.environments and server not in config.agents:
            raise UnknownServerError(
                f"rows are stamped with environment server {server!r}, which is not in the "
                f"config (available: {sorted(config.environments)}); aggregate with the config "
                "that produced them"
            )
        url = config.aggregation_url(server).rstrip("/") + "/aggregate_metrics"
        answer = await _request(client, url, server, rows, answer_path, sent)
    except Exception as exc:
        message = f"{type(exc).__name__}: {exc}"
        return empty_entry(label, server, message), exc
    finally:
        sent()
    entry = {"agent_ref": {"name": label}, F.ENVIRONMENT_SERVER: server, **answer}
    # Every collection NeMo Gym's file has, also when the server answered without it.
    for key, empty in EMPTY_COLLECTIONS:
        entry.setdefault(key, type(empty)())
    return entry, None


async def _stream(rows: ServerRows, sent: Callable[[], None]) -> AsyncIterator[bytes]:
    """The request body, streamed from the server's rows (`ServerRows.chunks`); `sent()` after
    its last chunk."""
    for chunk in rows.chunks():
        yield chunk
    sent()


def error_of(exc: BaseException) -> AggregationError:
    """The non-secret diagnostics of a failed aggregation: its type and HTTP status."""
    status = None
    if isinstance(exc, httpx.HTTPStatusError):
        status = exc.response.status_code
    return AggregationError(type=type(exc).__name__, http_status=status)


def labels_of(groups: dict[str, ServerRows]) -> dict[str, str]:
    """Each server's label in the file (`label_servers` of its first agent)."""
    return label_servers({s: (g.agents[0] if g.agents else None) for s, g in groups.items()})


async def aggregate(
    groups: dict[str, ServerRows],
    config: ServersConfig,
    scratch: str,
    failures: dict[str, AggregationError] | None = None,
    sent: threading.Event | None = None,
) -> tuple[list[dict[str, Any]], BaseException | None]:
    """One entry per server (sorted by server), and the first original exception, if any;
    `failures` is told each failed server's error (keyed by its label). `sent` is set once every
    server's request body was sent whole (or will not be): the servers compute from there.

    Each answer is kept in the folder `scratch` (its lists are read from there when the file is
    written: `workers/aggregate_file.py`); the caller removes it after writing.
    """
    labels = labels_of(groups)
    servers = sorted(groups)
    bodies: set[str] = set()

    def marker(server: str) -> Callable[[], None]:
        def mark() -> None:
            bodies.add(server)
            if sent is not None and len(bodies) == len(servers):
                sent.set()

        return mark

    try:
        async with httpx.AsyncClient(timeout=AGGREGATE_TIMEOUT_S, verify=tls_context()) as client:
            done = await asyncio.gather(
                *(
                    _post_one(client, config, labels[s], s, groups[s], f"{scratch}/{i}.json",
                              marker(s))
                    for i, s in enumerate(servers)
                )
            )  # fmt: skip
    finally:
        if sent is not None:
            sent.set()
    entries = [entry for entry, _ in done]
    if failures is not None:
        for server, (_, exc) in zip(servers, done, strict=True):
            if exc is not None:
                failures[labels[server]] = error_of(exc)
    first_error = next((exc for _, exc in done if exc is not None), None)
    return entries, first_error
