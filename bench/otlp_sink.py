"""An OTLP/HTTP sink for benchmarks: it reads each export and answers it, decoding nothing.

Run as its own process (`python -m bench.otlp_sink PORT_FILE`), so its CPU is not counted as
the producer's or the workers'. An empty protobuf message is zero bytes: an empty 200 is a valid
answer to both `/v1/traces` and `/v1/metrics`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        return


class OtlpSink:
    """The sink in a child process on a free loopback port; `env()` points exporters at it."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def __enter__(self) -> OtlpSink:
        fd, path = tempfile.mkstemp(prefix="bench-otlp-")
        os.close(fd)
        os.unlink(path)
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.otlp_sink", path])
        deadline = time.monotonic() + 30
        while not os.path.exists(path) or os.path.getsize(path) == 0:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("the OTLP sink did not start")
            time.sleep(0.05)
        with open(path) as f:
            self.url = f"http://127.0.0.1:{int(f.read())}"
        os.unlink(path)
        return self

    def env(self) -> dict[str, str]:
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": self.url}

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(10)


def main(port_file: str) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with open(port_file + ".tmp", "w") as f:
        f.write(str(server.server_address[1]))
    os.rename(port_file + ".tmp", port_file)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1])
