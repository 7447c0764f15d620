"""Client CPU of the admission calls per rollout, against one plain Redis GET, measured in one run.

    python -m bench.admission_cost [--rollouts 6000] [--threads 32] [--gathered 64]

Starts an embedded Redis, then from `--threads` threads admits and releases `--rollouts`
rollouts through `workers.rollout.admission.Gate` (one Lua call to begin, or `--gathered` of them
in one round trip as the rollout engine sends them; releases batched by the gate's thread, or,
for comparison, one Lua call each), and prints a markdown table.
The process's CPU time is what is measured: the Redis server runs in its own process.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import redis

from infra import keys
from infra.embedded import EmbeddedRedis
from schemas.messages import CallPolicy, CollectRequest, RunRef
from workers.rollout.admission import DURATIONS_KEPT, AdmitCall, Gate, Ticket

Item = TypeVar("Item")


def measure(threads: int, items: list[Item], work: Callable[[Item], None]) -> float:
    """CPU seconds of this process per item."""
    parts = [items[i::threads] for i in range(threads)]
    runners = [threading.Thread(target=lambda p=p: [work(q) for q in p]) for p in parts]
    start = time.process_time()
    for t in runners:
        t.start()
    for t in runners:
        t.join()
    return (time.process_time() - start) / len(items)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=6000)
    parser.add_argument("--threads", type=int, default=32)
    parser.add_argument("--gathered", type=int, default=64, help="tries a gathered round trip")
    a = parser.parse_args()
    with EmbeddedRedis() as server:
        r = redis.Redis.from_url(server.url, max_connections=1024)
        sid = keys.shard_id("file:///bench", "0")
        r.hset(keys.shard_generation(sid), mapping={"token": "t"})
        gate = Gate(server.url)

        def requests() -> list[CollectRequest]:
            run = RunRef(run_id="bench", output_dir="file:///bench", shard="0", token="t")
            return [
                CollectRequest(
                    run=run, agent_url="http://agent", policy=CallPolicy(),
                    row={"_ng_task_index": i, "_ng_rollout_index": 0, "agent_ref": {"name": "a"}},
                )
                for i in range(a.rollouts)
            ]  # fmt: skip

        def get(_: CollectRequest) -> None:
            r.get("bench")

        def batched(q: CollectRequest) -> None:
            ticket = gate.admit(q, sid)
            gate.free_slot(ticket, "t")  # as collect does: the slot when the call ends,
            gate.release(ticket, "t")  # the accounting once the records landed

        def unbatched(q: CollectRequest) -> None:
            t = gate.admit(q, sid)
            gate.renewer.remove(t.member)
            zkeys = [keys.shard_leases(sid), t.agent_key, keys.shard_starts(sid),
                     keys.shard_generation(sid), keys.shard_durations(sid)]  # fmt: skip
            args = [DURATIONS_KEPT, t.member, t.key, "t", "done", -1]
            gate.releaser._script(keys=zkeys, args=args, client=gate.r)

        def gathered(calls: list[CollectRequest]) -> None:
            tickets = gate.try_admit_many([AdmitCall(q, sid) for q in calls])
            for ticket in tickets:
                assert isinstance(ticket, Ticket), ticket
                gate.free_slot(ticket, "t")
                gate.release(ticket, "t")

        def in_rounds(items: list[CollectRequest]) -> list[list[CollectRequest]]:
            return [items[i : i + a.gathered] for i in range(0, len(items), a.gathered)]

        base = measure(a.threads, requests(), get)
        rows = [("one Redis GET (baseline)", base)]
        rows.append(
            ("begin + release, one Lua call each", measure(a.threads, requests(), unbatched))
        )
        rows.append(
            (
                "begin one at a time (`try_admit`), batched slot release and accounting",
                measure(a.threads, requests(), batched),
            )
        )
        per_round = measure(a.threads, in_rounds(requests()), gathered)
        rows.append(
            (
                f"begin gathered, {a.gathered} tries a round trip (`try_admit_many`: as the "
                "engine admits deliveries that start together), batched release (as shipped)",
                per_round / a.gathered,
            )
        )
        gate.releaser.flush()
        print(f"{a.rollouts} rollouts from {a.threads} threads\n")
        print("| per rollout | client CPU ms | ratio to GET |")
        print("|---|---:|---:|")
        for name, cpu in rows:
            print(f"| {name} | {1000 * cpu:.3f} | {cpu / base:.1f} |")
        r.close()


if __name__ == "__main__":
    main()
