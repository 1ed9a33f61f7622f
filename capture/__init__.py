"""GPU side of routing-replay: the device routing cache and the asynchronous device-to-host copier."""

from capture.cache import RoutingCache
from capture.copier import AsyncCopier, CopierStats, PendingRows
from capture.ring import RowRing

__all__ = ["RoutingCache", "AsyncCopier", "CopierStats", "PendingRows", "RowRing"]
