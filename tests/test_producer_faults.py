"""The producer on real sockets under bad input and bad brokers: a request id that cannot travel, a broker that
refuses one message (error with refused_seq), a broker that never answers or refuses the handshake."""

from __future__ import annotations

import logging
import re
import time

import numpy as np
import pytest
import zmq

from routing_replay.broker import Broker
from routing_replay.producer import Producer
from routing_replay.protocol import security, wire

L, K = 2, 2
BAD = "req-\udc80-lone"          # a lone surrogate: no UTF-8 encoding


def rows(n: int, base: int = 0) -> np.ndarray:
    return (np.arange(n * L * K, dtype=np.int16) + base).reshape(n, L, K)


class FakeBroker:
    """A ROUTER the test owns, playing the broker with hand-built replies."""

    def __init__(self, ctx: zmq.Context, endpoint: str):
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.epoch = 777
        self.ident: bytes | None = None

    def recv(self, timeout_s: float = 10.0) -> tuple[wire.Header, list]:
        """The next message from the producer (control messages answered like a broker: heartbeat)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.sock.poll(50):
                continue
            ident, *frames = self.sock.recv_multipart()
            self.ident = ident
            h = wire.decode_header(frames[0])
            if h.kind in ("hello", "heartbeat"):
                self.reply("heartbeat", {"consumers": 1})
                continue
            return h, frames[1:]
        raise TimeoutError("no data message from the producer")

    def reply(self, kind: str, body: dict) -> None:
        self.sock.send_multipart([self.ident, wire.pack_header(kind, "broker", self.epoch, 0, "p", body)])

    def close(self) -> None:
        self.sock.close(0)


def wait_for(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.term()


@pytest.fixture
def fake_and_producer(ctx, tmp_path):
    """A FakeBroker and a Producer connected to it (closed after the test)."""
    fake = FakeBroker(ctx, f"ipc://{tmp_path}/f")
    p = Producer(f"ipc://{tmp_path}/f", num_layers=L, top_k=K, context=ctx, linger_ms=0)
    yield fake, p
    p.close(timeout_s=1)
    fake.close()


def test_a_bad_request_id_is_refused_at_open_and_never_stops_the_stream(fake_and_producer):
    fake, p = fake_and_producer
    with pytest.raises(wire.ProtocolError) as err:
        p.open(BAD, prompt_len=4)
    assert err.value.reason == "bad_request_id" and "'req-\\udc80-lone'" in str(err.value)
    with pytest.raises(wire.ProtocolError, match="bad_request_id|1025 characters"):
        p.open("x" * 1025, prompt_len=1)
    # its parts are dropped and counted, never raised; a step shared with a good request keeps the good part
    assert p.publish_rows([BAD], [0], [4], rows(4)) is True
    p.open("good", prompt_len=4)
    assert p.publish_rows([BAD, "good", 7], [0, 0, 0], [2, 4, 1], rows(7)) is True
    p.finish(BAD, num_output_tokens=1)
    p.abort(BAD)
    p.finish("good", num_output_tokens=1)
    assert p.stats.dropped_parts == 1 + 2 + 1 + 1
    got = [fake.recv() for _ in range(3)]
    assert [(h.kind, h.seq, h.key) for h, _ in got] == [("open", 1, "good"), ("delta", 2, ["good"]),
                                                        ("finish", 3, "good")]
    d = wire.parse_delta(got[1][0])
    assert d.starts.tolist() == [0] and d.counts.tolist() == [4]
    assert got[1][1][0] == rows(7)[2:6].tobytes()
    assert "lost" not in got[2][0].body
    assert p.stats.encode_errors == 0 and p.failure is None
    p.open("after", prompt_len=1)                       # the thread still takes work
    assert fake.recv()[0].key == "after"


def test_open_many_and_end_many_send_what_open_finish_and_abort_send_and_refuse_only_the_bad_items(
        fake_and_producer):
    """A step's opens and ends in one call each (the vLLM plugin's path): the same messages as one call per request,
    in order, token lists copied at the call; an item open() would raise for is returned with its error, its id
    refused (its later parts dropped and counted), and the other items still go."""
    fake, p = fake_and_producer
    toks = [5, 6, 7]
    failed = p.open_many([("a", 3, 1, toks, False), (BAD, 2, 0, None, False), ("b", 2, 3, None, False),
                          ("c", 4, 0, np.array([1, 2, 3, 4]), True), ("d", 2.0, 0, None, False)])
    toks[0] = 99
    assert [(i, type(e).__name__) for i, e in failed] == [(1, "ProtocolError"), (2, "ValueError"),
                                                          (4, "ValueError")]
    assert failed[0][1].reason == "bad_request_id" and "num_cached_tokens=3 outside" in str(failed[1][1])
    assert p.publish_rows(["a", "b", "c"], [1, 0, 0], [2, 2, 4], rows(8)) is True
    with pytest.raises(ValueError, match="end kind"):
        p.end_many([("finish", "a", 1, "stop", None), ("close", "c", 1, "stop", None)])
    with pytest.raises(ValueError, match="must be an int"):
        p.end_many([("finish", "a", None, "stop", None)])
    out = [4, 4]
    assert p.end_many([("finish", "a", 2, "length", out), ("abort", "b", None, "abort", None),
                       ("abort", "c", 0, "abort", None), ("finish", BAD, 1, "stop", None)]) == 2
    out[0] = 0
    assert p.stats.dropped_parts == 2 + 1          # b's rows and its abort (refused at open); BAD's finish
    got = [fake.recv() for _ in range(5)]
    assert [(h.kind, h.seq, h.key) for h, _ in got] == [("open", 1, "a"), ("open", 2, "c"), ("delta", 3, ["a", "c"]),
                                                        ("finish", 4, "a"), ("abort", 5, "c")]
    (ha, fa), (hc, fc) = got[:2]
    assert ha.body == {"prompt_len": 3, "num_cached": 1, "num_layers": L, "top_k": K, "layer_ids": [0, 1],
                       "n_prompt_tokens": 3}
    assert bytes(fa[0]) == np.array([5, 6, 7], "<i4").tobytes()
    assert hc.body["prefix_filled"] is True and bytes(fc[0]) == np.array([1, 2, 3, 4], "<i4").tobytes()
    d = wire.parse_delta(got[2][0])
    assert d.starts.tolist() == [1, 0] and d.counts.tolist() == [2, 4]
    assert bytes(got[2][1][0]) == np.concatenate([rows(8)[:2], rows(8)[4:]]).tobytes()
    assert got[3][0].body == {"num_output": 2, "reason": "length", "n_output_tokens": 2}
    assert bytes(got[3][1][0]) == np.array([4, 4], "<i4").tobytes()
    assert got[4][0].body == {"reason": "abort", "num_output": 0}
    assert p.queued_msgs == 0 and p.stats.encode_errors == 0 and p.failure is None


def test_frozen_token_lists_go_by_reference_and_travel_exact(fake_and_producer, caplog):
    """tokens_frozen=True (the vLLM plugin: prompt lists vLLM never modifies, output lists the scheduler hook made):
    open_many and end_many take the lists as they are (no copy on the caller's thread: a copy writes every id's
    reference count), the producer's thread converts them, and the messages carry exactly the ids; ids that are
    not int32 leave the token frame out as a copied list does, the message still going."""
    from routing_replay.producer import producer as pmod

    ids = list(range(1 << 15, 1 << 16))                 # a 32K-token prompt: ints above the small-int cache
    assert pmod._tokens(ids, True) is ids and pmod._tokens(ids) is not ids and pmod._tokens(ids) == tuple(ids)
    fake, p = fake_and_producer
    out = [2**31 - 1, 0, 7]
    wide = [1, 2**40]                                   # not int32
    assert p.open_many([("a", len(ids), 0, ids, False), ("w", 2, 0, wide, False)], ids_checked=True,
                       tokens_frozen=True) == []
    assert p.end_many([("finish", "a", 3, "stop", out), ("finish", "w", 2, "stop", wide)], tokens_frozen=True) == 2
    with caplog.at_level(logging.WARNING, logger="routing_replay.producer"):
        got = [fake.recv() for _ in range(4)]
    assert [(h.kind, h.key) for h, _ in got] == [("open", "a"), ("open", "w"), ("finish", "a"), ("finish", "w")]
    (ha, fa), (hw, fw), (fh, ff), (wh, wf) = got
    assert ha.body["n_prompt_tokens"] == len(ids) and bytes(fa[0]) == np.array(ids, "<i4").tobytes()
    assert fh.body["n_output_tokens"] == 3 and bytes(ff[0]) == np.array(out, "<i4").tobytes()
    assert "n_prompt_tokens" not in hw.body and fw == [] and "n_output_tokens" not in wh.body and wf == []
    assert p.queued_msgs == 0 and p.failure is None


@pytest.mark.parametrize("frozen", [False, True])
def test_open_many_items_the_thread_cannot_build_are_dropped_alone_and_counted(fake_and_producer, caplog, frozen):
    """An id passed as checked that cannot travel fails on the producer's thread: that open is logged, counted and
    its id refused; the others of the same call go, and the queue count comes back to 0. Token ids that are no
    sequence fail at the call, returned like open()'s errors, and so do lengths out of range; end_many refuses
    them before taking anything. The same with tokens_frozen (the vLLM worker's call, whose sound items are taken
    in one pass)."""
    fake, p = fake_and_producer
    with caplog.at_level(logging.WARNING, logger="routing_replay.producer"):
        failed = p.open_many([("a", 2, 0, None, False), (BAD, 2, 0, None, False), ("b", 2, 0, object(), False),
                              ("c", 2, 0, [1, 2], False), ("d", 2, 3, None, False)], ids_checked=True,
                             tokens_frozen=frozen)
        got = [fake.recv() for _ in range(2)]
    assert [(i, type(e).__name__) for i, e in failed] == [(2, "TypeError"), (4, "ValueError")]
    assert [(h.kind, h.key) for h, _ in got] == [("open", "a"), ("open", "c")]
    assert p.stats.encode_errors == 1 and p.queued_msgs == 0
    assert any("dropped the open of request 'req-\\udc80-lone' it could not build (1 so far)" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    p.publish_rows([BAD, "b", "c", "d"], [0, 0, 0, 0], [1, 2, 2, 1], rows(6))
    assert fake.recv()[0].key == ["c"]
    with pytest.raises(ValueError, match="output token ids of a finish: TypeError"):
        p.end_many([("finish", "a", 1, "stop", None), ("finish", "c", 1, "stop", object())], tokens_frozen=frozen)
    with pytest.raises(ValueError, match="must be an int"):
        p.end_many([("finish", "a", 1, "stop", None), ("finish", "c", 1.0, "stop", [1])], tokens_frozen=frozen)
    assert p.end_many([("finish", "a", 1, "stop", None)], tokens_frozen=frozen) == 1   # nothing refused was taken
    assert fake.recv()[0].kind == "finish" and p.stats.dropped_parts == 3


def test_a_failed_deferred_result_drops_its_message_and_reports_the_loss(fake_and_producer):
    class Broken:
        shape = (3, L, K)
        dtype = np.int16
        released = 0

        def result(self):
            raise RuntimeError("device copy failed")

        def release(self):
            Broken.released += 1

    fake, p = fake_and_producer
    p.open("a", prompt_len=3)
    p.publish_rows(["a"], [0], [3], Broken())
    wait_for(lambda: p.stats.encode_errors == 1)
    p.publish_rows(["a"], [3], [1], rows(1))
    p.finish("a", num_output_tokens=2)
    got = [fake.recv() for _ in range(3)]
    assert [(h.kind, h.seq) for h, _ in got] == [("open", 1), ("delta", 2), ("finish", 3)]
    assert got[2][0].body["lost"] == [[0, 3]] and Broken.released == 1


def test_a_refused_delta_is_reported_lost_and_a_refused_open_drops_its_request(ctx, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="routing_replay.producer")
    fake = FakeBroker(ctx, f"ipc://{tmp_path}/f")
    p = Producer(f"ipc://{tmp_path}/f", num_layers=L, top_k=K, context=ctx, linger_ms=0,
                 coalesce_max_bytes=0)      # one message per publish: seq 3 and 4 below
    try:
        p.open("a", prompt_len=8)
        p.open("b", prompt_len=2)
        p.publish_rows(["a", "b"], [0, 0], [4, 2], rows(6))
        p.publish_rows(["a"], [4], [4], rows(4))
        got = [fake.recv() for _ in range(4)]
        assert [(h.kind, h.seq) for h, _ in got] == [("open", 1), ("open", 2), ("delta", 3), ("delta", 4)]
        # a plain error (no refused_seq) is logged as before and changes nothing
        fake.reply("error", {"reason": "bad_field: something"})
        # the broker could not decode seq 3 (the shared delta) and seq 2 (b's open): it says so
        fake.reply("error", {"reason": "undecodable: test", "refused_seq": 3, "epoch": p.epoch})
        fake.reply("error", {"reason": "undecodable: test", "refused_seq": 2, "epoch": p.epoch})
        fake.reply("error", {"reason": "stale", "refused_seq": 1, "epoch": p.epoch + 1})   # another epoch: ignored
        fake.reply("ack", {"epoch": p.epoch, "upto": 4})
        wait_for(lambda: p.stats.refused_by_broker == 2 and p.unacked_msgs == 0)
        assert p.stats.errors_from_broker == 4
        p.publish_rows(["b", "a"], [2, 8], [1, 1], rows(2))        # b was refused: its part is dropped
        p.finish("b", num_output_tokens=1)
        p.finish("a", num_output_tokens=2)
        got = [fake.recv() for _ in range(2)]
        assert [(h.kind, h.seq, h.key) for h, _ in got] == [("delta", 5, ["a"]), ("finish", 6, "a")]
        assert (got[1][0].body["lost"], got[1][0].body["broker_refused"]) == ([[0, 4]], [[0, 4]])
        assert "refused" not in got[1][0].body
        assert p.stats.dropped_parts == 2
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(re.search(r"broker refused seq=3 kind=delta requests=2 rows=6 .*undecodable: test", m)
                   for m in warnings), warnings
        assert any("broker refused seq=2 kind=open request='b'" in m for m in warnings), warnings
        assert any("broker refused a message: bad_field: something" in r.getMessage() for r in caplog.records
                   if r.levelno == logging.ERROR)
    finally:
        p.close(timeout_s=1)
        fake.close()


def _silence_lines(caplog) -> list:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "no answer from broker" in r.getMessage()]


def test_nothing_listening_is_said_with_the_numbers(ctx, caplog, tmp_path):
    caplog.set_level(logging.INFO, logger="routing_replay.producer")
    # an ipc path nobody binds: a closed tcp port can be taken by another process's socket (or a tcp self-connect)
    # before the producer dials it, and then the report rightly says connections=1 (seen once in CI)
    p = Producer(f"ipc://{tmp_path}/nobody-listens", num_layers=L, top_k=K, context=ctx, linger_ms=0,
                 replay_max_bytes=1 << 20, silence_warn_after_ms=200, silence_warn_every_ms=200)
    try:
        p.open("a", prompt_len=4)
        p.publish_rows(["a"], [0], [4], rows(4))
        wait_for(lambda: p.unacked_msgs == 2)
        nbytes = p.replay_bytes
        n0 = len(_silence_lines(caplog))                  # reports from before both messages were taken in
        wait_for(lambda: len(_silence_lines(caplog)) >= n0 + 2)
        lines = _silence_lines(caplog)
        for i, line in enumerate(lines[n0:n0 + 2]):
            m = re.search(r"for (\d+\.\d)s \(report (\d+); connections=0 .*\): unacked=(\d+) msgs "
                          r"unacked_bytes=(\d+) \(memory (\d+) \+ spill 0\) bound=(\d+)\+0 bytes", line)
            assert m, line
            assert int(m[2]) == n0 + i + 1 and float(m[1]) >= 0.2
            assert (int(m[3]), int(m[4]), int(m[6])) == (2, nbytes, 1 << 20)
        assert not [r for r in caplog.records if "broker answered" in r.getMessage()]
    finally:
        p.close(timeout_s=0.5)


def test_a_curve_broker_refusing_a_plaintext_producer_is_said(ctx, tmp_path, caplog):
    if not zmq.has("curve"):
        pytest.skip("libzmq without CURVE")
    caplog.set_level(logging.INFO, logger="routing_replay.producer")
    security.create_keys(tmp_path, "broker")
    security.create_keys(tmp_path, "engine")
    (tmp_path / "allow").mkdir()
    (tmp_path / "allow" / "engine.key").write_bytes((tmp_path / "engine.key").read_bytes())
    b = Broker("tcp://127.0.0.1:*", f"ipc://{tmp_path}/b", curve_secret=str(tmp_path / "broker.key_secret"),
               curve_allow=str(tmp_path / "allow")).start()
    p = Producer(b.frontend, num_layers=L, top_k=K, context=ctx, linger_ms=0, silence_warn_after_ms=300,
                 silence_warn_every_ms=10_000)
    try:
        p.open("a", prompt_len=4)
        wait_for(lambda: len(_silence_lines(caplog)) >= 1)
        m = re.search(r"report 1; connections=0 .*\): unacked=1 msgs", _silence_lines(caplog)[0])
        assert m, _silence_lines(caplog)[0]
    finally:
        p.close(timeout_s=0.5)
        b.close()


def test_a_reachable_broker_gives_one_startup_line(ctx, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="routing_replay.producer")
    b = Broker(f"ipc://{tmp_path}/f", f"ipc://{tmp_path}/b", context=ctx).start()
    p = Producer(b.frontend, num_layers=L, top_k=K, context=ctx, linger_ms=0, silence_warn_after_ms=5000)
    try:
        wait_for(lambda: any("broker answered" in r.getMessage() for r in caplog.records))
        lines = [r.getMessage() for r in caplog.records if "broker answered" in r.getMessage()]
        assert len(lines) == 1 and re.search(r"broker answered at ipc://\S+ in \d+ ms copy=", lines[0]), lines
        from routing_replay.producer import outpool as messages
        assert lines[0].endswith(f" copy={'native' if messages.NATIVE else 'numpy'}"), lines
        assert lines[0].startswith(f"producer {p.producer_id}: ")
        assert not _silence_lines(caplog)
    finally:
        p.close(timeout_s=0.5)
        b.close()


class _Deferred:
    """A deferred rows object (as capture's PendingRows): result() waits for `gate`, or raises `error`."""

    def __init__(self, rows_: np.ndarray, gate=None, error=None):
        import threading
        self._rows, self._gate, self._error = rows_, gate, error
        self.shape, self.dtype, self.dropped = rows_.shape, rows_.dtype, False
        self.released = 0
        self.entered = threading.Event()

    def result(self):
        self.entered.set()
        if self._gate is not None:
            assert self._gate.wait(10)
        if self._error is not None:
            raise self._error
        return self._rows

    def release(self):
        self.released += 1


def test_steps_queued_together_leave_as_one_delta_and_a_failed_one_is_reported_lost(ctx, tmp_path):
    """While the thread waits on one step's rows, three more steps queue up: they leave as one delta (entries in
    order, one payload frame per step, bit for bit); the one whose rows cannot be had is left out and its positions
    are reported lost in its request's finish; every deferred slot is released once."""
    import threading
    fake = FakeBroker(ctx, f"ipc://{tmp_path}/f")
    p = Producer(f"ipc://{tmp_path}/f", num_layers=L, top_k=K, context=ctx, linger_ms=0)
    gate = threading.Event()
    try:
        p.open("a", prompt_len=1)
        p.open("b", prompt_len=1)
        first = _Deferred(rows(2, 100), gate)
        p.publish_rows(["a", "b"], [0, 0], [1, 1], first)
        assert first.entered.wait(10)                                     # the thread waits on its rows
        later = [_Deferred(rows(2, 200)), _Deferred(rows(1, 300), error=RuntimeError("lost hook")),
                 _Deferred(rows(3, 400))]
        p.publish_rows(np.array(["a", "b"]).tolist(), np.array([1, 1], np.int32), np.array([1, 1], np.int64),
                       later[0])
        p.publish_rows(["a"], [2], [1], later[1])
        p.publish_rows(["b", "a", "b"], np.array([2, 3, 3]), [1, 1, 1], later[2])
        gate.set()
        got = [fake.recv() for _ in range(4)]
        assert [h.kind for h, _ in got[:2]] == ["open", "open"]
        (h1, f1), (h2, f2) = got[2:]
        assert (h1.kind, h1.seq, h1.key) == ("delta", 3, ["a", "b"])
        assert (h2.kind, h2.seq, h2.key) == ("delta", 4, ["a", "b", "b", "a", "b"])
        d2 = wire.parse_delta(h2)
        assert d2.starts.tolist() == [1, 1, 2, 3, 3] and d2.counts.tolist() == [1, 1, 1, 1, 1]
        assert [bytes(f) for f in f2] == [rows(2, 200).tobytes(), rows(3, 400).tobytes()]
        wire.check_payload(d2, f2)
        assert [d.released for d in [first, *later]] == [1, 1, 1, 1]
        assert p.stats.encode_errors == 1
        p.finish("a", num_output_tokens=5)
        h, _ = fake.recv()
        assert (h.kind, h.key, h.body.get("lost")) == ("finish", "a", [[2, 3]])
    finally:
        gate.set()
        p.close(timeout_s=1)
        fake.close()


def test_publish_rows_takes_numpy_positions_and_refuses_bad_ones(fake_and_producer):
    fake, p = fake_and_producer
    p.open("a", prompt_len=2)
    for bad in (np.array([[0]]), np.array([0.0])):
        with pytest.raises(ValueError, match="1-D integer array"):
            p.publish_rows(["a"], bad, [1], rows(1))
    with pytest.raises(ValueError, match="1-D integer array"):
        p.publish_rows(["a"], [0], np.array([1.0]), rows(1))
    p.publish_rows(["a"], np.array([0], np.int32), np.array([2], np.uint16), rows(2, 5))
    got = [fake.recv() for _ in range(2)]
    h, f = got[1]
    d = wire.parse_delta(h)
    assert (h.kind, d.starts.tolist(), d.counts.tolist()) == ("delta", [0], [2])
    assert bytes(f[0]) == rows(2, 5).tobytes()


def test_publish_steps_sends_what_publish_rows_sends_for_the_flattened_steps(fake_and_producer):
    """Per-step references (a key list two steps share, positions as arrays or lists) leave as the one delta
    publish_rows makes of the flattened lists; an id that cannot travel falls back to publish_rows' per-entry
    screen (its part dropped and counted, the rest kept); bad shapes are refused on the caller's thread."""
    fake, p = fake_and_producer
    p.open("a", prompt_len=3)
    p.open("b", prompt_len=2)
    shared = ["a", "b"]
    steps = (shared, shared, ["b"])
    starts = (np.array([3, 2], np.int32), np.array([4, 3], np.int64), [4])
    counts = (np.array([1, 1], np.int32), np.array([1, 2], np.int32), [1])
    assert p.publish_steps(steps, starts, counts, rows(6, 40)) is True
    got = [fake.recv() for _ in range(3)]
    assert p.publish_steps([["a", BAD]], [np.array([5, 0])], [np.array([2, 1])], rows(3, 80)) is True
    assert p.stats.dropped_parts == 1
    for bad, match in ((([["a"]], [[0]], [np.array([1.0])], rows(1)), "1-D integer array"),
                       (([["a"], ["b"]], [[0]], [[1]], rows(1)), "one per step"),
                       (([["a", "b"]], [[0]], [[1]], rows(1)), "a step of 2 request ids"),
                       (([["a"]], [np.array([0])], [np.array([2])], rows(1)), "counts add up to 2")):
        with pytest.raises(ValueError, match=match):
            p.publish_steps(*bad)
    got.append(fake.recv())
    assert [(h.kind, h.key) for h, _ in got] == [("open", "a"), ("open", "b"), ("delta", ["a", "b", "a", "b", "b"]),
                                                 ("delta", ["a"])]
    d = wire.parse_delta(got[2][0])
    assert (d.starts.tolist(), d.counts.tolist()) == ([3, 2, 4, 3, 4], [1, 1, 1, 2, 1])
    assert b"".join(bytes(f) for f in got[2][1]) == rows(6, 40).tobytes()
    d = wire.parse_delta(got[3][0])
    assert (d.starts.tolist(), d.counts.tolist()) == ([5], [2]) and bytes(got[3][1][0]) == rows(3, 80)[:2].tobytes()


def test_token_id_lists_are_copied_at_the_call_and_converted_on_the_thread(fake_and_producer):
    """Token ids given as a list or tuple are copied on the caller's thread (changing the list afterwards changes
    nothing sent) and become int32 on the producer's thread; ids that are not int32 integers leave the open or
    finish without token ids (counted, and the request's routing still travels); arrays are converted at once."""
    fake, p = fake_and_producer
    toks = [5, 6, 70000]
    p.open("a", prompt_len=3, prompt_token_ids=toks)
    toks[0] = 99
    p.open("b", prompt_len=2, prompt_token_ids=[1, "x"])
    p.open("c", prompt_len=2, prompt_token_ids=np.array([3, 4], np.int64))
    p.publish_rows(["b"], [0], [2], rows(2, 7))
    p.finish("a", num_output_tokens=2, output_token_ids=(9, 2 ** 40))
    p.finish("b", num_output_tokens=1, output_token_ids=(8,))
    got = [fake.recv() for _ in range(6)]
    assert [(h.kind, h.key) for h, _ in got] == [("open", "a"), ("open", "b"), ("open", "c"), ("delta", ["b"]),
                                                 ("finish", "a"), ("finish", "b")]
    (ha, fa), (hb, fb), (hc, fc) = got[:3]
    assert ha.body["n_prompt_tokens"] == 3 and bytes(fa[0]) == np.array([5, 6, 70000], "<i4").tobytes()
    assert "n_prompt_tokens" not in hb.body and hb.body["prompt_len"] == 2 and fb == []
    assert bytes(fc[0]) == np.array([3, 4], "<i4").tobytes()
    assert bytes(got[3][1][0]) == rows(2, 7).tobytes()
    assert "n_output_tokens" not in got[4][0].body and got[4][1] == [] and got[4][0].body["num_output"] == 2
    assert got[5][0].body["n_output_tokens"] == 1 and bytes(got[5][1][0]) == np.array([8], "<i4").tobytes()
    assert p.stats.token_ids_dropped == 2 and p.stats.encode_errors == 0


def test_publish_steps_screens_a_repeated_id_list_again_after_a_refusal(fake_and_producer):
    """The screen of an id list that passed is kept for the next call with the same list (decode batches), and
    dropped once any id is refused: the refused request's parts are then dropped and counted, the others sent.
    checked=True (the plugin's worker) skips the per-step shape checks only."""
    fake, p = fake_and_producer
    p.open("a", prompt_len=3)
    p.open("b", prompt_len=3)
    shared = ["a", "b"]
    ones = np.ones(2, np.int32)
    got = [fake.recv() for _ in range(2)]
    assert p.publish_steps([shared], [np.array([3, 3])], [ones], rows(2, 10)) is True
    got.append(fake.recv())                 # (each delta sent before the next call: none coalesced)
    assert p.publish_steps([shared], [np.array([4, 4])], [ones], rows(2, 20), checked=True) is True
    got.append(fake.recv())
    with pytest.raises(ValueError, match="num_cached_tokens"):
        p.open("b", prompt_len=1, num_cached_tokens=5)          # refuses "b"
    assert p.publish_steps([shared], [np.array([5, 5])], [ones], rows(2, 30), checked=True) is True
    assert p.stats.dropped_parts == 1
    got.append(fake.recv())
    assert [(h.kind, h.key) for h, _ in got] == [("open", "a"), ("open", "b"), ("delta", shared),
                                                 ("delta", shared), ("delta", ["a"])]
    d = wire.parse_delta(got[4][0])
    assert (d.starts.tolist(), d.counts.tolist()) == ([5], [1])
    assert bytes(got[4][1][0]) == rows(2, 30)[:1].tobytes()
    assert bytes(got[3][1][0]) == rows(2, 20).tobytes()


def test_publish_steps_refused_by_the_queue_bound_reports_every_position_lost(ctx, tmp_path):
    fake = FakeBroker(ctx, f"ipc://{tmp_path}/f")
    p = Producer(f"ipc://{tmp_path}/f", num_layers=L, top_k=K, context=ctx, linger_ms=0, max_queue_bytes=8)
    try:
        p.open("a", prompt_len=2)
        shared = ["a"]
        assert p.publish_steps([shared, shared], [np.array([2]), np.array([3])], [np.array([1]), np.array([1])],
                               rows(2)) is False
        assert (p.stats.dropped_msgs, p.stats.dropped_rows) == (1, 2)
        p.finish("a", num_output_tokens=3)
        got = [fake.recv() for _ in range(2)]
        assert [(h.kind, h.key) for h, _ in got] == [("open", "a"), ("finish", "a")]
        assert got[1][0].body["lost"] == [[2, 3], [3, 4]]          # as publish_rows reports them
    finally:
        p.close(timeout_s=1)
        fake.close()


def _request_major(a: np.ndarray, steps: int) -> np.ndarray:
    n = a.shape[0] // steps
    return a.reshape(steps, n, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)


@pytest.mark.parametrize("deferred", [False, True])
def test_decode_steps_of_an_unchanged_batch_leave_as_one_entry_per_request(fake_and_producer, deferred):
    """publish_steps of decode steps that share one id list, one row per request, each request one position further
    per step: one entry per request (its first position, `steps` rows), rows request-major, bit for bit; the
    deferred rows are released once and not copied again. Steps that are not like that keep one entry per row."""
    fake, p = fake_and_producer
    for r in "abc":
        p.open(r, prompt_len=4)
    shared = ["a", "b", "c"]
    first = np.array([5, 9, 2], np.int32)
    ones = np.ones(3, np.int64)
    src = rows(12, 7)
    arg = _Deferred(src) if deferred else src
    got = [fake.recv() for _ in range(3)]
    assert p.publish_steps([shared] * 4, [first + s for s in range(4)], [ones] * 4, arg) is True
    got.append(fake.recv())         # one at a time: steps queued together would leave as one message
    # not mergeable: a position that does not advance by one (a preempted request's recompute, say)
    starts = [first, first + 1, np.array([7, 11, 3])]
    assert p.publish_steps([shared] * 3, starts, [ones] * 3, rows(9, 50)) is True
    got.append(fake.recv())
    # not mergeable: two steps with equal lists but a count of 2
    assert p.publish_steps([shared, list(shared)], [first, first + 1], [ones, np.array([1, 2, 1])],
                           rows(7, 90)) is True
    got.append(fake.recv())
    (h1, f1), (h2, f2), (h3, f3) = got[3:]
    d1 = wire.parse_delta(h1)
    assert (h1.key, d1.starts.tolist(), d1.counts.tolist()) == (shared, [5, 9, 2], [4, 4, 4])
    assert b"".join(bytes(f) for f in f1) == _request_major(src, 4).tobytes()
    wire.check_payload(d1, f1)
    if deferred:
        assert arg.released == 1
    d2 = wire.parse_delta(h2)
    assert (h2.key, d2.starts.tolist(), d2.counts.tolist()) == (shared * 3, [5, 9, 2, 6, 10, 3, 7, 11, 3],
                                                                 [1] * 9)
    assert b"".join(bytes(f) for f in f2) == rows(9, 50).tobytes()
    d3 = wire.parse_delta(h3)
    assert (d3.starts.tolist(), d3.counts.tolist()) == ([5, 9, 2, 6, 10, 3], [1, 1, 1, 1, 2, 1])


def test_merged_decode_steps_make_the_same_records_through_broker_and_consumer(ctx, tmp_path):
    """The same routing published step by step (publish_rows) and as merged decode steps (publish_steps): records
    bit-equal, through a real broker and consumer."""
    from routing_replay.consumer import Consumer
    fe, be = f"ipc://{tmp_path}/fe", f"ipc://{tmp_path}/be"
    broker = Broker(fe, be, context=ctx)
    broker.start()
    got: dict = {}
    cons = Consumer(be, on_record=lambda r: got.__setitem__(r.request_id, r), context=ctx, finish_grace_s=0.0)
    cons.start()
    p = Producer(fe, num_layers=L, top_k=K, context=ctx, linger_ms=0)
    try:
        rng = np.random.default_rng(3)
        steps, n = 8, 5
        routing = rng.integers(0, 100, (2, n, 3 + steps, L, K)).astype(np.int16)   # (variant, request, position)
        for v, publish_steps in enumerate((False, True)):
            ids = [f"v{v}-r{i}" for i in range(n)]
            for r in ids:
                p.open(r, prompt_len=3)
            p.publish_rows(ids, [0] * n, [3] * n, routing[v, :, :3].reshape(-1, L, K).copy())
            per_step = np.ascontiguousarray(routing[v, :, 3:].swapaxes(0, 1)).reshape(-1, L, K)
            if publish_steps:
                p.publish_steps([ids] * steps, [np.full(n, 3 + s) for s in range(steps)], [np.ones(n, int)] * steps,
                                per_step)
            else:
                for s in range(steps):
                    p.publish_rows(ids, [3 + s] * n, [1] * n, per_step[s * n:(s + 1) * n])
            for r in ids:
                p.finish(r, num_output_tokens=steps + 1)        # the last output token is never computed
        wait_for(lambda: len(got) == 2 * n)
        for v in range(2):
            for i in range(n):
                rec = got[f"v{v}-r{i}"]
                assert rec.complete, rec
                assert np.array_equal(rec.prompt_routed_experts, routing[v, i, :3])
                assert np.array_equal(rec.routed_experts[:steps], routing[v, i, 3:])
                assert (rec.routed_experts[steps] == -1).all() and len(rec.routed_experts) == steps + 1
    finally:
        p.close(timeout_s=2)
        cons.close()
        broker.close()


def test_owner_hints_order_groups_requests_stably_and_only_when_it_helps():
    """OwnerHints.order: nothing known, one group, or groups already contiguous: None (no reordering); else the
    stable order by group (unknown owners first) and its inverse; cached for the same or an equal list until a
    hint arrives;
    the generic RequestMajor (ndarray rows) applies it in its one copy."""
    from routing_replay.producer.coalesce import OwnerHints, RequestMajor
    h = OwnerHints()
    ids = ["a", "b", "c", "d", "e"]
    assert h.order(ids) is None
    h.update(["a", "b", "c", "d", "e"], [2, 2, 5, 5, 5])
    assert h.order(ids) is None                         # grouped already
    assert h.order(["a", "c", "b"]) is not None
    h.update(["b", "d"], [5, 2])                        # a:2 b:5 c:5 d:2 e:5
    order, inverse = h.order(ids)
    assert order.tolist() == [0, 3, 1, 2, 4] and inverse.tolist() == [0, 2, 3, 1, 4]
    assert h.order(ids)[0] is order                     # cached for this list object
    assert h.order(list(ids))[0] is order               # and for an equal one (publish_rows copies the list)
    assert h.order(["a", "b", "c", "d"])[0].tolist() == [0, 3, 1, 2]    # another list: computed
    assert h.order(ids)[0] is not order                 # ... and cached in its place
    order = h.order(ids)[0]
    h.update(["x"], [9])                                # a new hint: computed again
    assert h.order(ids)[0] is not order
    order, _ = h.order(["x", "zz", "a", "y"])           # unknown owners (-1) first, stable
    assert order.tolist() == [1, 3, 2, 0]
    h.forget("a")
    assert "a" not in h.groups
    k, n = 3, 5
    src = np.arange(k * n * 2 * 2, dtype=np.int16).reshape(k * n, 2, 2)
    got = RequestMajor(src, k, np.array([0, 2, 3, 1, 4])).result()     # the (order, inverse) found above
    want = _request_major(src, k).reshape(n, k, 2, 2)[[0, 3, 1, 2, 4]].reshape(k * n, 2, 2)
    assert np.array_equal(got, want)
    assert np.array_equal(RequestMajor(src, k).result(), _request_major(src, k))
    strided = np.arange(k * n * 2 * 4, dtype=np.int16).reshape(k * n, 2, 4)[:, :, ::2]   # not C-contiguous
    assert np.array_equal(RequestMajor(strided, k, np.array([0, 2, 3, 1, 4])).result(),
                          _request_major(np.ascontiguousarray(strided), k).reshape(n, k, 2, 2)[[0, 3, 1, 2, 4]]
                          .reshape(k * n, 2, 2))
    assert RequestMajor(src[:0], k).result().shape == (0, 2, 2)


def test_owner_hints_per_ack_are_bounded_by_count_and_by_id_bytes():
    """The broker takes at most MAX_OWNER_HINTS hints, and ids of at most OWNER_HINT_ID_BYTES, per ack (oldest
    first; the rest wait for the next ack), so an ack stays far below the header limit whatever the ids' lengths."""
    due = {f"r{i}": i % 3 for i in range(5000)}
    ids, groups = wire.take_owner_hints(due)
    assert ids == [f"r{i}" for i in range(4096)] and groups == [i % 3 for i in range(4096)] and len(due) == 904
    assert wire.take_owner_hints(due)[0] == [f"r{i}" for i in range(4096, 5000)] and due == {}
    long = {f"{i:04d}" + "x" * 1020: 1 for i in range(2000)}             # 1,024-byte ids (the longest allowed)
    ids, _ = wire.take_owner_hints(long)
    assert len(ids) == 1024 and len(long) == 976
    head = wire.pack_header("ack", "p", 0, 0, "p", wire.producer_ack_body(wire.ProducerAck(1, 2,
                                                                                       owners=(ids, [1] * 1024))))
    assert len(head) < wire.MAX_HEADER_BYTES // 3 and wire.parse_producer_ack(wire.decode_header(head)).owners[0] == ids


def test_ack_owner_hints_round_trip_and_bad_ones_are_refused():
    ack = wire.ProducerAck(3, 7, owners=(["a", "b"], [1, 2]))
    h = wire.decode_header(wire.pack_header("ack", "p", 0, 0, "p", wire.producer_ack_body(ack)))
    assert wire.parse_producer_ack(h) == ack
    assert "owners" not in wire.producer_ack_body(wire.ProducerAck(3, 7))
    for bad in ({"a": 1}, [["a"], [1, 2]], [["a"], [-1]], [[1], [1]], [["a"], [1 << 31]], [["a"] * 4097, [1] * 4097],
                [["a"], ["b"]]):
        h = wire.decode_header(wire.pack_header("ack", "p", 0, 0, "p", {"epoch": 3, "upto": 7, "owners": bad}))
        with pytest.raises(wire.ProtocolError, match="ack owners"):
            wire.parse_producer_ack(h)


def test_owner_hints_group_merged_decode_steps_so_the_broker_only_slices(ctx, tmp_path):
    """Owner hints: the broker tells the producer each request's owner group on its acks; the producer's thread
    puts each owner's requests together when it merges decode steps (in the one request-major copy), so the
    broker sends each consumer one slice of the payload and gathers nothing. Through a real broker and two
    consumers whose rendezvous interleaves the requests: records bit-exact, every split delta sliced."""
    from routing_replay.broker.ownership import rendezvous
    from routing_replay.consumer import Consumer
    fe, be = f"ipc://{tmp_path}/fe", f"ipc://{tmp_path}/be"
    broker = Broker(fe, be, context=ctx)
    broker.start()
    got: dict = {}
    cons = [Consumer(be, consumer_id=c, on_record=lambda r: got.__setitem__(r.request_id, r), context=ctx,
                     finish_grace_s=0.0) for c in ("c1", "c2")]
    for c in cons:
        c.start()
    wait_for(lambda: len(broker.ownership.live) == 2)
    L2, K2 = 48, 8                  # Qwen3-30B-A3B's rows (768 B): each owner's run is over wire.COPY_THRESHOLD
    p = Producer(fe, num_layers=L2, top_k=K2, context=ctx, linger_ms=0)
    try:
        n, steps, batches = 24, 8, 3
        ids = [f"req-{i:02d}" for i in range(n)]
        owner = [rendezvous(r.encode(), [b"c1", b"c2"]) for r in ids]
        assert sum(a != b for a, b in zip(owner, owner[1:])) >= 4          # interleaved in the engine's order
        rng = np.random.default_rng(7)
        burst = 16                  # then decode steps one publish_rows each: those that queue up go merged
        routing = rng.integers(0, 100, (n, 2 + steps * batches + burst, L2, K2)).astype(np.int16)
        for r in ids:
            p.open(r, prompt_len=2)
        p.publish_rows(ids, [0] * n, [2] * n, routing[:, :2].reshape(-1, L2, K2).copy())
        wait_for(lambda: p.stats.owner_hints == n)                          # on the acks of those messages
        split0, gathered0 = broker.stats.deltas_split, broker.stats.split_gathered
        ones = np.ones(n, dtype=np.int64)
        for b in range(batches):
            pos = [2 + b * steps + s for s in range(steps)]
            step_major = np.ascontiguousarray(routing[:, pos].swapaxes(0, 1)).reshape(-1, L2, K2)
            assert p.publish_steps([ids] * steps, [np.full(n, q) for q in pos], [ones] * steps, step_major)
        assert p.wait_acked(10)
        # every merged batch went to both consumers (coalesced or not) as slices: nothing gathered after the
        # hints; the prompt rows (one message, before the hints, 2 rows per request: short runs) were gathered
        assert 1 <= broker.stats.deltas_split - split0 <= batches
        assert broker.stats.split_gathered == gathered0 == 2
        for q in range(2 + steps * batches, 2 + steps * batches + burst):
            assert p.publish_rows(ids, [q] * n, [1] * n, np.ascontiguousarray(routing[:, q]))
        for r in ids:
            p.finish(r, num_output_tokens=steps * batches + burst + 1)
        wait_for(lambda: len(got) == n)
        for i, r in enumerate(ids):
            rec = got[r]
            assert rec.complete, rec
            assert np.array_equal(rec.prompt_routed_experts, routing[i, :2])
            assert np.array_equal(rec.routed_experts[:steps * batches + burst], routing[i, 2:])
        # every merged batch went to both consumers (coalesced or not) as slices: nothing gathered after the
        # hints; the prompt rows (one message, before the hints, 2 rows per request: short runs) were gathered
        assert broker.stats.owner_hints_out == n
        wait_for(lambda: p._sender.intake.hints.groups == {})                      # forgotten at the finishes
    finally:
        p.close(timeout_s=2)
        for c in cons:
            c.close()
        broker.close()


def test_coalesced_decode_steps_merge_into_one_entry_per_request_in_one_copy():
    """merge_coalesced_steps: publish_rows steps of one unchanged decode batch that queued up together become one
    entry per request (its rows of every step in a row), owner-grouped with hints; anything else is left as it
    is: a screened step, deferred rows, a count of 2, a position that does not advance, another id list, wrong
    rows. The encoded delta carries exactly the same routing."""
    from routing_replay.producer.coalesce import OwnerHints, merge_coalesced_steps
    from routing_replay.producer.encode import Geometry, encode_steps
    from routing_replay.producer.items import Step
    rng = np.random.default_rng(5)
    ids, n, k = ["a", "b", "c"], 3, 4
    src = rng.integers(0, 50, (k, n, L, K)).astype(np.int16)

    def steps(**change):
        out = [Step(list(ids) if s else ids, [10 + s, 20 + s, 30 + s], [1] * n, src[s].copy(), None)
               for s in range(k)]
        for s, field in change.items():
            out[int(s[1:])] = out[int(s[1:])]._replace(**field)
        return out

    m = merge_coalesced_steps(steps(), (L, K))
    assert (m.request_ids, m.starts, m.counts) == (ids, [10, 20, 30], [k] * n)
    assert np.array_equal(m.rows.result(), src.swapaxes(0, 1).reshape(-1, L, K))
    hints = OwnerHints()
    hints.update(ids, [4, 2, 4])
    m = merge_coalesced_steps(steps(), (L, K), hints)
    assert (m.request_ids, m.starts) == (["b", "a", "c"], [20, 10, 30])
    assert np.array_equal(m.rows.result(), src.swapaxes(0, 1)[[1, 0, 2]].reshape(-1, L, K))
    g = Geometry(L, K, 0, L)
    enc, failed = encode_steps([merge_coalesced_steps(steps(), (L, K), hints)], "p", 1, 5, g, (L, K))
    h = wire.decode_header(enc.frames[0])
    d = wire.parse_delta(h)
    assert not failed and h.key == ["b", "a", "c"] and d.counts.tolist() == [k] * n
    assert (list(enc.parts.request_ids), list(enc.parts.starts)) == (["b", "a", "c"], [20, 10, 30])
    payload = b"".join(bytes(f) for f in enc.frames[1:])
    assert payload == src.swapaxes(0, 1)[[1, 0, 2]].tobytes()
    for bad in (steps(s1={"keep": [True, False, True]}), steps(s2={"counts": [1, 2, 1]}),
                steps(s3={"starts": [13, 23, 34]}), steps(s1={"request_ids": ["a", "b", "x"]}),
                steps(s2={"rows": src[2, :2].copy()}), steps(s0={"rows": RowsLike(src[0])}), steps()[:1],
                steps(s2={"starts": [12, 22]}), steps(s1={"counts": [1, 1]}), steps(s3={"starts": [13, "x", 33]})):
        assert merge_coalesced_steps(bad, (L, K)) is None
    # starts/counts as arrays (publish_steps' kind) merge exactly as the lists do (publish_rows')
    arrays = [st._replace(starts=np.array(st.starts), counts=np.array(st.counts)) for st in steps()]
    a, b = merge_coalesced_steps(arrays, (L, K), hints), merge_coalesced_steps(steps(), (L, K), hints)
    assert (a.request_ids, a.starts, a.counts) == (b.request_ids, b.starts, b.counts)
    assert np.array_equal(a.rows.result(), b.rows.result())
    bad = [st._replace(starts=np.array(st.starts) + (st is arrays[3])) for st in arrays]
    assert merge_coalesced_steps(bad, (L, K)) is None
    # the owner order is kept for an equal id list (publish_rows copies it every step) until a hint arrives
    first = hints.order(list(ids))
    assert hints.order(list(ids)) is first
    assert first[0].tolist() == [1, 0, 2]
    hints.update(["c"], [2])                         # now b, c share an owner next to each other: no reorder
    assert hints.order(list(ids)) is None


class RowsLike:
    """Deferred rows (not an ndarray)."""

    def __init__(self, a):
        self.a, self.shape, self.dtype = a, a.shape, a.dtype

    def result(self):
        return self.a


def test_out_pool_reuses_memory_only_when_nothing_refers_to_it():
    """OutPool (the request-major copies' memory): a root comes back only after every view of it is gone; while a
    view, a memoryview or a ZeroMQ frame made from it is alive its bytes never change under another copy; the
    copies are exact either way; free roots beyond the bound go back to the OS."""
    import weakref
    from routing_replay.producer.outpool import OutPool, request_major, out_pool

    pool = OutPool()
    n, L, K = 256, 48, 8                                    # 196,608 B per step: 16 steps = 3 MiB, above MIN_BYTES
    rng = np.random.default_rng(7)
    steps = [rng.integers(0, 128, (n, L, K)).astype(np.int16) for _ in range(16)]
    a = pool.empty((16 * n, L, K), np.int16)
    a[...] = 5
    first = weakref.ref(a.base)                             # no strong reference: the pool must see it free
    held = {"view": a[3:9], "memoryview": memoryview(a), "frame": zmq.Frame(a, copy=False)}
    del a
    others = []                                             # kept: only the first root may come back
    for name in list(held):
        b = pool.empty((16 * n, L, K), np.int16)           # a new root while the old one is referred to
        b[...] = 9
        assert pool.reused == 0, name
        others.append(b)
        other = held.pop(name)
        got = np.frombuffer(other.buffer if name == "frame" else other, np.int16)
        assert (got == 5).all(), name                       # untouched by b's write
        del other, got, b
    # all views gone (pyzmq lets go of a zero-copy frame's buffer on its own thread, once libzmq is done with it):
    # the next take of that size is served from that root
    deadline = time.monotonic() + 5
    while not any(pool.lent[i] is first() for i in pool._unreferenced(pool.lent)):
        assert time.monotonic() < deadline, "the frame's buffer was never let go"
        time.sleep(0.01)
    c = pool.empty((16 * n, L, K), np.int16)
    assert c.base is first()
    assert pool.reused == 1 and len(pool.lent) == 4
    del others
    # a take of a size that does not fit (more than twice smaller) allocates anew
    d = pool.empty((4 * n, L, K), np.int16)
    assert pool.reused == 1 and d.base is not c.base
    del c, d
    # the bound: free roots above MAX_FREE_BYTES go back to the OS, the longest idle first
    pool.MAX_FREE_BYTES = 4 << 20
    pool.empty((1,), np.int16)                              # small: plain np.empty, no collection
    e = pool.empty((2 * n, L, K), np.int16)                 # collects 4 free roots of 3 MiB and one of 1 MiB
    assert pool.free_bytes == sum(r.nbytes for r in pool.free) <= 4 << 20 and pool.free, \
        (pool.free_bytes, len(pool.free))
    assert pool.reused == 1 and e.base.nbytes == 1 << 20    # too small for a 3 MiB root: its own 1 MiB one
    del e
    # the thread's pool behind request_major: exact, owner order applied, memory reused across calls
    inverse = rng.permutation(n)
    want = np.stack(steps, axis=1)
    want_grouped = np.empty_like(want)
    want_grouped[inverse] = want
    before = out_pool().reused
    for _ in range(3):
        got = request_major(steps, inverse)
        assert np.array_equal(got.reshape(n, 16, L, K), want_grouped)
        del got
    assert out_pool().reused >= before + 2


def test_messages_the_thread_cannot_build_are_all_counted_and_logged_the_first_100_then_every_1000th(
        fake_and_producer, caplog):
    """A capture hook lost for good fails every delta: each is counted and its positions reported lost, but the log
    keeps the first 100 lines and then one per 1000 (the count in each)."""
    class Broken:
        shape, dtype = (1, L, K), np.int16

        def result(self):
            raise RuntimeError("a capture hook was lost")

        def release(self):
            pass

    caplog.set_level(logging.WARNING, logger="routing_replay.producer")
    fake, p = fake_and_producer
    p.open("a", prompt_len=1 << 12)
    for s in range(1001):
        p.publish_rows(["a"], [s], [1], Broken())
    wait_for(lambda: p.stats.encode_errors == 1001, 30)
    lines = [r.getMessage() for r in caplog.records if "could not encode" in r.getMessage()]
    assert len(lines) == 101
    assert "(100 so far; logged: the first 100, then every 1000th)" in lines[99]
    assert "(1000 so far)" in lines[100]


@pytest.mark.parametrize("every_s", [None, 0.0])
def test_a_replay_buffer_full_again_and_again_logs_its_first_episode_then_one_line_per_interval(every_s, caplog,
                                                                                                monkeypatch):
    """Consumers slower than the engine fill the replay buffer again at each message (every ack frees room for one
    more): one WARNING per episode wrote dozens of lines a second. Now the first episode is logged, then at most one
    line per FULL_LOG_EVERY_S (10 s) with the episodes since; a logged episode's end is logged too. Every episode
    is still counted (stats.replay_full). `every_s` 0: every episode logged, as before. Real producer, broker and
    consumer; every record exact."""
    from routing_replay.apps.embedded import EmbeddedPipeline
    from routing_replay.producer import intake
    if every_s is not None:
        monkeypatch.setattr(intake, "FULL_LOG_EVERY_S", every_s)
    got = {}
    with caplog.at_level(logging.INFO, logger="routing_replay.producer"):
        with EmbeddedPipeline(on_record=lambda r: got.__setitem__(r.request_id, r), finish_grace_s=0) as pipe:
            p = pipe.producer(num_layers=L, top_k=K, replay_max_bytes=1)    # full after each message
            t0 = time.monotonic()
            p.open("a", prompt_len=30)
            for s in range(30):
                assert p.publish_rows(["a"], [s], [1], rows(1, 100 * s)) and p.flush(10)
            p.finish("a", num_output_tokens=1)
            assert p.flush(10)
            elapsed = time.monotonic() - t0
            episodes, full_s = p.stats.replay_full, p.stats.replay_full_s
            p.close()
            assert pipe.wait_idle(10)
    full = [r.getMessage() for r in caplog.records if "replay buffer full" in r.getMessage()]
    room = [r.getMessage() for r in caplog.records if "has room again" in r.getMessage()]
    assert episodes == 32                           # the open, 30 deltas, the finish: each filled it
    assert 0 < full_s < elapsed                     # each lasted until its ack: the seconds they held steps back
    if every_s is None:
        assert len(full) == len(room) == 1 and "episodes=1 (0 not logged" in full[0]
    else:
        assert len(full) == len(room) == 32 and "episodes=32 (0 not logged" in full[-1]
    r = got["a"]
    assert (r.complete, r.missing) == (True, [])
    np.testing.assert_array_equal(r.prompt_routed_experts, np.concatenate([rows(1, 100 * s) for s in range(30)]))
