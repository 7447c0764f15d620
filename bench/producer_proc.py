"""One producer in its own process, so its peak resident set is its own: prints one JSON line.

`python -m bench.producer_proc ours --url URL --n N --config C --rows R --out DIR` runs a
`rollouts run` against the workers on URL; `... chord --url URL --n N` publishes and waits for an
empty-task chord the standard Celery way. The line holds the wall and enqueue times, this
process's CPU and its peak RSS (VmHWM).
"""

from __future__ import annotations

import argparse
import sys

import orjson

from bench.collectors import run_empty_chord, run_ours
from bench.harness import peak_rss_mb


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("collector", choices=["ours", "chord"])
    parser.add_argument("--url", required=True)
    parser.add_argument("--n", type=int, required=True)
    parser.add_argument("--config", default="")
    parser.add_argument("--rows", default="")
    parser.add_argument("--out", default="")
    a = parser.parse_args(argv)
    if a.collector == "ours":
        m = run_ours(None, a.config, a.rows, a.out, a.n, url=a.url)
    else:
        m = run_empty_chord(None, a.n, url=a.url)
    line = {
        "name": m.name,
        "n": m.n,
        "wall_s": m.wall_s,
        "cpu_s": m.cpu_s,
        "enqueue_s": m.extra["enqueue_s"],
        "peak_rss_mb": peak_rss_mb(),
    }
    sys.stdout.write(orjson.dumps(line).decode() + "\n")


if __name__ == "__main__":
    main()
