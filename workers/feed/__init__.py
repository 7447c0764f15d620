"""The feed's worker side: landed rollouts enter their run's feed in the commit that lands them
(`publish`), a rollout of a full feed waits before it starts (`backpressure`), and a feed is
rebuilt from the shard's files after Redis lost it (`rebuild`)."""

from workers.feed.backpressure import FeedGate
from workers.feed.publish import Landed, queue_members
from workers.feed.rebuild import rebuild_feed

__all__ = ["FeedGate", "Landed", "queue_members", "rebuild_feed"]
