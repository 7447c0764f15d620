"""`python -m workers.launch [OPTIONS]`: a worker process, started as `celery -A workers.app worker
[OPTIONS]` starts it, without Celery's umbrella command.

`celery` loads every installed `celery.commands` plugin before it reads its arguments: Flower
(with Tornado) and the REPL's prompt_toolkit, about 0.3 s of a worker's 1.7 s start on a 2-core
machine, for commands a worker never runs. This runs Celery's own `worker` command (the same
options, environment variables, checks and start-up) with the app given instead, so every
option of `celery worker` means the same here. `rollouts worker` and local clusters start their
workers this way; `celery -A workers.app worker` works as before.

`--quiet` (or `-q`) first is the umbrella's quiet flag. A `--detach` goes through the umbrella
command: Celery's detach starts `python -m celery` again with this process's arguments.
"""

from __future__ import annotations

import os
import sys

from celery import maybe_patch_concurrency

__all__ = ["main"]

DETACH = ("-D", "--detach")


def main(argv: list[str] | None = None) -> None:
    """Start a worker of `workers.app` with `argv` (default: this process's arguments)."""
    args = list(sys.argv[1:] if argv is None else argv)
    quiet = bool(args) and args[0] in ("-q", "--quiet")
    if quiet:
        args = args[1:]
    if any(a in DETACH for a in args):
        umbrella = ["--quiet"] if quiet else []
        os.execv(
            sys.executable,
            [sys.executable, "-m", "celery", *umbrella, "-A", "workers.app", "worker", *args],
        )
    maybe_patch_concurrency(["celery", "worker", *args])

    from celery.bin.base import CLIContext
    from celery.bin.worker import worker

    from workers.app import app

    # What the umbrella command does between finding the app and running `worker`: the app's
    # own worker options (`app.user_options`), then the context every command reads.
    worker.params.extend(app.user_options.get("worker", []))
    context = CLIContext(
        app=app, no_color=bool(os.environ.get("NO_COLOR")), workdir=None, quiet=quiet
    )
    worker.main(
        args=args, prog_name="rollouts worker", obj=context, auto_envvar_prefix="CELERY_WORKER"
    )


if __name__ == "__main__":
    main()
