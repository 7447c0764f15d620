"""The `rollouts` command line (the `rollouts` console script is `producer.cli:main`)."""

from producer.cli.commands import main

__all__ = ["main"]
