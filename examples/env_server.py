"""An example environment server: `POST /aggregate_metrics` over verified rollouts, and `POST /run`
running episodes of a small task set.

An episode is NeMo Gym's request `{"episode_id": {"rollout_id", "attempt"}, "task": {"task_id":
{"taskset", "task_id"}, "task_input": {...}}}`; the answer echoes `episode_id` and `task_id` with a
`result` (the stand-in model's answer to `task_input.question`, checked against
`task_input.expected_answer`) or a `failure`. A task input may ask for its own failure
(`"fail": {"terminal": true, "reason": "..."}`) or latency (`"latency_ms": 2000`). With
`--model-url` the episode calls that model under the episode's capture key, as the example agent
does (`examples/agent_server.py`).

`GET /stats` counts the requests it received; `GET /episodes` lists the `/run` bodies received,
as received; `--fail` (or `POST /admin/knobs {"fail": true}`) makes `/aggregate_metrics` answer
HTTP 500, `aggregate_delay_ms` delays its answer (a slow server's aggregate; `answered_at`
holds when each answer went), and `require_content_length` makes every request without a `Content-Length` (a chunked
body) answer HTTP 411, as some servers and proxies do.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
from typing import Any

import orjson
from aiohttp import web

from examples.agent_server import AgentKnobs, AgentServer
from examples.metrics import aggregate_metrics

MAX_RECORDED = 10_000
"""`/run` bodies kept for `GET /episodes` (the first ones)."""
RESULT_FIELDS = ("response", "reward", "extracted_answer", "ng_agent_observations")
_DERIVED_ID = re.compile(r"^(\d+)-(\d+)$")


class EnvironmentServer:
    """State of one example environment instance."""

    def __init__(
        self, name: str, fail: bool = False, episode_knobs: AgentKnobs | None = None
    ) -> None:
        self.name = name
        self.fail = fail
        self.require_content_length = False
        self.requests = 0
        self.refused_chunked = 0
        self.aggregate_delay_ms = 0.0
        self.answered_at: list[float] = []
        """When each `/aggregate_metrics` answer went (`time.time()`)."""
        self.last_rows: list[dict[str, Any]] = []
        self.episode_bodies: list[dict[str, Any]] = []
        self.episodes = 0
        # The episode's model calls and scoring are the example agent's.
        self.runner = AgentServer(f"{name}-episodes", episode_knobs)

    @web.middleware
    async def _length_required(self, request: web.Request, handler: Any) -> web.StreamResponse:
        chunked = request.method == "POST" and request.headers.get("Content-Length") is None
        if self.require_content_length and chunked:
            self.refused_chunked += 1
            return web.Response(status=411, text="Length Required")
        return await handler(request)  # type: ignore[no-any-return]

    async def aggregate(self, request: web.Request) -> web.Response:
        self.requests += 1
        body = orjson.loads(await request.read())
        rows = body.get("verify_responses") if isinstance(body, dict) else None
        if not isinstance(rows, list):
            return web.Response(status=422, text="expected {'verify_responses': [...]}")
        self.last_rows = rows
        if self.aggregate_delay_ms > 0:
            await asyncio.sleep(self.aggregate_delay_ms / 1000)
        self.answered_at.append(time.time())
        if self.fail:
            return web.Response(status=500, text=f"injected fault: {self.name} cannot aggregate")
        return web.Response(
            body=orjson.dumps(aggregate_metrics(rows)), content_type="application/json"
        )

    async def run(self, request: web.Request) -> web.Response:
        """One episode of the task set."""
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return web.Response(status=400, text="body is not JSON")
        problem = _episode_problem(body)
        if problem is not None:
            return web.Response(status=422, text=problem)
        self.episodes += 1
        if len(self.episode_bodies) < MAX_RECORDED:
            self.episode_bodies.append(body)
        episode, task = body["episode_id"], body["task"]
        task_input = task["task_input"]
        latency = float(task_input.get("latency_ms", self.runner.knobs.latency_ms))
        if latency > 0:
            await asyncio.sleep(latency / 1000)
        reply: dict[str, Any] = {"episode_id": episode, "task_id": task["task_id"]}
        fail = task_input.get("fail")
        if isinstance(fail, dict):
            reply["failure"] = {
                "failure_reason": str(fail.get("reason", "the task asked to fail")),
                "terminal": bool(fail.get("terminal", False)),
                "stage": "agent",
            }
        else:
            reply["result"] = await self._result(episode, task_input, request)
        return web.Response(body=orjson.dumps(reply), content_type="application/json")

    async def _result(
        self, episode: dict[str, Any], task_input: dict[str, Any], request: web.Request
    ) -> dict[str, Any]:
        rollout_id, attempt = str(episode["rollout_id"]), int(episode.get("attempt", 0))
        key = rollout_id if attempt == 0 else f"{rollout_id}-a{attempt}"
        derived = _DERIVED_ID.match(rollout_id)
        row = {
            "responses_create_params": {
                "input": [{"role": "user", "content": str(task_input.get("question", ""))}],
                "temperature": 1.0,
            },
            "expected_answer": task_input.get("expected_answer", ""),
            "difficulty": task_input.get("difficulty", 0.3),
            # The stand-in model samples by rollout: another rollout, another sample.
            "_ng_task_index": int(derived.group(1)) if derived else 0,
            "_ng_rollout_index": int(derived.group(2)) if derived else 0,
        }
        runner = self.runner
        if runner.knobs.model_url:
            traceparent = request.headers.get("traceparent")
            scored = await runner.model_result(row, runner.knobs.model_url, traceparent, key=key)
        else:
            scored = runner.result(row)
        return {k: scored[k] for k in RESULT_FIELDS if k in scored}

    async def get_stats(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "requests": self.requests,
                "fail": self.fail,
                "rows": len(self.last_rows),
                "episodes": self.episodes,
                "refused_chunked": self.refused_chunked,
            }
        )

    async def get_episodes(self, request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(self.episode_bodies), content_type="application/json")

    async def set_knobs(self, request: web.Request) -> web.Response:
        changes = await request.json()
        if "fail" in changes:
            self.fail = bool(changes["fail"])
        if "require_content_length" in changes:
            self.require_content_length = bool(changes["require_content_length"])
        if "aggregate_delay_ms" in changes:
            self.aggregate_delay_ms = float(changes["aggregate_delay_ms"])
        return web.json_response(
            {"fail": self.fail, "require_content_length": self.require_content_length,
             "aggregate_delay_ms": self.aggregate_delay_ms}
        )  # fmt: skip

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=1024 * 1024 * 1024, middlewares=[self._length_required]
        )
        app.router.add_post("/aggregate_metrics", self.aggregate)
        app.router.add_post("/run", self.run)
        app.router.add_get("/stats", self.get_stats)
        app.router.add_get("/episodes", self.get_episodes)
        app.router.add_post("/admin/knobs", self.set_knobs)

        async def closing(_: web.Application) -> None:
            await self.runner.aclose()

        app.on_cleanup.append(closing)
        return app


def _episode_problem(body: Any) -> str | None:
    """Why `body` is not an episode request (NeMo Gym's `BaseEpisodeRequest`), or None."""
    if not isinstance(body, dict) or set(body) != {"episode_id", "task"}:
        return "expected {'episode_id': {...}, 'task': {...}}"
    episode, task = body["episode_id"], body["task"]
    if not isinstance(episode, dict) or not isinstance(episode.get("rollout_id"), str):
        return "episode_id.rollout_id must be a string"
    attempt = episode.get("attempt", 0)
    if type(attempt) is not int or attempt < 0 or set(episode) - {"rollout_id", "attempt"}:
        return "episode_id must be {rollout_id, attempt >= 0}"
    if not isinstance(task, dict) or set(task) != {"task_id", "task_input"}:
        return "task must be {task_id, task_input}"
    task_id = task["task_id"]
    if not isinstance(task_id, dict) or set(task_id) != {"taskset", "task_id"}:
        return "task.task_id must be {taskset, task_id}"
    if not isinstance(task["task_input"], dict):
        return "task.task_input must be an object"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9201)
    parser.add_argument("--name", default="math_env")
    parser.add_argument("--fail", action="store_true")
    parser.add_argument("--model-url", default=None, help="A Responses API model for episodes.")
    a = parser.parse_args()
    server = EnvironmentServer(a.name, a.fail, AgentKnobs(model_url=a.model_url))
    web.run_app(server.app(), host=a.host, port=a.port)


if __name__ == "__main__":
    main()
