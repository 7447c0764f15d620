"""A partition: three worker hosts in network namespaces, one host's link cut mid-run.

Redis and the example agent listen on the root namespace's side (`tests/netns_hosts.py`). The
cut-off host's leases expire; the other two take its rollouts over and the run finishes by
itself. When the link comes back, the cut-off host's late outcomes change no file of the run.
Needs root and `ip netns`: skipped (with the reason) where they are missing.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from examples.agent_server import AgentKnobs
from examples.servers import start_servers
from infra.embedded import EmbeddedRedis
from tests.cluster import Workers
from tests.helpers import demo_rows
from tests.netns_hosts import SERVICE_ADDRESS, TestHosts
from tests.ops_helpers import (
    ENV,
    LEASE_TTL_S,
    landed_lines,
    results_once,
    snapshot,
    wait_for,
)
from tests.runs import Run

pytestmark = [pytest.mark.integration, pytest.mark.netns]


@pytest.mark.timeout(240)
def test_a_host_cut_off_mid_run_is_taken_over_and_its_late_outcomes_change_nothing(
    hosts: TestHosts, tmp_path: Path
) -> None:
    server = EmbeddedRedis(host=SERVICE_ADDRESS)  # a password: it listens beyond loopback
    server.start()
    servers = start_servers(knobs=AgentKnobs(latency_ms=400), host=SERVICE_ADDRESS)
    workers = Workers(server.url, tmp_path)
    run = Run(servers, server.url, tmp_path, workers)
    out = run.out
    try:
        for i in (1, 2, 3):
            workers.start(env=ENV, prefix=hosts.prefix(i), wait=False)
        workers.wait_ready()
        producer = run.start(demo_rows(150), "+route_failures_to_sidecar=true")
        wait_for(lambda: landed_lines(out) >= 30, 60, "30 results")
        hosts.cut(1)
        try:
            code = producer.wait(180)
            assert code == 0, run.log()
            before = snapshot(out)
        finally:
            hosts.restore(1)
        log = workers.logs[0]

        def tried() -> bool:
            text = log.read_text(errors="replace")
            return "this attempt was taken over" in text or "lost the lease of" in text

        # Its calls' replies and its Redis connections come back (TCP retransmits): it learns
        # that its rollouts were taken over, and what it lands is refused.
        wait_for(tried, 120, "the cut-off host to reach Redis again", interval=0.5)
        time.sleep(3 * LEASE_TTL_S)  # and has had time to try the rest
        assert snapshot(out) == before, "the cut-off host changed the run directory"
        results_once(out, 150)
        others = workers.logs[1].read_text() + workers.logs[2].read_text()
        assert "went silent; published it again" in others
    finally:
        run.stop_producers()
        workers.stop()
        servers.stop()
        server.close()
