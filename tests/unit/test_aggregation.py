"""Grouping, stripping and labelling for /aggregate_metrics, without servers."""

from __future__ import annotations

import asyncio
import os
import random
import ssl
import threading
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from schemas.config import ServersConfig
from workers import aggregation
from workers.aggregation import group_rows, label_servers, strip_row

CONFIG = ServersConfig.model_validate(
    {
        "agents": {
            "a": {"url": "http://a", "environment": "e1"},
            "b": {"url": "http://b", "environment": "e2"},
            "solo": {"url": "http://solo"},
        },
        "environments": {"e1": {"url": "http://e1"}, "e2": {"url": "http://e2"}},
    }
)


def test_strip_keeps_only_usage_and_incomplete_details_of_the_response() -> None:
    row = {
        "responses_create_params": {"input": "q"},
        "response": {
            "output": [1],
            "usage": {"input_tokens": 3},
            "incomplete_details": None,
            "id": "r",
        },
        "ng_trajectory": {},
        "ng_model_call_capture": {},
        "reward": 1.0,
        "_ng_task_index": 0,
    }
    assert strip_row(row) == {
        "response": {"usage": {"input_tokens": 3}, "incomplete_details": None},
        "reward": 1.0,
        "_ng_task_index": 0,
    }
    assert strip_row({"response": {"output": []}, "reward": 0}) == {"reward": 0}


def test_rows_group_by_stamp_then_by_the_agents_environment_in_task_rollout_order() -> None:
    rows: list[dict[str, Any]] = [
        {"_ng_task_index": 1, "_ng_rollout_index": 0, "agent_ref": {"name": "a"}},
        {
            "_ng_task_index": 0,
            "_ng_rollout_index": 1,
            "agent_ref": {"name": "a"},
            "_ng_environment_server": "e2",
        },
        {"_ng_task_index": 0, "_ng_rollout_index": 0, "agent_ref": {"name": "a"}},
        {"_ng_task_index": 0, "_ng_rollout_index": 0, "agent_ref": {"name": "solo"}},
        {"_ng_task_index": 0, "_ng_rollout_index": 0},
    ]
    groups = group_rows(rows, CONFIG)
    assert sorted(groups) == ["e1", "e2", "solo"]
    e1 = orjson.loads(groups["e1"].body())["verify_responses"]
    assert [(r["_ng_task_index"], r["_ng_rollout_index"]) for r in e1] == [(0, 0), (1, 0)]
    assert groups["e2"].agents == ["a"]
    assert CONFIG.aggregation_url("solo") == "http://solo"


def test_labels_are_agent_names_unless_an_agent_spans_servers() -> None:
    assert label_servers({"es1": "a", "es2": "a", "es3": "b"}) == {
        "es1": "es1",
        "es2": "es2",
        "es3": "b",
    }
    assert label_servers({"e1": "a", "e2": None}) == {"e1": "a", "e2": "e2"}
    # A server named like another server's agent forces a second round of renaming.
    assert label_servers({"x": "y", "y": None}) == {"x": "x", "y": "y"}


def test_a_failed_server_keeps_an_entry_with_empty_collections_and_the_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "e2":
            return httpx.Response(500, text="boom")
        rows = orjson.loads(request.content)["verify_responses"]
        return httpx.Response(
            200,
            json={"agent_metrics": {"n": len(rows)}, "key_metrics": {}, "group_level_metrics": []},
        )

    real = httpx.AsyncClient

    def fake_client(**kwargs: Any) -> httpx.AsyncClient:
        return real(transport=httpx.MockTransport(handler), **kwargs)

    monkeypatch.setattr(httpx, "AsyncClient", fake_client)
    rows = [
        {"_ng_task_index": 0, "_ng_rollout_index": 0, "agent_ref": {"name": "a"}, "reward": 1},
        {"_ng_task_index": 0, "_ng_rollout_index": 0, "agent_ref": {"name": "b"}, "reward": 0},
    ]
    entries, error = asyncio.run(
        aggregation.aggregate(group_rows(rows, CONFIG), CONFIG, str(tmp_path))
    )
    assert [e["_ng_environment_server"] for e in entries] == ["e1", "e2"]
    assert entries[0]["agent_metrics"] == {"n": 1}
    assert entries[1]["agent_metrics"] == {} and entries[1]["group_level_metrics"] == []
    assert "500" in entries[1]["aggregation_error"]
    assert isinstance(error, httpx.HTTPStatusError)


def test_every_aggregate_verifies_with_the_one_tls_context_of_its_process(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The CA bundle is loaded once per process, not for each finish step's client: each client
    gets the same context, and it verifies certificates and host names."""
    verified: list[Any] = []
    real = httpx.AsyncClient

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"agent_metrics": {}, "key_metrics": {}})

    def fake_client(**kwargs: Any) -> httpx.AsyncClient:
        verified.append(kwargs.get("verify"))
        return real(transport=httpx.MockTransport(handler), **kwargs)

    monkeypatch.setattr(httpx, "AsyncClient", fake_client)
    rows = [{"_ng_task_index": 0, "_ng_rollout_index": 0, "agent_ref": {"name": "a"}}]
    for _ in range(2):
        asyncio.run(aggregation.aggregate(group_rows(rows, CONFIG), CONFIG, str(tmp_path)))
    first, second = verified
    assert isinstance(first, ssl.SSLContext) and first is second
    assert first.verify_mode is ssl.CERT_REQUIRED and first.check_hostname


def test_a_rate_limited_aggregation_is_retried_after_its_retry_after_a_bounded_number_of_times(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    answers = {"e1": [429, 503, 200], "e2": [429] * 99}
    sent: dict[str, int] = {"e1": 0, "e2": 0}
    slept: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        host = str(request.url.host)
        status = answers[host][sent[host]]
        sent[host] += 1
        if status != 200:
            return httpx.Response(status, headers={"Retry-After": "3"})
        return httpx.Response(200, json={"agent_metrics": {"ok": 1}})

    real = httpx.AsyncClient

    def fake_client(**kwargs: Any) -> httpx.AsyncClient:
        return real(transport=httpx.MockTransport(handler), **kwargs)

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(httpx, "AsyncClient", fake_client)
    monkeypatch.setattr("workers.aggregation.asyncio.sleep", fake_sleep)
    rows = [
        {"_ng_task_index": 0, "_ng_rollout_index": 0, "agent_ref": {"name": "a"}, "reward": 1},
        {"_ng_task_index": 0, "_ng_rollout_index": 0, "agent_ref": {"name": "b"}, "reward": 0},
    ]
    entries, error = asyncio.run(
        aggregation.aggregate(group_rows(rows, CONFIG), CONFIG, str(tmp_path))
    )
    assert entries[0]["agent_metrics"] == {"ok": 1}
    assert sent == {"e1": 3, "e2": 1 + aggregation.AGGREGATE_RATE_LIMIT_RETRIES}
    assert set(slept) == {3.0} and len(slept) == 2 + aggregation.AGGREGATE_RATE_LIMIT_RETRIES
    assert "429" in entries[1]["aggregation_error"]
    assert isinstance(error, httpx.HTTPStatusError)


def test_a_large_group_is_spilled_to_sorted_runs_and_streamed_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = list(range(3000))
    random.Random(7).shuffle(rng)
    rows = [{"_ng_task_index": t, "_ng_rollout_index": t % 3, "agent_ref": {"name": "a"}}
            for t in rng]  # fmt: skip
    in_memory = group_rows(rows, CONFIG)["e1"]
    monkeypatch.setattr(aggregation, "SPILL_BYTES", 4096)
    spilled = group_rows(rows, CONFIG)["e1"]
    assert spilled._runs and not in_memory._runs
    monkeypatch.setattr(aggregation, "BODY_CHUNK", 1000)
    chunks = list(spilled.chunks())
    assert len(chunks) > 10 and b"".join(chunks) == in_memory.body()
    sent = orjson.loads(b"".join(chunks))["verify_responses"]
    assert [r["_ng_task_index"] for r in sent] == list(range(3000))
    scratch = spilled._scratch
    assert scratch is not None and os.path.isdir(scratch)
    spilled.close()
    assert not os.path.exists(scratch)


@pytest.mark.parametrize("count", [0, 1, 2, 3000])
def test_the_body_is_sized_before_it_is_sent(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(aggregation, "SPILL_BYTES", 4096)
    rows = [{"_ng_task_index": t, "_ng_rollout_index": 0, "agent_ref": {"name": "a"}, "v": "é" * t}
            for t in range(count)]  # fmt: skip
    group = group_rows(rows, CONFIG).get("e1") or aggregation.ServerRows()
    assert group.body_size == len(group.body())
    group.close()


def test_the_request_carries_a_content_length_and_no_chunked_encoding(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    seen: list[httpx.Headers] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers)
        if request.headers.get("content-length") != str(len(request.content)):
            return httpx.Response(411, text="Length Required")
        return httpx.Response(200, json={"agent_metrics": {}})

    real = httpx.AsyncClient
    monkeypatch.setattr(
        httpx, "AsyncClient", lambda **kw: real(transport=httpx.MockTransport(handler), **kw)
    )
    monkeypatch.setattr(aggregation, "BODY_CHUNK", 100)  # the body streams in many chunks
    rows = [{"_ng_task_index": t, "_ng_rollout_index": 0, "agent_ref": {"name": "a"}, "v": "é"}
            for t in range(50)]  # fmt: skip
    entries, error = asyncio.run(
        aggregation.aggregate(group_rows(rows, CONFIG), CONFIG, str(tmp_path))
    )
    assert error is None and "aggregation_error" not in entries[0]
    assert [h.get("transfer-encoding") for h in seen] == [None]


def test_task_rows_are_labelled_by_their_servers_attributed_agent() -> None:
    config = ServersConfig.model_validate(
        {"agents": {"t": {"url": "http://t"}},
         "environments": {"tb": {"url": "http://tb", "agent_server": "t"},
                          "puzzles": {"url": "http://p"}}}
    )  # fmt: skip
    rows = [
        {"_ng_task_index": 0, "_ng_rollout_index": 0, "_ng_environment_server": "tb"},
        {"_ng_task_index": 1, "_ng_rollout_index": 0, "_ng_environment_server": "puzzles"},
    ]
    groups = group_rows(rows, config)
    assert groups["tb"].agents == ["t"] and groups["puzzles"].agents == []
    assert label_servers({s: (g.agents[0] if g.agents else None) for s, g in groups.items()}) == {
        "tb": "t",
        "puzzles": "puzzles",
    }


def test_sent_is_set_once_every_body_went_out_before_any_answer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The finish step's health check waits for `sent` and then runs while the servers compute:
    it is set once each server had its whole body (or will get none: a server not in the
    config), not when the answers come."""
    answer = threading.Event()
    bodies: list[int] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(len(await request.aread()))  # the whole body, then the server computes
        while not answer.is_set():
            await asyncio.sleep(0.01)
        return httpx.Response(200, json={"agent_metrics": {}, "group_level_metrics": []})

    real = httpx.AsyncClient
    monkeypatch.setattr(
        httpx, "AsyncClient", lambda **kw: real(transport=httpx.MockTransport(handler), **kw)
    )
    rows = [
        {"_ng_task_index": t, "_ng_rollout_index": 0, "agent_ref": {"name": name}, "reward": 1}
        for t in range(50)
        for name in ("a", "b")
    ]
    rows.append({"_ng_task_index": 0, "_ng_environment_server": "gone", "reward": 1})
    sent = threading.Event()
    done: list[Any] = []
    asking = threading.Thread(
        target=lambda: done.append(
            asyncio.run(
                aggregation.aggregate(group_rows(rows, CONFIG), CONFIG, str(tmp_path), sent=sent)
            )
        )
    )
    asking.start()
    try:
        assert sent.wait(10), "the bodies went out but sent was not set"
        assert len(bodies) == 2 and min(bodies) > 1000 and not done
    finally:
        answer.set()
        asking.join(10)
    entries, error = done[0]
    assert [e["_ng_environment_server"] for e in entries] == ["e1", "e2", "gone"]
    assert isinstance(error, aggregation.UnknownServerError)
