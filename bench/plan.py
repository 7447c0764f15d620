"""Planning benchmark (issue 3, acceptance 4): does planning stream?

    python -m bench.plan [--sizes 100000,1000000] [--no-interleaved]

For each size it writes an input of N small rows (x1 repeat) and plans it in a fresh process,
exactly as `rollouts run` does before dispatch (`producer.planning.planner.write_plan`: read, route,
validate, stamp, write the materialized inputs), recording wall time and the process's peak RSS.
The baseline, measured in the same run on the same files, is a process with the same imports
that only parses each line, adds the stamp fields and writes it back: the floor of any planner.
`plan-interleaved` plans the same files with interleave_repeats and interleave_by_agent, the
orders that spill to temporary files.

Targets: peak RSS below 500 MB at 1M rows, and no more than 2x from 100k to 1M rows.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

CONFIG = {
    "agents": {
        "math_agent": {
            "url": "http://127.0.0.1:9",
            "type": "simple_agent",
            "environment": "math_env",
        },
        "count_agent": {
            "url": "http://127.0.0.1:9",
            "type": "simple_agent",
            "environment": "count_env",
        },
    },
    "environments": {
        "math_env": {"url": "http://127.0.0.1:9", "allowed_agents": ["simple_agent"]},
        "count_env": {"url": "http://127.0.0.1:9", "allowed_agents": ["simple_agent"]},
    },
}
RSS_LIMIT_MB = 500.0
GROWTH_LIMIT = 2.0


def write_input(path: Path, n: int) -> None:
    agents = ("math_agent", "count_agent")
    with open(path, "wb") as f:
        for i in range(n):
            row = {
                "responses_create_params": {
                    "input": [{"role": "user", "content": f"What is {i} + 1?"}]
                },
                "agent_ref": {"name": agents[i % 2]},
                "task_id": i,
            }
            f.write(orjson.dumps(row) + b"\n")


def child(mode: str, input_path: str, out_path: str) -> dict[str, Any]:
    """Runs in the measured process: plan (or copy) one file, report time and peak RSS."""
    from producer.planning.planner import PlanContext, write_plan
    from schemas.config import ServersConfig
    from schemas.settings import CollectionSettings

    config = ServersConfig.model_validate(CONFIG)
    start = time.perf_counter()
    if mode == "copy":
        planned = 0
        with open(input_path, "rb") as src, open(out_path, "wb") as out:
            for line in src:
                row = orjson.loads(line)
                row.update(
                    _ng_task_index=planned, _ng_rollout_index=0, _ng_run_id="bench", _ng_shard="0"
                )
                out.write(orjson.dumps(row, option=orjson.OPT_APPEND_NEWLINE))
                planned += 1
    else:
        interleaved = mode == "plan-interleaved"
        settings = CollectionSettings(
            interleave_repeats=interleaved, interleave_by_agent=interleaved
        )
        planned = write_plan(
            input_path, out_path, config, settings, PlanContext("bench"), on_warning=print
        ).planned
    seconds = time.perf_counter() - start
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"mode": mode, "planned": planned, "seconds": seconds, "peak_rss_mb": peak_kb / 1024}


def measure(mode: str, input_path: Path, n: int, workdir: Path) -> dict[str, Any]:
    out = workdir / f"out-{mode}-{n}.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.plan", "--child", mode, "--input", str(input_path), "--out", str(out)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    out.unlink(missing_ok=True)
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["rows"] = n
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100000,1000000")
    parser.add_argument("--no-interleaved", action="store_true")
    parser.add_argument("--child", choices=["plan", "plan-interleaved", "copy"])
    parser.add_argument("--input")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.input, args.out)))
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-plan-") as tmp:
        workdir = Path(tmp)
        for n in sizes:
            data = workdir / f"rows-{n}.jsonl"
            write_input(data, n)
            modes = ["copy", "plan"] + ([] if args.no_interleaved else ["plan-interleaved"])
            for mode in modes:
                results.append(measure(mode, data, n, workdir))
            data.unlink()
    print_table(results, sizes)


def print_table(results: list[dict[str, Any]], sizes: list[int]) -> None:
    copy = {r["rows"]: r for r in results if r["mode"] == "copy"}
    smallest = {r["mode"]: r for r in results if r["rows"] == min(sizes)}
    print(
        f"planning benchmark, {os.cpu_count()} cores; baseline = parse + stamp + write each line\n"
    )
    print(
        "| scenario | rows | planned | seconds | rows/s | peak RSS (MB) | rows/s vs baseline | peak RSS vs baseline | peak RSS vs smallest size |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        rate = r["rows"] / r["seconds"]
        base = copy[r["rows"]]
        base_rate = base["rows"] / base["seconds"]
        growth = (
            r["peak_rss_mb"] / smallest[r["mode"]]["peak_rss_mb"]
            if r["mode"] in smallest
            else float("nan")
        )
        print(
            f"| {r['mode']} | {r['rows']:,} | {r['planned']:,} | {r['seconds']:.2f} | {rate:,.0f} | "
            f"{r['peak_rss_mb']:.0f} | {rate / base_rate:.2f}x | {r['peak_rss_mb'] / base['peak_rss_mb']:.2f}x | {growth:.2f}x |"
        )
    print()
    ok_rss = all(r["peak_rss_mb"] < RSS_LIMIT_MB for r in results if r["mode"] != "copy")
    verdict = "yes" if ok_rss else "NO"
    print(f"- peak RSS below {RSS_LIMIT_MB:.0f} MB for every planning run: {verdict}")
    for mode in ("plan", "plan-interleaved"):
        runs = {r["rows"]: r for r in results if r["mode"] == mode}
        if len(runs) > 1:
            growth = runs[max(sizes)]["peak_rss_mb"] / runs[min(sizes)]["peak_rss_mb"]
            verdict = "yes" if growth <= GROWTH_LIMIT else "NO"
            print(
                f"- {mode} peak RSS {min(sizes):,} -> {max(sizes):,} rows: {growth:.2f}x "
                f"(at most {GROWTH_LIMIT:.0f}x: {verdict})"
            )


if __name__ == "__main__":
    main()
