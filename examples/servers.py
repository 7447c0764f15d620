"""Start example agent and environment servers together, in a thread or as a process.

    python -m examples.servers --write-config servers.yaml [--latency-ms 200 --fault-rate 0.1]

starts the demo topology (math_agent behind math_env, count_agent behind count_env, and
word_tasks_env running the episodes of the task set `demo:word-counts`) on free ports, writes the
matching servers config, and serves until interrupted. With `--capture-dir
URL` the agents call the example model server through a capture proxy (`infra/capture_proxy.py`)
that captures each call into URL; run with `+observability_enabled=true
+model_call_capture_dir=URL` to merge the captures into the results.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

import yaml
from aiohttp import web

from examples.agent_server import FAULT_KINDS, AgentKnobs, AgentServer
from examples.env_server import EnvironmentServer
from examples.model_server import ModelServer
from infra.capture_proxy import CaptureProxy

DEMO_TOPOLOGY = {"math_agent": "math_env", "count_agent": "count_env"}
DEMO_FAMILIES = {"math_agent": "arithmetic", "count_agent": "counting"}
DEMO_TASKSETS = {"demo:word-counts": "word_tasks_env"}
"""The demo's task set (taskset -> the environment server that runs its episodes)."""


def free_port() -> int:
    """A port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class RunningServers:
    """Example servers serving on a private event loop thread."""

    agents: dict[str, AgentServer] = field(default_factory=dict)
    environments: dict[str, EnvironmentServer] = field(default_factory=dict)
    agent_env: dict[str, str] = field(default_factory=dict)
    routes: dict[str, str] = field(default_factory=dict)
    """Taskset -> the environment server that runs its episodes."""
    urls: dict[str, str] = field(default_factory=dict)
    loop: asyncio.AbstractEventLoop | None = None
    thread: threading.Thread | None = None
    runners: list[web.AppRunner] = field(default_factory=list)
    model: ModelServer | None = None
    """The example model server, when the agents call one."""
    proxy: CaptureProxy | None = None
    """The capture proxy in front of it."""

    def config(self) -> dict[str, Any]:
        """The normalised servers config for these servers."""
        routes = {"environment_server_routes": dict(self.routes)} if self.routes else {}
        return {
            **routes,
            "agents": {
                name: {
                    "url": self.urls[name],
                    "type": "simple_agent",
                    "environment": self.agent_env[name],
                }
                for name in self.agents
            },
            "environments": {
                name: {"url": self.urls[name], "allowed_agents": ["simple_agent"]}
                for name in self.environments
            },
        }

    def write_config(self, path: str) -> str:
        with open(path, "w") as f:
            yaml.safe_dump(self.config(), f, sort_keys=False)
        return path

    def stop(self) -> None:
        loop, self.loop = self.loop, None
        if loop is None:
            return

        async def shutdown() -> None:
            for runner in self.runners:
                await runner.cleanup()

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        if self.thread is not None:
            self.thread.join(30)
        loop.close()
        for agent in self.agents.values():
            agent.close()
        for env in self.environments.values():
            env.runner.close()


async def _serve(servers: RunningServers, apps: dict[str, web.Application], host: str) -> None:
    for name, app in apps.items():
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, host, port, backlog=4096).start()
        servers.runners.append(runner)
        servers.urls[name] = f"http://{host}:{port}"


def start_servers(
    topology: dict[str, str] | None = None,
    knobs: AgentKnobs | None = None,
    failing_environments: tuple[str, ...] = (),
    host: str = "127.0.0.1",
    capture_dir: str | None = None,
    tasksets: dict[str, str] | None = None,
) -> RunningServers:
    """Start one agent per key of `topology` (agent -> environment) and each environment once,
    listening on `host`; `tasksets` (taskset -> environment) adds the environments that run
    those task sets' episodes, and their routes to the config. With `capture_dir`, also the
    example model server and a capture proxy the agents and episodes call."""
    topology = topology or DEMO_TOPOLOGY
    servers = RunningServers(agent_env=dict(topology), routes=dict(tasksets or {}))
    for agent in topology:
        servers.agents[agent] = AgentServer(agent, AgentKnobs(**vars(knobs)) if knobs else None)
    for env in dict.fromkeys([*topology.values(), *servers.routes.values()]):
        servers.environments[env] = EnvironmentServer(env, fail=env in failing_environments)
    apps: dict[str, web.Application] = {}
    if capture_dir is not None:
        servers.model = ModelServer()
        servers.proxy = CaptureProxy("http://unset", capture_dir)
        apps = {"model_server": servers.model.app(), "capture_proxy": servers.proxy.app()}
    apps.update({n: a.app() for n, a in servers.agents.items()})
    apps.update({n: e.app() for n, e in servers.environments.items()})
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(_serve(servers, apps, host))
        except BaseException as exc:
            errors.append(exc)
            ready.set()
            return
        ready.set()
        loop.run_forever()

    servers.loop = loop
    servers.thread = threading.Thread(target=run, name="example-servers", daemon=True)
    servers.thread.start()
    ready.wait(30)
    if errors:
        raise errors[0]
    if servers.proxy is not None:
        servers.proxy.upstream = servers.urls["model_server"]
        for server in servers.agents.values():
            server.knobs.model_url = servers.urls["capture_proxy"]
        for environment in servers.environments.values():
            environment.runner.knobs.model_url = servers.urls["capture_proxy"]
    return servers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-config", required=True, help="Where to write the servers config.")
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--latency-jitter-ms", type=float, default=0.0)
    parser.add_argument("--fault-rate", type=float, default=0.0)
    parser.add_argument(
        "--fault-kinds", default="http500", help=f"comma-separated: {', '.join(FAULT_KINDS)}"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-log", default=None)
    parser.add_argument(
        "--pad-kb", type=int, default=0, help="Extra KB of reasoning items in each response."
    )
    parser.add_argument(
        "--agents", default=",".join(DEMO_TOPOLOGY), help="Which demo agents to start."
    )
    parser.add_argument(
        "--rate-limit-above",
        type=int,
        default=None,
        help="Agents answer 429 to a call above this many concurrent ones (0: every call).",
    )
    parser.add_argument("--retry-after", type=float, default=1.0, help="The 429's Retry-After.")
    parser.add_argument(
        "--capture-dir", default=None, help="Agents call a model through a capture proxy into this."
    )
    parser.add_argument("--model-stream", action="store_true", help="Stream the model's replies.")
    a = parser.parse_args()
    topology = {name: DEMO_TOPOLOGY[name] for name in a.agents.split(",") if name}
    knobs = AgentKnobs(
        latency_ms=a.latency_ms,
        latency_jitter_ms=a.latency_jitter_ms,
        fault_rate=a.fault_rate,
        fault_kinds=[k for k in a.fault_kinds.split(",") if k],
        seed=a.seed,
        request_log=a.request_log,
        pad_kb=a.pad_kb,
        rate_limit_above=a.rate_limit_above,
        retry_after_s=a.retry_after,
        model_stream=a.model_stream,
    )
    servers = start_servers(topology, knobs, capture_dir=a.capture_dir, tasksets=DEMO_TASKSETS)
    servers.write_config(a.write_config)
    print(f"serving; config written to {a.write_config}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    servers.stop()


if __name__ == "__main__":
    main()
