"""Every expected rollout's recovery state and the shard's coverage, from its files alone.

The one account of a shard that the finish step, `rollouts resume` (and its `--plan`),
`rollouts status` and the report read, so they never disagree: a `ShardLedger` read with the
shard's reservations (`workers/shard/reservations.py`: the newest reserved execution decides
each rollout) folds the files, `state_of` names one rollout's state (`schemas/coverage.py`),
and `coverage_of` counts them all into `rollouts-S_coverage.json`'s record without a pass over
the planned rows: results are counted on bitmaps, failures one standing row at a time, and
`unknown` is what is left. `read_account` does the reading for a caller that has only the
folder (`resume --plan`, `status`).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass

import redis

from infra import jsonl, keys
from infra.runs import read_manifest
from infra.store import RunDir, ShardFiles
from schemas.coverage import FAILED, RECOVERY_STATES, RecoveryState, RunCoverage, WrittenBy
from schemas.records import Manifest, utc_now
from schemas.settings import CollectionSettings
from workers.shard import landed
from workers.shard.keyset import Key, KeySet
from workers.shard.ledger import ShardLedger
from workers.shard.reservations import Reservations


@dataclass(frozen=True)
class RecoveryPolicy:
    """What a failure's state depends on beyond its row: the attempt limit, the zero classes."""

    max_attempts: int
    """Failed attempts that spent the budget (delivered or possibly delivered) at which a rollout
    is `exhausted`."""
    zero_classes: frozenset[str] = frozenset()
    """`count_failure_classes_as_zero`: a standing failure of one is `model_final`."""

    @classmethod
    def of(cls, settings: CollectionSettings) -> RecoveryPolicy:
        """The policy of a run's settings (its `max_attempts`, its zero classes)."""
        return cls(settings.max_attempts, frozenset(settings.count_failure_classes_as_zero))


def state_of(ledger: ShardLedger, key: Key, policy: RecoveryPolicy) -> RecoveryState:
    """The rollout's recovery state, from its standing outcome in `ledger`."""
    if key in ledger.landed_keys:
        return "masked" if key in ledger.masked_keys else "scored"
    failure = ledger.latest.get(key)
    if failure is None or not ledger.stands(key, failure):
        return "missing"
    if failure.omitted:
        return "omitted"
    if failure.zero or failure.cls in policy.zero_classes:
        return "model_final"
    if failure.terminal or key in ledger.terminal:
        return "terminal"
    if failure.judge:
        return "judge_recoverable"
    if ledger.spent[key] >= policy.max_attempts:
        return "exhausted"
    return "retryable"


@dataclass
class CoverageFacts:
    """What the coverage record says beside the ledger's counts."""

    run_id: str
    shard: str
    identity_verified: bool
    generation: int = 0
    imputed: int = 0
    superseded: int = 0
    written_by: WrittenBy = "finish"


def coverage_of(
    ledger: ShardLedger, policy: RecoveryPolicy, facts: CoverageFacts, expected: int | None = None
) -> RunCoverage:
    """The shard's coverage from a ledger that read its files (with its reservations) and,
    for an exact inventory, its materialized inputs; `expected`: the planned count when they
    were not read (the account is then not reconciled)."""
    reconciled = ledger.planned > 0 or expected in (None, 0)
    owed = ledger.planned_keys if reconciled else None
    total = ledger.planned if reconciled else int(expected or 0)
    landed = _landed_keyset(ledger)
    masked, unscored = _keyset(ledger.masked_keys), _keyset(ledger.unscored_keys)
    if isinstance(owed, KeySet):
        landed_n = landed.count_common(owed)
        masked_n = masked.count_common(owed)
        unscored_n = unscored.count_common(owed) - unscored.count_common(owed, masked)
    else:
        landed_n, masked_n = len(landed), len(masked)
        unscored_n = len(unscored) - unscored.count_common(masked)
    states: Counter[RecoveryState] = Counter({"scored": landed_n - masked_n, "masked": masked_n})
    failed_by: Counter[str] = Counter()
    for key, failure in ledger.latest.items():
        if key in landed or (owed is not None and key not in owed):
            continue
        state = state_of(ledger, key, policy)
        states[state] += 1
        if state in FAILED:
            failed_by[failure.cls] += 1
    states["missing"] += total - sum(states.values())
    failed = sum(states[s] for s in FAILED)
    counted = states["model_final"]
    coverage = RunCoverage(
        run_id=facts.run_id,
        shard=facts.shard,
        expected=total,
        successful=landed_n,
        measured=landed_n - masked_n - unscored_n,
        masked=masked_n,
        unscored=unscored_n,
        failed=failed,
        intentionally_omitted=states["omitted"],
        unknown=states["missing"],
        complete=states["missing"] == 0 and failed == counted,
        reconciled=reconciled,
        scored=landed_n + counted + facts.imputed,
        counted_failures=counted,
        imputed=facts.imputed,
        attempts_exhausted=states["exhausted"],
        max_rollout_attempts=policy.max_attempts,
        attempts=ledger.landed + ledger.failure_rows,
        identity_verified=facts.identity_verified,
        states={s: states[s] for s in RECOVERY_STATES},
        failed_by_class=dict(sorted(failed_by.items())),
        superseded_records=facts.superseded,
        generation=facts.generation,
        written_by=facts.written_by,
        updated_at=utc_now(),
    )
    return coverage


def _keyset(found: object) -> KeySet:
    return found if isinstance(found, KeySet) else KeySet(found)  # type: ignore[arg-type]


def _landed_keyset(ledger: ShardLedger) -> KeySet:
    return _keyset(ledger.landed_keys)


def materialized_sha256(rd: RunDir, shard: str) -> str | None:
    """SHA-256 of the shard's materialized inputs; None when they are missing."""
    name = ShardFiles(shard).materialized
    if not rd.exists(name):
        return None
    digest = hashlib.sha256()
    for _, block in rd.iter_bytes(name):
        digest.update(block)
    return digest.hexdigest()


STALE_MARK = ".stale"
"""In the name of a `_superseded` object that is a stale result set aside before its rollout was
run again (`stale_rollouts="rerun"`, `workers/feed/backpressure.py`), not a late delivery."""


def superseded_count(rd: RunDir, shard: str) -> int:
    """Late deliveries of older attempts kept as evidence (`_superseded` objects; the stale
    results a feed's re-runs set aside there are not late deliveries and not counted)."""
    names = rd.list_folder(ShardFiles(shard).superseded)
    return sum(STALE_MARK not in name.rsplit("/", 1)[-1] for name in names)


def write_coverage(rd: RunDir, coverage: RunCoverage) -> None:
    """Write `rollouts-S_coverage.json` (replaced whole, atomically)."""
    rd.write_atomic(
        ShardFiles(coverage.shard).coverage, jsonl.dumps_pretty(coverage.model_dump(mode="json"))
    )


@dataclass
class ShardAccount:
    """A shard's files read against its manifest: the ledger, the policy and the coverage."""

    manifest: Manifest
    ledger: ShardLedger
    policy: RecoveryPolicy
    coverage: RunCoverage


def read_account(
    rd: RunDir,
    shard: str,
    policy: RecoveryPolicy | None = None,
    written_by: WrittenBy = "plan",
    manifest: Manifest | None = None,
) -> ShardAccount:
    """Read the shard's files (results, failures, materialized inputs) with its reservations and
    count its coverage; `policy`: the run's own (its `max_attempts`, its zero classes) by default."""
    manifest = manifest or read_manifest(rd, shard)
    if policy is None:
        policy = RecoveryPolicy.of(CollectionSettings.model_validate(manifest.settings))
    reserved = Reservations(manifest.generations)
    ledger = ShardLedger.read(rd, shard, planned=True, tally_tokens=False, reserved=reserved)
    facts = CoverageFacts(
        run_id=manifest.run_id,
        shard=shard,
        identity_verified=materialized_sha256(rd, shard) == manifest.materialized_sha256,
        generation=max(0, len(manifest.generations) - 1),
        superseded=superseded_count(rd, shard),
        written_by=written_by,
    )
    coverage = coverage_of(ledger, policy, facts, expected=manifest.planned)
    return ShardAccount(manifest, ledger, policy, coverage)


def stopped_coverage(
    r: redis.Redis, rd: RunDir, manifest: Manifest, policy: RecoveryPolicy
) -> RunCoverage:
    """The coverage of a shard stopped mid-run (SIGTERM), fast: the landed keys and the kinds of
    their results from Redis (`workers/rollout/landing.py` counts them as they land), the
    failures from the sidecar; no result row is read. Not reconciled."""
    shard = manifest.shard
    sid = keys.shard_id(rd.url, shard)
    ledger = ShardLedger(rd, ShardFiles(shard), reserved=Reservations(manifest.generations))
    ledger.landed_keys = landed.read_keyset(r, sid)
    ledger.read_failures()
    counts = {k.decode(): int(v) for k, v in r.hgetall(keys.shard_counts(sid)).items()}  # type: ignore[union-attr]
    facts = CoverageFacts(
        run_id=manifest.run_id,
        shard=shard,
        identity_verified=False,
        generation=max(0, len(manifest.generations) - 1),
        superseded=superseded_count(rd, shard),
        written_by="stop",
    )
    coverage = coverage_of(ledger, policy, facts, expected=manifest.planned)
    masked, unscored = counts.get("landed_masked", 0), counts.get("landed_unscored", 0)
    states = {**coverage.states, "scored": coverage.successful - masked, "masked": masked}
    return coverage.model_copy(
        update={
            "masked": masked,
            "unscored": unscored,
            "measured": coverage.successful - masked - unscored,
            "states": states,
            "reconciled": False,
        }
    )
