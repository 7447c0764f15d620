"""A shard's ledger: its files read as outcomes (`ledger`), its Redis state hash (`state`)."""

from workers.shard.ledger import Failure, ShardLedger, count_shard, iter_rows
from workers.shard.state import ShardState, read_state, write_state

__all__ = [
    "Failure",
    "ShardLedger",
    "ShardState",
    "count_shard",
    "iter_rows",
    "read_state",
    "write_state",
]
