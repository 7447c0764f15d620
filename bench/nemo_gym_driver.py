"""Run NeMo Gym 0.7.0's in-process collector over a rows file, timed; prints one JSON line.

It runs under an interpreter that has nemo-gym installed (Python >= 3.13, docs/explanation/performance.md), as its own
process: `python bench/nemo_gym_driver.py --agent-url URL --rows rows.jsonl --out out.jsonl
--concurrency 512`. A stand-in head server (serving `/global_config_dict_yaml`) names one agent
and one environment server that fronts it, both at the agent's URL, so NeMo Gym POSTs `/run`
straight to the same agent server the other collectors use.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import socket
import threading
import time
from urllib.parse import urlparse


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _head_server(config_yaml: str, port: int) -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(
                config_yaml
            ).encode()  # FastAPI returns the YAML text as a JSON string
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()


async def _collect(
    rows: list[dict], out: str, concurrency: int, head: object, helper: object
) -> dict[str, int]:
    """Collect every row; a rollout whose call raised (NeMo Gym 0.7.0's `run_examples` raises on
    an HTTP error such as a 429) is counted by its exception, and the others go on."""
    semaphore = asyncio.Semaphore(concurrency)
    failed: dict[str, int] = {}
    with open(out, "wb") as f:
        for future in asyncio.as_completed(
            list(helper.run_examples(rows, head_server_config=head, semaphore=semaphore))  # type: ignore[attr-defined]
        ):
            try:
                _row, result = await future
            except Exception as exc:
                status = getattr(exc, "status", None)
                name = type(exc).__name__ + (f" {status}" if status else "")
                failed[name] = failed.get(name, 0) + 1
                continue
            f.write(json.dumps(result).encode() + b"\n")
    return failed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--agent-url", required=True)
    parser.add_argument("--rows", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--concurrency", type=int, default=512)
    a = parser.parse_args()
    from nemo_gym.config_types import BaseServerConfig
    from nemo_gym.rollout_collection import RolloutCollectionHelper

    agent = urlparse(a.agent_url)
    head_port = _free_port()
    config = f"""
head_server: {{host: 127.0.0.1, port: {head_port}}}
math_agent:
  responses_api_agents:
    simple_agent: {{host: {agent.hostname}, port: {agent.port}, entrypoint: app.py}}
math_env:
  environment_servers:
    legacy_agent:
      host: {agent.hostname}
      port: {agent.port}
      agent_server: {{type: responses_api_agents, name: math_agent}}
"""
    _head_server(config, head_port)
    with open(a.rows, "rb") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for i, row in enumerate(rows):
        row.setdefault("_ng_task_index", i)
        row.setdefault("_ng_rollout_index", 0)
    head = BaseServerConfig(host="127.0.0.1", port=head_port)
    helper = RolloutCollectionHelper()
    cpu0, t0, dispatched_at = _cpu(), time.perf_counter(), time.time()
    failed = asyncio.run(_collect(rows, a.out, a.concurrency, head, helper))
    wall, cpu = time.perf_counter() - t0, _cpu() - cpu0
    line = {"n": len(rows), "wall_s": wall, "cpu_s": cpu, "failed": failed,
            "dispatched_at": dispatched_at}  # fmt: skip
    print(json.dumps(line))


if __name__ == "__main__":
    main()
