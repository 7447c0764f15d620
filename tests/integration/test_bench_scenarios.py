"""`python -m bench SCENARIO` runs every scenario end to end at tiny sizes.

Real workers, Redis and agent server, as in the real benchmark; no figure is asserted (the
figures are measured by hand on a quiet machine), only that each collector in the table ran
every rollout (the collectors assert the landed count themselves) and the table is whole.
Marked `slow` (out of the default run; `pytest -m slow` runs them): each scenario starts its own
Redis and worker processes for every collector, two minutes of the suite together.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def bench_output(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "bench", *args, "--rounds", "1"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def table_rows(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("| ")][1:]


def bench(*args: str) -> list[str]:
    return table_rows(bench_output(*args))


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip("|").split("|")]


@pytest.mark.timeout(320)
def test_latency_table_has_every_collector() -> None:
    rows = bench("latency", "--n", "120", "--latency-ms", "50", "--in-flight", "16",
                 "--nemo-python", "")  # fmt: skip
    names = [cells(r)[0] for r in rows]
    assert names[0] == "asyncio + aiohttp (in-process)"
    assert "Celery chord, tasks only sleep 0.05 s" in names
    assert names[-1] == "rollouts (ours)"
    assert all(cells(r)[1] == "120" for r in rows)
    # every collector's peak RSS per 1,000 in flight is a figure (none ran in NeMo Gym's place)
    assert all(float(cells(r)[-1]) == float(cells(r)[-1]) for r in rows), rows
    # and so is its wave start: its 16th /run (the chord: its 16th task) was seen after dispatch
    assert all(float(cells(r)[3]) >= 0 for r in rows), rows
    # the agent ended its last /run after dispatch; ours finished after it (the chord calls none)
    last = {cells(r)[0]: cells(r)[4] for r in rows}
    assert last["Celery chord, tasks only sleep 0.05 s"] == "-"
    assert float(last["asyncio + aiohttp (in-process)"]) > 0
    ours = next(cells(r) for r in rows if cells(r)[0] == "rollouts (ours)")
    assert 0 < float(ours[4]) < float(ours[2]), ours
    # the 17th /run and after each took a slot a reply freed: how long it stood empty (the chord's
    # tasks call no agent)
    refill = {cells(r)[0]: cells(r)[5] for r in rows}
    assert refill["Celery chord, tasks only sleep 0.05 s"] == "-"
    for name in ("asyncio + aiohttp (in-process)", "rollouts (ours)"):
        p50, p90 = (float(x) for x in refill[name].split(" / "))
        assert 0 <= p50 <= p90, refill


@pytest.mark.timeout(320)
def test_latency_gives_up_on_a_chord_past_its_time_limit() -> None:
    """The sleeping chord is reported as not finished, its wave start still read; the agent
    declares the in-flight count, so ours starts its whole first wave."""
    output = bench_output("latency", "--n", "40", "--latency-ms", "2000", "--in-flight", "20",
                          "--chord-limit-s", "1", "--nemo-python", "")  # fmt: skip
    assert "the agent declares max_concurrency 20" in output
    by_name = {cells(r)[0]: cells(r) for r in table_rows(output)}
    chord = by_name["Celery chord, tasks only sleep 2 s"]
    assert chord[2] == "did not finish in 1 s" and chord[4] == chord[5] == chord[7] == "-", chord
    for name in ("asyncio + aiohttp (in-process)", "rollouts (ours)"):
        assert float(by_name[name][2]) > 0 and float(by_name[name][3]) >= 0, by_name[name]


@pytest.mark.timeout(320)
def test_overhead_counts_every_part() -> None:
    rows = bench("overhead", "--n", "150", "--concurrency", "8", "--telemetry")
    by_name = {cells(r)[0]: cells(r) for r in rows}
    assert by_name["empty Celery chord"][-1] == "1.00x"
    # producer, workers and Redis each spent some CPU on our run, traced or not
    for name in ("rollouts (ours)", "rollouts (ours, telemetry on)"):
        assert all(float(v) > 0 for v in by_name[name][5:8]), by_name[name]


@pytest.mark.timeout(320)
def test_scale_measures_each_size_in_its_own_producer() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "scale", "--sizes", "60,120", "--concurrency", "8"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [cells(r) for r in proc.stdout.splitlines() if r.startswith("| ")][1:]
    assert [(r[0], r[1]) for r in rows] == [
        ("empty Celery chord", "60"), ("rollouts (ours)", "60"),
        ("empty Celery chord", "120"), ("rollouts (ours)", "120"),
    ]  # fmt: skip
    assert all(float(r[5]) > 20 for r in rows)  # a real interpreter's peak RSS, in MB
    assert "rollouts (ours): peak RSS at N=120 / N=60 =" in proc.stdout


@pytest.mark.timeout(320)
def test_workers_compares_one_and_two_processes() -> None:
    rows = [cells(r) for r in bench("workers", "--n", "100", "--concurrency", "8")]
    assert [(r[0], r[1]) for r in rows] == [
        ("empty Celery chord", "1"), ("rollouts (ours)", "1"),
        ("empty Celery chord", "2"), ("rollouts (ours)", "2"),
    ]  # fmt: skip
    assert rows[1][-1] == "1.00x"


@pytest.mark.timeout(320)
def test_ratelimit_table_counts_the_429s() -> None:
    rows = bench("ratelimit", "--n", "80", "--in-flight", "32", "--latency-ms", "50",
                 "--limit", "4", "--nemo-python", "")  # fmt: skip
    [ours] = [cells(r) for r in rows]
    assert ours[0] == "rollouts (ours)" and ours[1] == "80"
    requests, limited = int(ours[2]), int(ours[3])
    assert requests == 80 + limited


@pytest.mark.timeout(320)
def test_capture_table_has_both_paths_for_each_load() -> None:
    rows = [cells(r) for r in bench("capture", "--n", "80", "--in-flight", "8")]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (path, stream, flight)
        for stream in ("no", "yes")
        for flight in ("1", "8")
        for path in ("direct", "proxy")
    ]
    assert all(r[9] == "-" for r in rows if r[0] == "direct")
    assert all(float(r[9]) > 0 for r in rows if r[0] == "proxy")  # the proxy's CPU was read


@pytest.mark.timeout(320)
def test_report_table_measures_the_report() -> None:
    [row] = bench("report", "--n", "2000")
    rollouts, _, _, seconds, _, rss, size = cells(row)
    assert rollouts == "2,000" and seconds.endswith(" s") and rss.endswith(" MB")
    assert size.endswith(" MB")


@pytest.mark.timeout(320)
def test_soak_checkpoints_every_tenth_and_measures_what_follows() -> None:
    lines = bench("soak", "--n", "400")
    checkpoints = [int(c[0].replace(",", "")) for c in map(cells, lines) if c[0][:1].isdigit()]
    assert len(checkpoints) == 10 and checkpoints[-1] == 400, lines
    assert all(x >= 40 * (i + 1) for i, x in enumerate(checkpoints)), checkpoints
    processes = {
        c[0]: c for c in map(cells, lines) if c[0].startswith(("producer", "finish", "rollouts"))
    }
    assert set(processes) == {
        "producer (rollouts run)",
        "finish step, again on its own",
        "rollouts status",
        "rollouts resume (nothing missing)",
        "rollouts resume --plan",
    }, lines
    assert all(c[3] == "0" for c in processes.values()), processes
    # The keys left after the finish (kind, keys, without a TTL, TTL span), not the largest
    # keys at a checkpoint (kind, elements, MB, bytes per rollout).
    kinds = {
        c[0]: c
        for c in map(cells, lines)
        if c[0].startswith(("shard:", "celery")) and (c[3] == "-" or c[3].endswith(" h"))
    }
    assert "shard:landed_bits" in kinds and all(c[2] == "0" for c in kinds.values()), kinds


@pytest.mark.timeout(320)
def test_feed_compares_a_run_with_and_without_its_feed() -> None:
    rows = bench("feed", "--n", "40")
    names = [cells(r)[0] for r in rows]
    assert names == ["rollouts (ours)", "rollouts, feed read by a trainer"]
    assert all(cells(r)[1] == "40" for r in rows)


@pytest.mark.timeout(320)
def test_ab_alternates_the_baseline_and_this_checkout() -> None:
    """Measured against itself (the mechanics: a child per run in each checkout's folder, one
    agent for both, the agent's log read per run)."""
    out = bench_output("ab", "--baseline", str(ROOT), "--n", "60", "--in-flight", "8",
                       "--latency-ms", "50")  # fmt: skip
    rows = [cells(r) for r in table_rows(out)]
    assert [r[0] for r in rows] == ["baseline", "this"]
    assert all(float(r[1]) > 0 and float(r[4]) >= 0 and float(r[5]) > 0 for r in rows), rows
    assert all(len(r[7].split(" / ")) == 2 for r in rows), rows  # refill p50 / p90
    assert "medians: baseline: wall" in out
