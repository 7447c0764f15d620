"""The feed's worker side: landed rollouts enter their run's feed in the commit that lands them
(`publish`)."""
