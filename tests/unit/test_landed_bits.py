"""The landed keys' compact form: bits where they fit, set members where a bit would be sparse,
and every reader (pipeline, `LANDED_LUA`, admission, the lock's first read) sees both."""

from __future__ import annotations

import pytest
import redis

from infra import keys
from infra.locks import held_reading
from infra.scripts import LANDED_LUA
from tests.shard_helpers import SID, open_generation, request
from workers.rollout.admission import Gate
from workers.shard import landed

PLANNED = 100


@pytest.fixture
def r(r: redis.Redis) -> redis.Redis:
    return open_generation(r)


def add(r: redis.Redis, ks: list[str]) -> None:
    pipe = r.pipeline(transaction=True)
    landed.add(pipe, SID, PLANNED, ks, 3600)
    pipe.execute()


def test_dense_keys_are_bits_and_sparse_ones_set_members(r: redis.Redis) -> None:
    sparse_task = landed.MIN_BITS + 5  # above both 65,536 and 16 x 100 planned
    add(r, ["0:0", "7:0", "7:3", f"{sparse_task}:0", f"2:{keys.LANDED_BITS_ROLLOUTS}"])
    assert r.getbit(keys.shard_landed_bits(SID, 0), 7) == 1
    assert r.getbit(keys.shard_landed_bits(SID, 3), 7) == 1
    members = {m.decode() for m in r.smembers(keys.shard_landed(SID))}  # type: ignore[union-attr]
    assert members == {f"{sparse_task}:0", f"2:{keys.LANDED_BITS_ROLLOUTS}"}
    assert 0 < r.ttl(keys.shard_landed_bits(SID, 0)) <= 3600
    assert 0 < r.ttl(keys.shard_landed(SID)) <= 3600
    assert landed.count(r, SID) == 5
    asked = ["0:0", "7:0", "7:1", "7:3", f"{sparse_task}:0", f"{sparse_task}:1",
             f"2:{keys.LANDED_BITS_ROLLOUTS}", "8:0", f"{1 << 40}:0"]  # fmt: skip
    expected = [True, True, False, True, True, False, True, False, False]
    assert landed.present(r, SID, asked) == expected
    assert landed.present(r, SID, asked, r.register_script(LANDED_LUA)) == expected
    with held_reading(r, keys.shard_lock(SID), keys.shard_state(SID), keys.shard_landed(SID),
                      asked) as lock:  # fmt: skip
        assert lock.present == expected


def test_admission_sees_a_bit_as_landed(r: redis.Redis, redis_url: str) -> None:
    gate = Gate(redis_url, ttl_s=30.0)
    add(r, ["3:1"])
    assert gate.admit(request(3, 1), SID).verdict == "duplicate"
    ticket = gate.admit(request(3, 0), SID)
    assert ticket.verdict == "run"
    gate.renewer.remove(ticket.member)


def test_one_bitmap_per_repeat_is_an_eighth_of_a_byte_per_task(r: redis.Redis) -> None:
    pipe = r.pipeline(transaction=True)
    landed.add(pipe, SID, 100_000, [f"{t}:0" for t in range(100_000)], 3600)
    pipe.execute()
    assert r.strlen(keys.shard_landed_bits(SID, 0)) == 12_500
    assert not r.exists(keys.shard_landed(SID))
    assert landed.count(r, SID) == 100_000


def test_a_keysets_bitmaps_are_written_to_redis_as_they_are(r: redis.Redis) -> None:
    from workers.shard.keyset import KeySet

    found = KeySet([(0, 0), (9, 0), (700, 2), (5, 70), (10**9, 0)])
    pipe = r.pipeline(transaction=True)
    landed.add_keyset(pipe, SID, found, 3600)
    pipe.execute()
    asked = ["0:0", "9:0", "8:0", "700:2", "700:0", "5:70", f"{10**9}:0", "1:1"]
    assert landed.present(r, SID, asked) == [True, True, False, True, False, True, True, False]
    assert landed.count(r, SID) == 5
    assert 0 < r.ttl(keys.shard_landed_bits(SID, 2)) <= 3600
