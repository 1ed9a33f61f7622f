"""The protocol is documented twice, once each way: the frame layout in protocol/wire.py's module docstring, the
semantics in docs/PROTOCOL.md. Every kind and every body field the code reads or writes appears in both."""

import re
from pathlib import Path

import msgpack

from routing_replay.protocol import wire

REPO = Path(__file__).resolve().parent.parent
LAYOUT = wire.__doc__
SEMANTICS = (REPO / "docs" / "PROTOCOL.md").read_text()


def _code_fields() -> set:
    """Body fields the parsers read (int_field / .get) and the builders write."""
    src = (REPO / "protocol" / "wire.py").read_text()
    src = src[src.index('"""', src.index('"""') + 3):]                      # the code, not the docstring
    fields = set(re.findall(r'(?:int_field\(\w+(?:\.body)?, |\.get\()"(\w+)"', src))
    fields |= set(wire.delta_body([0], [1], 4, 2, 1, 3))
    fields |= set(wire.producer_ack_body(wire.ProducerAck(1, 2, True, 3, True, (["r"], [1]))))
    fields |= set(wire.link_ack_body(wire.LinkAck(1, 2, 3, 4)))
    rec = wire.Record("r", wire.np.zeros((1, 1, 1), "<i2"), wire.np.zeros((1, 1, 1), "<i2"), 0,
                      wire.np.zeros(1, "<i4"), True)
    fields |= set(msgpack.unpackb(wire.encode_record(rec, "c", 0)[0], raw=False)[6])
    return fields


def test_every_body_field_is_in_the_layout_and_the_semantics():
    fields = _code_fields()
    assert {"prompt_len", "layer_ids", "expect", "hello", "gap", "timeout_ms", "subscribe"} <= fields, fields
    assert not [f for f in sorted(fields) if not re.search(rf"\b{f}\b", LAYOUT)], "missing from wire.py's docstring"
    assert not [f for f in sorted(fields) if not re.search(rf"\b{f}\b", SEMANTICS)], "missing from docs/PROTOCOL.md"


def test_every_kind_is_in_the_layout_and_the_semantics():
    assert not [k for k in sorted(wire.KINDS) if not re.search(rf"^\s+{k}\b", LAYOUT, re.M)], "wire.py docstring"
    assert not [k for k in sorted(wire.KINDS) if f"| `{k}` |" not in SEMANTICS and f"`{k}`," not in SEMANTICS]
