"""`run_scripts` on a real Redis: a batch of a script's calls answers as the calls one by one."""

from __future__ import annotations

import redis

from infra.redis_client import batched_source, run_scripts

SCRIPT = """
-- KEYS[1]: a counter; ARGV[1]: how much to add, ARGV[2]: a label, ARGV[3]: what to answer.
if ARGV[3] == 'nil' then return nil end
if ARGV[3] == 'false' then return false end
if ARGV[3] == 'lua-error' then error('refused ' .. ARGV[2]) end
local n = redis.call('INCRBY', KEYS[1], ARGV[1])
return {KEYS[1], n, ARGV[2], #KEYS, #ARGV}
"""


def calls(prefix: str) -> list[tuple[list[str], list[object]]]:
    a, b, text = f"{prefix}:a", f"{prefix}:b", f"{prefix}:text"
    return [
        ([a], [1, "first", "value"]),
        ([b], [10, "second", "value"]),
        ([a], [2, "ünïcode ✓", "value"]),
        ([a, b], [3, b'{"json": "bytes"}', "value"]),
        ([text], [1, "incr on text", "value"]),  # WRONGTYPE-like: not an integer
        ([a], [0, "nil", "nil"]),
        ([a], [0, "false", "false"]),
        ([a], [0, "boom", "lua-error"]),
        ([a], [0.5, "float", "value"]),  # INCRBY refuses a float: that call's error
    ]


def answers_one_by_one(r: redis.Redis, script: object, prefix: str) -> list[object]:
    out: list[object] = []
    for names, args in calls(prefix):
        try:
            out.append(script(keys=names, args=args, client=r))  # type: ignore[operator]
        except redis.exceptions.ResponseError as exc:
            out.append(exc)
    return out


def test_a_batch_answers_and_writes_as_its_calls_one_by_one(r: redis.Redis) -> None:
    script = r.register_script(SCRIPT)
    r.set("one:text", "x")
    r.set("batch:text", "x")
    expected = answers_one_by_one(r, script, "one")
    got = run_scripts(r, script, calls("batch"))
    assert _same(expected, got)
    assert r.get("one:a") == r.get("batch:a") == b"6"
    assert r.get("one:b") == r.get("batch:b") == b"10"
    errors = [a for a in got if isinstance(a, Exception)]
    assert len(errors) == 3 and all(isinstance(e, redis.exceptions.ResponseError) for e in errors)
    assert "refused boom" in str(got[7])
    assert got[5] is None and got[6] is None
    # One round trip: the batch form went as one script, known to Redis by its own digest.
    assert r.script_exists(batched_source(SCRIPT).sha) == [True]


def _same(expected: list[object], got: list[object]) -> bool:
    """Equal but for the keys' prefixes, errors compared by kind (their text names the script,
    and the batch form's digest is its own)."""

    def norm(value: object) -> object:
        if isinstance(value, Exception):
            return "error"
        if isinstance(value, list):
            return [norm(v) for v in value]
        if isinstance(value, bytes):
            return value.replace(b"one:", b"").replace(b"batch:", b"")
        return value

    return [norm(v) for v in expected] == [norm(v) for v in got]


def test_a_batch_after_redis_forgot_its_scripts(r: redis.Redis) -> None:
    script = r.register_script(SCRIPT)
    first = run_scripts(r, script, calls("x")[:2])
    r.script_flush()
    again = run_scripts(r, script, calls("x")[:2])
    assert [a[1] for a in first] == [1, 10]
    assert [a[1] for a in again] == [2, 20]


def test_arguments_with_no_text_go_in_a_pipeline(r: redis.Redis) -> None:
    script = r.register_script(SCRIPT)
    r.script_flush()
    raw = b"\xff\xfe not UTF-8"
    got = run_scripts(r, script, [(["p:a"], [1, raw, "value"]), (["p:a"], [2, "b", "value"])])
    assert got == [[b"p:a", 1, raw, 1, 3], [b"p:a", 3, b"b", 1, 3]]
    assert not r.script_exists(batched_source(SCRIPT).sha)[0]


def test_a_single_call_and_no_calls(r: redis.Redis) -> None:
    script = r.register_script(SCRIPT)
    assert run_scripts(r, script, []) == []
    assert run_scripts(r, script, [(["s:a"], [4, "only", "value"])]) == [[b"s:a", 4, b"only", 1, 3]]
