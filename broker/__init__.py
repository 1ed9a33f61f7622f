"""Broker: route routing-replay messages by request id to the consumer that owns the request."""

from routing_replay.broker.broker import Broker, BrokerStats
from routing_replay.broker.config import BrokerConfig

__all__ = ["Broker", "BrokerConfig", "BrokerStats"]
