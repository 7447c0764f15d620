"""What a resume of a shard would run: every expected rollout's recovery state, from storage alone.

`plan_resume` reads the shard's files against its manifest (`workers/shard/coverage.py`) and
picks the rollouts `rollouts resume` runs: exactly those `retryable` or `missing`. `rows_to_run`
streams their planned rows, stamped with `_ng_attempt_index` (their failed attempts so far).
`rollouts resume RUN_DIR --plan [--json]` prints the plan and writes the shard's coverage,
dispatching nothing (`show_plan`); without `--shard` it plans every shard of the folder (a
folder `rollouts aggregate` merged shards into holds each shard's files, planned apiece).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from rich.console import Console
from rich.markup import escape

from infra.runs import read_manifest
from infra.store import RunDir, ShardFiles
from producer.shard.opening import iter_materialized
from schemas import fields as F
from schemas.coverage import RECOVERY_STATES, RUNNABLE, RecoveryState, RunCoverage
from schemas.errors import StorageError, UsageError
from schemas.records import Manifest
from workers.health.sources import SHARD_FILE as SHARD_NAME
from workers.health.sources import merged_records, verify_merged
from workers.shard.coverage import (
    RecoveryPolicy,
    ShardAccount,
    read_account,
    state_of,
    write_coverage,
)
from workers.shard.keyset import Key, KeySet
from workers.shard.reservations import encode_keys

MANIFEST_NAME = re.compile(r"^rollouts-(?P<shard>[A-Za-z0-9._-]+)_manifest\.json$")


@dataclass
class ResumePlan:
    """What a resume finds in the shard and what it will run."""

    account: ShardAccount
    runnable: KeySet = field(default_factory=KeySet)
    """The keys it runs: `retryable` and `missing` rollouts."""
    by_attempt: Counter[int] = field(default_factory=Counter)
    """Rollouts to run by their failed attempts so far."""

    @property
    def coverage(self) -> RunCoverage:
        return self.account.coverage

    @property
    def to_run(self) -> int:
        return len(self.runnable)

    def reserved(self) -> str:
        """The rollouts it runs, as the generation that runs them records them."""
        return encode_keys(self.runnable)

    def line(self) -> str:
        """One line of what the shard holds and what the resume runs."""
        c, states = self.coverage, self.coverage.states
        parts = [f"{states[s]} {s}" for s in RECOVERY_STATES if states.get(s)]
        return (
            f"{c.expected} planned: {', '.join(parts) or 'nothing'} (attempt limit "
            f"{c.max_rollout_attempts}); running {self.to_run} (retryable and missing)"
        )


def plan_resume(
    rd: RunDir, shard: str, policy: RecoveryPolicy, manifest: Manifest | None = None
) -> ResumePlan:
    """Read the shard and choose what a resume runs: its `retryable` and `missing` rollouts."""
    account = read_account(rd, shard, policy, "plan", manifest)
    ledger = account.ledger
    plan = ResumePlan(account)
    blocked = {k for k in ledger.latest if state_of(ledger, k, policy) not in RUNNABLE}
    for key in ledger.planned_keys:
        if key in ledger.landed_keys or key in blocked:
            continue
        plan.runnable.add(key)
        plan.by_attempt[ledger.attempts[key]] += 1
    return plan


def rows_to_run(rd: RunDir, shard: str, plan: ResumePlan) -> Iterator[dict[str, Any]]:
    """The planned rows to run again, stamped with `_ng_attempt_index` when they failed before."""
    attempts = plan.account.ledger.attempts
    for row in iter_materialized(rd, shard):
        key = F.rollout_key(row)
        if key not in plan.runnable:
            continue
        if attempts[key] > 0:
            row[F.ATTEMPT_INDEX] = attempts[key]
        yield row


def shards_in(rd: RunDir) -> list[str]:
    """The shard labels of every manifest in the folder, sorted."""
    found = []
    for path in rd.fs.glob(f"{rd.root}/rollouts-*_manifest.json"):
        match = MANIFEST_NAME.match(str(path).rsplit("/", 1)[-1])
        if match:
            found.append(match.group("shard"))
    return sorted(found)


def plan_targets(rd: RunDir, shard: str | None) -> list[tuple[RunDir, str]]:
    """The shards `--plan` reads: the one named, else every shard of the folder, else (a folder
    `rollouts aggregate` merged shards into) each shard its merged-shards record lists, in its
    own folder, verified byte for byte as a recheck verifies them."""
    if shard is not None:
        return [(rd, shard)]
    found = shards_in(rd)
    if found:
        return [(rd, s) for s in found]
    records = merged_records(rd)
    targets = []
    for record in records:
        for source in verify_merged(rd, record):
            match = SHARD_NAME.match(source.name)
            if match:
                targets.append((RunDir(source.dir), match.group(1)))
    if not targets:
        raise UsageError(f"{rd.url}: no shard manifest here (is this a run directory?)")
    return targets


def states_by_key(plan: ResumePlan) -> dict[RecoveryState, list[Key]]:
    """Every expected rollout's key under its state."""
    ledger, policy = plan.account.ledger, plan.account.policy
    out: dict[RecoveryState, list[Key]] = {s: [] for s in RECOVERY_STATES}
    for key in ledger.planned_keys:
        out[state_of(ledger, key, policy)].append(key)
    for keys in out.values():
        keys.sort()
    return out


def show_plan(
    console: Console,
    targets: list[tuple[RunDir, str]],
    policy_of: Callable[[Manifest], RecoveryPolicy],
    as_json: bool,
) -> int:
    """`rollouts resume --plan`: each shard's states and coverage, printed and written beside
    it; nothing is dispatched. `policy_of(manifest)` gives the policy a shard is judged by."""
    out: list[dict[str, Any]] = []
    for rd, shard in targets:
        try:
            manifest = read_manifest(rd, shard)
        except StorageError as exc:
            raise UsageError(str(exc)) from None
        plan = plan_resume(rd, shard, policy_of(manifest), manifest)
        write_coverage(rd, plan.coverage)
        where = rd.path(ShardFiles(shard).coverage)
        if as_json:
            keys = states_by_key(plan)
            out.append(
                {
                    "run_dir": rd.url,
                    "shard": shard,
                    "coverage": plan.coverage.model_dump(mode="json"),
                    "rollouts": {s: [list(k) for k in keys[s]] for s in RECOVERY_STATES},
                    "coverage_file": where,
                }
            )
            continue
        c = plan.coverage
        console.print(f"{escape(manifest.run_id)} shard {escape(shard)}: {escape(plan.line())}")
        console.print(
            f"  coverage: {c.successful} successful ({c.measured} measured, {c.masked} masked, "
            f"{c.unscored} unscored), {c.failed} failed, {c.intentionally_omitted} omitted, "
            f"{c.unknown} unknown; complete {str(c.complete).lower()}; identity verified "
            f"{str(c.identity_verified).lower()}",
            highlight=False,
        )
        if c.superseded_records:
            console.print(f"  {c.superseded_records} late records of older attempts kept apart")
        console.print(f"  written: {escape(where)}", highlight=False)
    if as_json:
        body = out[0] if len(out) == 1 else {"shards": out}
        console.file.write(orjson.dumps(body, option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0
