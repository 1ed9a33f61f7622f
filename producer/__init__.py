"""Worker-side publisher of per-step routing deltas."""

from routing_replay.producer.config import ProducerConfig
from routing_replay.producer.producer import Producer, ProducerStats, default_producer_id

__all__ = ["Producer", "ProducerConfig", "ProducerStats", "default_producer_id"]
