"""`aggregate`'s merge: sorted by (task, rollout), duplicates reported and kept, the record verifies."""

from __future__ import annotations

import hashlib
from pathlib import Path

import orjson
import pytest

from infra.store import RunDir
from producer.ops.merge import merge_shards
from schemas.errors import PlanningError, StorageError, UsageError
from tests.health_fixtures import record, write_lines
from workers.health.sources import discover


def shards(tmp_path: Path) -> Path:
    for name, keys in (("a", [(1, 0), (0, 1), (2, 0)]), ("b", [(0, 0), (1, 0), (1, 1)])):
        folder = tmp_path / "runs" / name
        folder.mkdir(parents=True)
        write_lines(folder / "rollouts-0.jsonl", [record(t, r, reward=0.5) for t, r in keys])
        write_lines(folder / "rollouts-0_failures.jsonl", [])
        write_lines(folder / "rollouts-0_materialized_inputs.jsonl", [])
    return tmp_path


def test_merge_sorts_keeps_duplicates_and_records_hashes(tmp_path: Path) -> None:
    root = shards(tmp_path)
    (root / "merged").mkdir()
    report = merge_shards(f"{root}/runs/*/rollouts-*.jsonl", str(root / "merged" / "all.jsonl"))
    merged = (root / "merged" / "all.jsonl").read_bytes()
    keys = [
        (r["_ng_task_index"], r["_ng_rollout_index"])
        for r in map(orjson.loads, merged.splitlines())
    ]
    assert keys == [(0, 0), (0, 1), (1, 0), (1, 0), (1, 1), (2, 0)]
    assert report.duplicates == 1
    record_ = orjson.loads((root / "merged" / "all_merged_shards.json").read_bytes())
    assert record_["merged"] == {
        "path": "all.jsonl",
        "size": len(merged),
        "sha256": hashlib.sha256(merged).hexdigest(),
        "rows": 6,
    }
    assert [s["path"] for s in record_["shards"]] == [
        "../runs/a/rollouts-0.jsonl",
        "../runs/b/rollouts-0.jsonl",
    ]
    for shard in record_["shards"]:
        data = (root / "merged" / shard["path"]).read_bytes()
        assert shard == {
            "path": shard["path"],
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    assert record_["duplicates"]["count"] == 1
    assert record_["duplicates"]["examples"] == [
        {
            "_ng_task_index": 1,
            "_ng_rollout_index": 0,
            "rows": [
                {"shard": "../runs/a/rollouts-0.jsonl", "line": 1},
                {"shard": "../runs/b/rollouts-0.jsonl", "line": 2},
            ],
        }
    ]
    # The merged folder is rechecked from the shards, with their sidecars.
    sources = discover(RunDir(str(root / "merged")), None)
    assert [s.label for s in sources] == [
        "../runs/a/rollouts-0.jsonl",
        "../runs/b/rollouts-0.jsonl",
    ]
    assert all(s.failures and s.materialized for s in sources)


def test_a_changed_shard_is_refused_by_name(tmp_path: Path) -> None:
    root = shards(tmp_path)
    (root / "merged").mkdir()
    merge_shards(f"{root}/runs/*/rollouts-*.jsonl", str(root / "merged" / "all.jsonl"))
    shard = root / "runs" / "b" / "rollouts-0.jsonl"
    data = bytearray(shard.read_bytes())
    data[5] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(
        StorageError, match=r"shard \.\./runs/b/rollouts-0\.jsonl listed in all_merged_shards\.json"
    ):
        discover(RunDir(str(root / "merged")), None)


def test_bad_line_or_no_match_writes_nothing(tmp_path: Path) -> None:
    root = shards(tmp_path)
    with open(root / "runs" / "b" / "rollouts-0.jsonl", "ab") as f:
        f.write(b'{"_ng_task_index": \n')
    (root / "merged").mkdir()
    with pytest.raises(PlanningError, match=r"runs/b/rollouts-0\.jsonl:4"):
        merge_shards(f"{root}/runs/*/rollouts-*.jsonl", str(root / "merged" / "all.jsonl"))
    assert list((root / "merged").iterdir()) == []
    with pytest.raises(UsageError, match="no shards matched"):
        merge_shards(f"{root}/nothing/*.jsonl", str(root / "merged" / "all.jsonl"))
