"""An example environment server: `POST /aggregate_metrics` over verified rollouts.

`GET /stats` counts the requests it received; `--fail` (or `POST /admin/knobs {"fail": true}`)
makes `/aggregate_metrics` answer HTTP 500.
"""

from __future__ import annotations

import argparse
from typing import Any

import orjson
from aiohttp import web

from examples.metrics import aggregate_metrics


class EnvironmentServer:
    """State of one example environment instance."""

    def __init__(self, name: str, fail: bool = False) -> None:
        self.name = name
        self.fail = fail
        self.requests = 0
        self.last_rows: list[dict[str, Any]] = []

    async def aggregate(self, request: web.Request) -> web.Response:
        self.requests += 1
        body = orjson.loads(await request.read())
        rows = body.get("verify_responses") if isinstance(body, dict) else None
        if not isinstance(rows, list):
            return web.Response(status=422, text="expected {'verify_responses': [...]}")
        self.last_rows = rows
        if self.fail:
            return web.Response(status=500, text=f"injected fault: {self.name} cannot aggregate")
        return web.Response(
            body=orjson.dumps(aggregate_metrics(rows)), content_type="application/json"
        )

    async def get_stats(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"requests": self.requests, "fail": self.fail, "rows": len(self.last_rows)}
        )

    async def set_knobs(self, request: web.Request) -> web.Response:
        changes = await request.json()
        if "fail" in changes:
            self.fail = bool(changes["fail"])
        return web.json_response({"fail": self.fail})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1024 * 1024 * 1024)
        app.router.add_post("/aggregate_metrics", self.aggregate)
        app.router.add_get("/stats", self.get_stats)
        app.router.add_post("/admin/knobs", self.set_knobs)
        return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9201)
    parser.add_argument("--name", default="math_env")
    parser.add_argument("--fail", action="store_true")
    a = parser.parse_args()
    web.run_app(EnvironmentServer(a.name, a.fail).app(), host=a.host, port=a.port)


if __name__ == "__main__":
    main()
