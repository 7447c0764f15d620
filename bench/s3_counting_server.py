"""moto's S3 server behind a counter of requests and uploaded bytes, for the storage benchmark.

`python -m bench.s3_counting_server PORT`. `GET /__bench__/counts` returns
`{"requests": {method: n}, "uploaded": bytes}`; `POST /__bench__/reset` zeroes them. Counting at
the server sees every request any client process makes, whatever library made it.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import orjson
from moto.moto_server.werkzeug_app import (
    DomainDispatcherApplication,
    MotoRequestHandler,
    create_backend_app,
)
from werkzeug.serving import make_server


class CountingApp:
    """WSGI middleware: counts each request by method and the payload bytes it uploads."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.requests: Counter[str] = Counter()
        self.uploaded = 0

    def __call__(
        self, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path.startswith("/__bench__/"):
            with self.lock:
                if path.endswith("reset"):
                    self.requests.clear()
                    self.uploaded = 0
                body = orjson.dumps({"requests": dict(self.requests), "uploaded": self.uploaded})
            start_response("200 OK", [("Content-Type", "application/json")])
            return [body]
        # With aws-chunked uploads the payload size is in its own header.
        size = environ.get("HTTP_X_AMZ_DECODED_CONTENT_LENGTH") or environ.get("CONTENT_LENGTH")
        with self.lock:
            self.requests[environ.get("REQUEST_METHOD", "?")] += 1
            self.uploaded += int(size or 0)
        return self.app(environ, start_response)


def main() -> None:
    port = int(sys.argv[1])
    app = CountingApp(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", port, app, threaded=True, request_handler=MotoRequestHandler)
    server.serve_forever()


if __name__ == "__main__":
    main()
