"""The run builder: example servers, worker processes, rows and `rollouts run` in a test's folder.

`make_run(...)` (a fixture of `tests/conftest.py`) starts the servers and the workers a run needs
and hands out a `Run`; the test writes its rows and runs them as a user does (`run.cli`, or
`run.start` in the background), or in its own process (`run.execute`).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from examples.agent_server import AgentKnobs
from examples.servers import RunningServers
from producer.shard.runner import RunOptions, execute_run
from tests.cluster import ExampleServers, StartWorkers, Workers
from tests.helpers import write_rows
from tests.ops_helpers import cli, cli_background


@dataclass
class Run:
    """A run of example servers in `folder`: its servers config, its input rows, its run
    directory `out`, and `rollouts run` on them against `broker`."""

    servers: RunningServers
    broker: str
    folder: Path
    workers: Workers
    """The test's worker processes (`start_workers`)."""
    producers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    """The `rollouts run` processes `start` left running."""

    @property
    def out(self) -> Path:
        return self.folder / "run"

    @property
    def log_path(self) -> Path:
        """Where the output of `start` goes."""
        return self.folder / "run.log"

    @cached_property
    def config(self) -> str:
        """The servers config: the servers' own, written to `servers.yaml` on first use."""
        return self.write_config(self.servers.config())

    def write_config(self, config: dict[str, Any]) -> str:
        """`config` (the servers' own, edited) written as the run's servers config."""
        path = self.folder / "servers.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.__dict__["config"] = str(path)
        return str(path)

    def input(self, rows: list[Any]) -> str:
        """`rows` written as the run's input, `rows.jsonl`."""
        return write_rows(self.folder / "rows.jsonl", rows)

    def args(self, rows: list[Any], *extra: str) -> list[str]:
        """`rollouts run` of `rows` into `out` on the broker, then `extra`."""
        return [
            "run", "--config", self.config, "--input", self.input(rows),
            "--output-dir", str(self.out), "--broker", self.broker, *extra,
        ]  # fmt: skip

    def cli(
        self, rows: list[Any], *extra: str, env: dict[str, str] | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        """`rollouts run` in a subprocess, waited for."""
        return cli(*self.args(rows, *extra), env=env, timeout=timeout)

    def start(
        self, rows: list[Any], *extra: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """`rollouts run` in a subprocess left running, its output to `log_path`."""
        producer = cli_background(*self.args(rows, *extra), log=self.log_path, env=env)
        self.producers.append(producer)
        return producer

    def stop_producers(self) -> None:
        """Kill what `start` left running (a test that failed before its run ended)."""
        for producer in self.producers:
            if producer.poll() is None:
                producer.kill()
                producer.wait()

    def log(self) -> str:
        return self.log_path.read_text()

    def execute(
        self, rows: list[Any], settings: dict[str, Any] | None = None, **options: Any
    ) -> int:
        """`rollouts run` in this process (`execute_run`); `options` are `RunOptions` fields,
        and `console` the console it prints to."""
        console = options.pop("console", None)
        opts = RunOptions(
            config_path=self.config,
            input_path=self.input(rows),
            output_dir=options.pop("output_dir", str(self.out)),
            settings=settings or {},
            broker_url=self.broker,
            **options,
        )
        return execute_run(opts, console)


@dataclass
class MakeRun:
    """The `make_run` fixture: a `Run` on new example servers (the arguments of
    `examples.servers.start_servers`), with `workers` worker processes of `concurrency` slots
    already started (none with `workers=0`)."""

    example_servers: ExampleServers
    start_workers: StartWorkers
    broker: str
    folder: Path
    made: list[Run] = field(default_factory=list)

    def __call__(
        self,
        topology: dict[str, str] | None = None,
        knobs: AgentKnobs | None = None,
        *,
        workers: int = 1,
        concurrency: int = 8,
        env: dict[str, str] | None = None,
        **server_options: Any,
    ) -> Run:
        servers = self.example_servers(topology, knobs, **server_options)
        started = self.start_workers(workers, concurrency, env=env)
        self.made.append(Run(servers, self.broker, self.folder, started))
        return self.made[-1]

    def close(self) -> None:
        for run in self.made:
            run.stop_producers()
