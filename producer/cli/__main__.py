"""`python -m producer.cli`: the `rollouts` command line."""

from producer.cli.commands import main

main()
