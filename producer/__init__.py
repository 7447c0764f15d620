"""Planning, dispatch and the `rollouts` command line."""
