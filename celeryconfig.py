"""Celery settings for rollout tasks, each with the reason it has that value.

Only Celery settings live here; run settings (timeouts, limits, storage) are the run's own and
travel in the task payloads and the manifest. Addresses come from the environment so that
`celery -A workers.app worker` and `rollouts worker` read the same file.
"""

from infra.broker import transport_for
from infra.environment import from_env, worker_cluster

# A config module is read at import: this is the one import-time read of the environment.
_env = from_env()
_cluster = worker_cluster()

broker_url = _cluster.broker_url
# On Redis, kombu's transport with acks written in batches by a background thread instead of one
# blocking transaction per message on the worker's main thread (infra/broker.py says why).
# Celery's own `-b URL` (CELERY_BROKER_URL) wins over broker_url, so the transport follows it.
broker_transport = transport_for(_env.celery_broker_url or _cluster.broker_url)
# The finish step's result (what the producer waits for) and the recheck chord need a result
# store; Redis also holds the shard locks, landed bits and each generation's count of settled
# rollouts (which publishes its finish, workers/rollout/leases.py), so one server serves both.
result_backend = _cluster.redis_url

# JSON only: a worker must never unpickle a message from the queue (arbitrary code execution).
task_serializer = "json"
result_serializer = "json"
accept_content = ["json"]
result_accept_content = ["json"]

# A rollout is acknowledged after it ran and its record is durable: a worker that dies mid-rollout
# leaves the message to be redelivered, and landing is idempotent, so redelivery is safe.
task_acks_late = True
# With late acks, a prefetched message waits behind a long rollout; take one at a time per slot
# (the rollout pool adds a quarter more, so that a slot freed by a `/run` call that ended is
# refilled while that rollout lands: `PrefetchAhead` in workers/pool.py).
worker_prefetch_multiplier = 1
# A rejected or lost worker child puts the message back rather than dropping it silently.
task_reject_on_worker_lost = True

# Rollouts run up to their time limit (1 h by default); the broker must not redeliver a message
# whose rollout is still running, so its visibility timeout is well above that limit.
VISIBILITY_TIMEOUT_S = _env.visibility_timeout_s
broker_transport_options = {
    "visibility_timeout": VISIBILITY_TIMEOUT_S,
    # The default of 10 connections per channel starves hundreds of threads acking at once;
    # acks then fail and messages are redelivered.
    "max_connections": 4096,
    # How often a worker looks for messages whose holder died (unacked past the visibility
    # timeout): kombu's default sweep (~100 s) only matters with a short timeout, e.g. in tests.
    "unacked_restore_interval": max(1, min(10, VISIBILITY_TIMEOUT_S // 4)),
    "unacked_restore_throttle": 1 if VISIBILITY_TIMEOUT_S < 600 else 10,
}
result_backend_transport_options = {"visibility_timeout": VISIBILITY_TIMEOUT_S}
# Per pool; a worker's result backend pool blocks when they are all busy (workers/app.py).
redis_max_connections = _env.redis_max_connections
broker_connection_retry_on_startup = True
# A connection blip must not abandon rollouts that are running: they land their records
# (idempotently) and the broker redelivers what could not be acknowledged.
worker_cancel_long_running_tasks_on_connection_loss = False

# Runs last days; the finish step's result must outlive them.
result_expires = 7 * 24 * 3600

# Rollouts wait on HTTP, not on the CPU: each in-flight rollout is a coroutine on the process's
# event loop (workers/pool.py), so `-c` in the thousands costs coroutines, not threads.
# `celery worker -P threads` still works (a thread per rollout).
worker_pool = "workers.pool:RolloutPool"
worker_concurrency = _env.worker_concurrency

task_default_queue = "rollouts"
# Rollout identities are not secrets, but payloads are large: keep them out of events and logs.
task_send_sent_event = False
worker_send_task_events = _env.task_events
task_track_started = False
worker_hijack_root_logger = False
