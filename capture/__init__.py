"""GPU side of routing-replay: the device routing cache, the asynchronous device-to-host copier, the prefix store."""

from routing_replay.capture.cache import RoutingCache
from routing_replay.capture.copier import AsyncCopier, CopierStats, HostRows, PendingRows
from routing_replay.capture.prefix_store import PrefixStore, hit_slots, hit_slots_many
from routing_replay.capture.ring import RingRange, RowRing

__all__ = ["RoutingCache", "AsyncCopier", "CopierStats", "HostRows", "PendingRows", "RingRange", "RowRing",
           "PrefixStore", "hit_slots", "hit_slots_many"]
