"""The services' settings as objects (ProducerConfig, BrokerConfig, ConsumerConfig): keyword arguments build the
same config as `config=`, arguments given with a config replace its fields, and a bad value is refused by the
config with an error naming it, before any socket or thread exists."""

from __future__ import annotations

import dataclasses
import uuid

import pytest
import zmq

from routing_replay.broker import Broker, BrokerConfig
from routing_replay.consumer import Consumer, ConsumerConfig
from routing_replay.producer import Producer, ProducerConfig


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


def test_keyword_arguments_and_config_build_the_same_services(ctx):
    ep = f"inproc://cfg-{uuid.uuid4().hex[:8]}"
    cfg = ProducerConfig(ep, num_layers=4, top_k=2, linger_ms=0, coalesce_max_bytes=0)
    for p in (Producer(ep, num_layers=4, top_k=2, linger_ms=0, coalesce_max_bytes=0, context=ctx),
              Producer(config=cfg, context=ctx)):
        try:
            assert p.config == cfg and (p.row_bytes, p.linger_ms, p.heartbeat_interval_s) == (16, 0, 1.0)
        finally:
            p.close(0)
    p = Producer(config=cfg, context=ctx, layer_range=(1, 3), producer_id="p-1")     # arguments replace fields
    try:
        assert (p.config.layer_range, p.config.linger_ms, p.producer_id, p.row_bytes) == ((1, 3), 0, "p-1", 8)
        assert cfg.layer_range is None                                                # the config is not changed
    finally:
        p.close(0)
    b = Broker(f"{ep}-f", f"{ep}-b", context=ctx, liveness=5)
    assert b.config == BrokerConfig(f"{ep}-f", f"{ep}-b", liveness=5) and b.liveness == 5
    assert Broker(config=b.config, context=ctx, ack_interval_ms=40).ack_interval_s == 0.04
    c = Consumer(f"{ep}-b", context=ctx, max_bytes=1 << 20, finish_grace_s=0)
    assert c.config == ConsumerConfig(f"{ep}-b", max_bytes=1 << 20, finish_grace_s=0)
    assert (c.acc.max_bytes, c.acc.finish_grace_s) == (1 << 20, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.top_k = 3


@pytest.mark.parametrize("make, match", [
    (lambda: ProducerConfig("inproc://x", num_layers=0, top_k=2), r"num_layers=0 top_k=2 outside protocol limits"),
    (lambda: ProducerConfig("inproc://x", num_layers=4, top_k=2, layer_range=(2, 9)),
     r"layer_range \(2, 9\) not inside \[0, 4\]"),
    (lambda: ProducerConfig("inproc://x", num_layers=4, top_k=2, max_queue_bytes=-1),
     r"max_queue_bytes=-1 must be an integer >= 0"),
    (lambda: ProducerConfig("inproc://x", num_layers=4, top_k=2, heartbeat_interval_ms=0),
     r"heartbeat_interval_ms=0 must be an integer >= 1"),
    (lambda: ProducerConfig("inproc://x", num_layers=4, top_k=2, linger_ms=1.5),
     r"linger_ms=1.5 must be an integer >= 0"),
    (lambda: ProducerConfig("inproc://x", num_layers=4, top_k=2, curve_secret="k"), r"CURVE needs both"),
    (lambda: BrokerConfig("inproc://f", "inproc://b", liveness=0), r"liveness=0 must be an integer >= 1"),
    (lambda: BrokerConfig("inproc://f", "inproc://b", stats_interval_s=float("nan")),
     r"stats_interval_s=nan must be a finite number of seconds > 0"),
    (lambda: BrokerConfig("inproc://f", "inproc://b", open_group_max=-2), r"open_group_max must be in .* got -2"),
    (lambda: BrokerConfig("inproc://f", "inproc://b", restart_grace_ms="1s"),
     r"restart_grace_ms='1s' must be an integer >= 0 or None"),
    (lambda: ConsumerConfig("inproc://b", keep_bytes=-1), r"keep_bytes=-1 must be an integer >= 0 or None"),
    (lambda: ConsumerConfig("inproc://b", finish_grace_s=-0.5),
     r"finish_grace_s=-0.5 must be a finite number of seconds >= 0"),
    (lambda: ConsumerConfig("inproc://b", consumer_id=""), r"consumer id must be 1..255 bytes"),
    (lambda: ConsumerConfig("inproc://b", serve="tcp://127.0.0.1:1", curve_secret="s", broker_key="k"),
     r"serving trainers over CURVE needs curve_allow"),
])
def test_a_bad_value_is_refused_naming_it(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_a_service_refuses_a_bad_value_before_it_starts_anything(ctx):
    with pytest.raises(ValueError, match=r"sndhwm=-5 must be an integer >= 0"):
        Producer("inproc://nothing", num_layers=4, top_k=2, sndhwm=-5, context=ctx)
    with pytest.raises(TypeError, match="unexpected keyword argument 'nonsense'"):
        Broker("inproc://f", "inproc://b", nonsense=1, context=ctx)
    with pytest.raises(ValueError, match=r"ack_interval_ms=0 must be an integer >= 1"):
        Consumer(config=ConsumerConfig("inproc://b"), ack_interval_ms=0, context=ctx)
