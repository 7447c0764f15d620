"""Acceptance 1: planning properties over random rows and settings (hypothesis).

For random rows (duplicate lines, caller-stamped task indices, agent_ref or task_source, ids for
task_ids) and random settings (num_repeats as int or dict, fan_out, agent_map, task_ids, both
interleavings):
- the planned count is the sum over selected rows of repeats over their fan-out agents;
- rollout ids are unique and each task's rollout indices are exactly 0..n-1;
- the input rows are unchanged;
- the same inputs plan to byte-identical materialized inputs, through the Python API and
  through a file;
- the orders are what docs/how-to/routing.md says: default is the planner's stream, interleave_repeats is its
  stable sort by rollout index, interleave_by_agent a round-robin of its per-agent sequences.

The expected count is computed by `expected_copies`, docs/how-to/routing.md's precedence written out plainly.
"""

from __future__ import annotations

import copy
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from producer.planning.planner import PlanContext, preprocess_examples, write_plan
from schemas import fields as F
from schemas.config import ServersConfig
from schemas.settings import CollectionSettings

AGENTS = ["a1", "a2", "a3"]
CONFIG = ServersConfig.model_validate(
    {
        "agents": {
            "a1": {"url": "http://a1", "type": "t", "environment": "e1", "resources_server": "rs1"},
            "a2": {"url": "http://a2", "type": "t", "environment": "e2"},
            "a3": {"url": "http://a3", "type": "t"},
        },
        "environments": {"e1": {"url": "http://e1"}, "e2": {"url": "http://e2"}},
        "resources_servers": {"rs1": {}},
    }
)
SOURCES = {"a1": "a1", "a3": "a3", "rs1": "a1", "e2": "a2"}  # task_source -> resolved agent


@st.composite
def rows_strategy(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Rows drawn from a small pool, so identical lines repeat."""

    @st.composite
    def one(draw: st.DrawFn) -> dict[str, Any]:
        r: dict[str, Any] = {"responses_create_params": {"input": draw(st.sampled_from("abcd"))}}
        how = draw(st.sampled_from(["ref", "source", "both"]))
        if how in ("ref", "both"):
            r["agent_ref"] = {"name": draw(st.sampled_from(AGENTS))}
        if how in ("source", "both"):
            r["task_source"] = draw(st.sampled_from(sorted(SOURCES)))
        if draw(st.booleans()):
            r["task_id"] = draw(st.sampled_from(["x", "y", "z"]))
        if draw(st.integers(0, 4)) == 0:
            r["_ng_task_index"] = draw(st.integers(0, 6))
        if draw(st.booleans()):
            r["meta"] = {"tags": draw(st.lists(st.integers(0, 3), max_size=2))}
        return r

    pool = draw(st.lists(one(), min_size=1, max_size=6))
    return draw(st.lists(st.sampled_from(pool), max_size=25))


@st.composite
def settings_strategy(draw: st.DrawFn) -> dict[str, Any]:
    s: dict[str, Any] = {}
    if draw(st.booleans()):
        s["num_repeats"] = draw(st.integers(1, 3))
    else:
        keys = draw(st.lists(st.sampled_from([*AGENTS, *SOURCES]), unique=True, max_size=3))
        s["num_repeats"] = {k: draw(st.integers(1, 3)) for k in keys} | {
            "_default": draw(st.integers(1, 2))
        }
    if draw(st.booleans()):
        basis = draw(st.sampled_from([*AGENTS, *SOURCES]))
        s["fan_out"] = {
            basis: draw(st.lists(st.sampled_from(AGENTS), min_size=1, max_size=3, unique=True))
        }
    amap = draw(
        st.dictionaries(
            st.sampled_from([*AGENTS, *SOURCES, "_default"]), st.sampled_from(AGENTS), max_size=2
        )
    )
    if amap:
        s["agent_map"] = amap
    if draw(st.integers(0, 3)) == 0:
        s["task_ids"] = draw(
            st.lists(st.sampled_from(["x", "y", "0", "1", "2", "5"]), min_size=1, max_size=3)
        )
    s["interleave_repeats"] = draw(st.booleans())
    s["interleave_by_agent"] = draw(st.booleans())
    return s


def expected_copies(rows: list[dict[str, Any]], s: CollectionSettings) -> tuple[int, int]:
    """(selected rows, planned rollouts) by docs/how-to/routing.md, written out without the planner's code."""
    identities: dict[bytes, int] = {}
    taken: set[str] = set()
    selected = total = 0
    for r in rows:
        line = orjson.dumps(r, option=orjson.OPT_SORT_KEYS)
        task = (
            r["_ng_task_index"]
            if "_ng_task_index" in r
            else identities.setdefault(line, len(identities))
        )
        if s.task_ids is not None:
            key = str(r["task_id"]) if "task_id" in r else str(task)
            if key not in {str(t) for t in s.task_ids} or key in taken:
                continue
            taken.add(key)
        selected += 1
        named = r.get("agent_ref", {}).get("name")
        source = r.get("task_source")
        basis = named if named is not None else source
        amap = s.agent_map
        if basis in s.fan_out:
            targets = s.fan_out[basis]
        elif named in amap:
            targets = [amap[named]]
        elif source in amap:
            targets = [amap[source]]
        elif "_default" in amap:
            targets = [amap["_default"]]
        elif named is not None:
            targets = [named]
        else:
            assert source is not None  # a row without an agent_ref names its task_source
            targets = [SOURCES[source]]
        for t in targets:
            n = s.num_repeats
            total += n if isinstance(n, int) else n.get(t, n.get(basis, n["_default"]))  # type: ignore[arg-type]
    return selected, total


def plan(rows: list[dict[str, Any]], s: CollectionSettings) -> list[dict[str, Any]]:
    return preprocess_examples(rows, CONFIG, s, run_id="run-p", on_warning=lambda _: None)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=rows_strategy(), raw_settings=settings_strategy())
def test_planning_properties(rows: list[dict[str, Any]], raw_settings: dict[str, Any]) -> None:
    s = CollectionSettings(**raw_settings)
    before = copy.deepcopy(rows)

    out = plan(rows, s)

    assert rows == before
    _, total = expected_copies(rows, s)
    assert len(out) == total
    ids = [F.rollout_id(r) for r in out]
    assert len(set(ids)) == len(ids)
    by_task: dict[int, list[int]] = defaultdict(list)
    for r in out:
        by_task[r[F.TASK_INDEX]].append(r[F.ROLLOUT_INDEX])
    assert all(sorted(v) == list(range(len(v))) for v in by_task.values())
    assert all(r[F.RUN_ID] == "run-p" and r[F.ENVIRONMENT_SERVER] for r in out)

    again = plan(copy.deepcopy(rows), s)
    assert b"".join(orjson.dumps(r) for r in again) == b"".join(orjson.dumps(r) for r in out)


@settings(max_examples=100, deadline=None)
@given(rows=rows_strategy(), raw_settings=settings_strategy())
def test_orders(rows: list[dict[str, Any]], raw_settings: dict[str, Any]) -> None:
    flat = CollectionSettings(
        **{**raw_settings, "interleave_repeats": False, "interleave_by_agent": False}
    )
    base = plan(rows, flat)

    by_repeat = plan(rows, flat.model_copy(update={"interleave_repeats": True}))
    assert by_repeat == sorted(base, key=lambda r: r[F.ROLLOUT_INDEX])

    both = flat.model_copy(update={"interleave_repeats": True, "interleave_by_agent": True})
    for source, settings_ in (
        (base, flat.model_copy(update={"interleave_by_agent": True})),
        (by_repeat, both),
    ):
        per_agent: dict[str, list[dict[str, Any]]] = {}
        for r in source:
            per_agent.setdefault(r[F.AGENT_REF]["name"], []).append(r)
        expected = []
        queues = [list(q) for q in per_agent.values()]
        while queues:
            expected += [q.pop(0) for q in queues]
            queues = [q for q in queues if q]
        assert plan(rows, settings_) == expected


@settings(max_examples=40, deadline=None)
@given(rows=rows_strategy(), raw_settings=settings_strategy())
def test_file_plans_match_the_python_api_byte_for_byte(
    rows: list[dict[str, Any]], raw_settings: dict[str, Any]
) -> None:
    s = CollectionSettings(**raw_settings)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "rows.jsonl"
        data.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
        outs = []
        for name in ("a.jsonl", "b.jsonl"):
            write_plan(
                str(data),
                str(Path(tmp) / name),
                CONFIG,
                s,
                PlanContext("run-p"),
                on_warning=lambda _: None,
            )
            outs.append((Path(tmp) / name).read_bytes())
    assert outs[0] == outs[1]
    assert outs[0] == b"".join(orjson.dumps(r) + b"\n" for r in plan(rows, s))
