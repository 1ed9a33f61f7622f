"""Producer back-pressure, the trainer service (fetch, subscribe, eviction, spill), npz layouts, the CLI."""

import subprocess
import sys
import threading

import numpy as np
import pytest

from routing_replay.consumer import (RecordEvicted, RecordStore, TrainerClient, load_records, record_files,
                                    safe_filename, write_record)
from routing_replay.consumer.npz import NpzWriter
from routing_replay.producer import Producer
from routing_replay.protocol import wire
from routing_replay.apps.embedded import EmbeddedPipeline
from routing_replay.apps.synthetic import SyntheticEngine, expected_record, true_rows, workload
from tests.procs import Proc, start_broker, start_consumer, wait_until
from tests.standins import Slot

L, K, E = 4, 2, 16


class Blocked:
    """Deferred rows whose result() waits for a gate: stalls the producer thread like a slow network."""

    def __init__(self, arr, gate):
        self.arr, self.gate = arr, gate
        self.shape, self.dtype = arr.shape, arr.dtype
        self.released = 0

    def result(self):
        self.gate.wait(30)
        return self.arr

    def release(self):
        self.released += 1


def test_producer_never_blocks_and_reports_what_the_bound_dropped():
    got = {}
    gate = threading.Event()
    with EmbeddedPipeline(on_record=lambda r: got.__setitem__(r.request_id, r), finish_grace_s=0) as pipe:
        row_bytes = L * K * 2
        p = pipe.producer(num_layers=L, top_k=K, max_queue_bytes=10 * row_bytes)
        p.open("a", prompt_len=20)
        first = Blocked(true_rows(1, np.arange(0, 4), L, K, E), gate)
        assert p.publish_rows(["a"], [0], [4], first)                    # the thread stalls on this one
        results = [p.publish_rows(["a"], [s], [4], true_rows(1, np.arange(s, s + 4), L, K, E))
                   for s in range(4, 20, 4)]
        assert results == [True, False, False, False]                    # 4 + 4 rows fit in 10, the rest not
        assert (p.stats.dropped_msgs, p.stats.dropped_rows) == (3, 12)
        p.finish("a", num_output_tokens=2)
        gate.set()
        assert p.flush(10)
        p.close()
        assert first.released == 1
        assert pipe.wait_idle(10)
    r = got["a"]
    assert (r.complete, r.reason, r.missing) == (False, "producer_queue_full", [(8, 21)])
    np.testing.assert_array_equal(r.prompt_routed_experts[:8], true_rows(1, np.arange(8), L, K, E))
    assert (r.prompt_routed_experts[8:] == -1).all() and (r.routed_experts == -1).all()


class Failing:
    """Deferred rows whose result() raises `error` (a check that failed, or rows lost for lack of room)."""

    def __init__(self, n, error):
        self.shape, self.dtype, self.error = (n, L, K), np.dtype(np.int16), error
        self.released = 0

    def result(self):
        raise self.error

    def release(self):
        self.released += 1


def test_rows_the_producer_refuses_reach_the_record_as_refused_and_rows_it_lost_as_lost():
    """A step whose deferred rows fail a check (e.g. the vLLM worker's LostHookError) is refused: the producer sends
    every other step, and the finish reports those positions lost and refused, so the record says
    `producer_refused`; rows it could not deliver for lack of room (RowsLost, e.g. a step-ring read that fell behind)
    say `producer_queue_full`, as a step the queue bound dropped. Real producer, broker and consumer (embedded)."""
    from routing_replay.producer.handover import RowsLost

    got = {}
    with EmbeddedPipeline(on_record=lambda r: got.__setitem__(r.request_id, r), finish_grace_s=0) as pipe:
        p = pipe.producer(num_layers=L, top_k=K)
        bad = {"a": Failing(4, RuntimeError("a capture hook was lost")), "b": Failing(4, RowsLost("fell behind"))}
        for rid, rows in bad.items():
            p.open(rid, prompt_len=12)
            p.publish_rows([rid], [0], [4], true_rows(1, np.arange(0, 4), L, K, E))
            assert p.flush(10)
            p.publish_rows([rid], [4], [4], rows)
            assert p.flush(10)
            p.publish_rows([rid], [8], [4], true_rows(1, np.arange(8, 12), L, K, E))
            p.finish(rid, num_output_tokens=1)
        assert p.flush(10)
        assert p.stats.encode_errors == 2 and [r.released for r in bad.values()] == [1, 1]
        p.close()
        assert pipe.wait_idle(10)
    for rid, reason in (("a", "producer_refused"), ("b", "producer_queue_full")):
        r = got[rid]
        assert (r.complete, r.reason, r.missing) == (False, reason, [(4, 8)]), rid
        np.testing.assert_array_equal(r.prompt_routed_experts[:4], true_rows(1, np.arange(4), L, K, E))
        np.testing.assert_array_equal(r.prompt_routed_experts[8:], true_rows(1, np.arange(8, 12), L, K, E))
        assert (r.prompt_routed_experts[4:8] == -1).all()


@pytest.mark.parametrize("finish_first", [False, True])
def test_rows_of_a_delta_the_broker_refuses_reach_the_record_as_broker_refused(monkeypatch, finish_first):
    """A delta the broker accepts and drops (it could not take the message: here a broker that refuses b's second
    delta, as one with other limits would) is named in its `error` (refused_seq); the producer puts its positions
    in b's finish as lost and broker_refused, and the record says `broker_refused`, not `producer_queue_full`.
    With `finish_first` the finish goes before the producer hears of the refusal (as the vLLM plugin's finish goes
    right behind the batch with its last rows): the broker's `refused` message to b's owner, in the delta's place
    on its link, names it. Real producer, broker and consumer (embedded); only the broker's payload check is
    replaced."""
    import routing_replay.broker.broker as broker_module

    real = broker_module.wire

    class SkewedWire:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def check_payload(d, frames):
            if d.request_ids == ["b"] and int(d.starts[0]) == 4:
                raise real.ProtocolError("out_of_range", "this broker takes no rows of b at 4")
            return real.check_payload(d, frames)

    monkeypatch.setattr(broker_module, "wire", SkewedWire())
    got = {}
    with EmbeddedPipeline(on_record=lambda r: got.__setitem__(r.request_id, r), finish_grace_s=0) as pipe:
        p = pipe.producer(num_layers=L, top_k=K, coalesce_max_bytes=0)
        for rid, seed in (("a", 1), ("b", 2)):
            p.open(rid, prompt_len=12)
        for lo in (0, 4, 8):
            for rid, seed in (("a", 1), ("b", 2)):
                p.publish_rows([rid], [lo], [4], true_rows(seed, np.arange(lo, lo + 4), L, K, E))
            assert p.flush(10)
        if not finish_first:            # b's finish carries the ranges; else the broker's `refused` names them
            wait_until(lambda: p.stats.refused_by_broker == 1, 10)
        for rid in ("a", "b"):
            p.finish(rid, num_output_tokens=1)
        assert p.flush(10)
        p.close()
        assert pipe.wait_idle(10)
    a, b = got["a"], got["b"]
    assert (a.complete, a.reason, a.missing) == (True, "", [])
    np.testing.assert_array_equal(a.prompt_routed_experts, true_rows(1, np.arange(12), L, K, E))
    assert (b.complete, b.reason, b.missing) == (False, "broker_refused", [(4, 8)])
    np.testing.assert_array_equal(b.prompt_routed_experts[:4], true_rows(2, np.arange(4), L, K, E))
    np.testing.assert_array_equal(b.prompt_routed_experts[8:], true_rows(2, np.arange(8, 12), L, K, E))
    assert (b.prompt_routed_experts[4:8] == -1).all()


def _rows_of(n: int, seed: int) -> np.ndarray:
    return ((np.arange(n * L * K, dtype=np.int64) * 7 + seed) % 30011).astype(np.int16).reshape(n, L, K)


@pytest.mark.parametrize("deferred", [False, True])
def test_a_step_with_more_rows_than_one_delta_may_carry_goes_as_several_and_arrives_exact(deferred):
    """The wire takes at most MAX_ROWS_PER_DELTA rows per delta (a broker refuses more: the rows were lost). A step
    beyond that is sent as several deltas, a request's rows cut between two. Real producer, broker and consumer."""
    got = {}
    n_a, n_b = wire.MAX_ROWS_PER_DELTA - 3, 11          # b's rows straddle the cut
    rows = _rows_of(n_a + n_b, 5)
    with EmbeddedPipeline(on_record=lambda r: got.__setitem__(r.request_id, r), finish_grace_s=0) as pipe:
        p = pipe.producer(num_layers=L, top_k=K, max_queue_bytes=64 << 20)
        p.open("a", prompt_len=n_a)
        p.open("b", prompt_len=n_b + 2)
        step = Slot(rows.copy()) if deferred else rows
        assert p.publish_rows(["a", "b"], [0, 0], [n_a, n_b], step)
        p.publish_rows(["b"], [n_b], [2], _rows_of(2, 6))
        p.finish("a", num_output_tokens=1)
        p.finish("b", num_output_tokens=1)
        assert p.flush(30)
        assert (p.stats.split_steps, p.stats.refused_by_broker, p.stats.encode_errors) == (1, 0, 0)
        assert not deferred or step.released == 1
        p.close()
        assert pipe.wait_idle(30)
    a, b = got["a"], got["b"]
    assert (a.complete, a.missing, b.complete, b.missing) == (True, [], True, [])
    np.testing.assert_array_equal(a.prompt_routed_experts, rows[:n_a])
    np.testing.assert_array_equal(b.prompt_routed_experts, np.concatenate([rows[n_a:], _rows_of(2, 6)]))


@pytest.mark.parametrize("coalesced", [False, True])
def test_steps_whose_request_ids_outgrow_one_header_go_as_several_deltas_and_arrive_exact(coalesced):
    """A delta's header (its key list) is bounded by MAX_HEADER_BYTES: 4,160 entries of 1,000-character ids pass
    it. One step with them (`coalesced` False), or 16 steps of 260 that queue up and that the producer would
    coalesce (each step other requests: nothing to merge), go as several deltas. Real producer, broker, consumer."""
    got = {}
    ids = [f"{i:05d}-" + "x" * 994 for i in range(4160)]
    rows = _rows_of(4160, 3)
    gate = threading.Event()
    with EmbeddedPipeline(on_record=lambda r: got.__setitem__(r.request_id, r), finish_grace_s=0) as pipe:
        p = pipe.producer(num_layers=L, top_k=K)
        for rid in ids:
            p.open(rid, prompt_len=1)
        if coalesced:       # the thread waits on a first step while the 16 queue up behind it
            p.open("first", prompt_len=1)
            p.publish_rows(["first"], [0], [1], Blocked(_rows_of(1, 1), gate))
            for s in range(16):
                p.publish_rows(ids[s * 260:(s + 1) * 260], [0] * 260, [1] * 260, rows[s * 260:(s + 1) * 260])
            gate.set()
            p.finish("first", num_output_tokens=1)
        else:
            p.publish_rows(ids, [0] * 4160, [1] * 4160, rows)
        for rid in ids:
            p.finish(rid, num_output_tokens=1)
        assert p.flush(30)
        assert (p.stats.refused_by_broker, p.stats.encode_errors) == (0, 0)
        assert p.stats.split_steps == (0 if coalesced else 1)
        p.close()
        assert pipe.wait_idle(30)
    assert len(got) == 4160 + coalesced
    for i, rid in enumerate(ids):
        r = got[rid]
        assert (r.complete, r.missing) == (True, []), rid[:5]
        np.testing.assert_array_equal(r.prompt_routed_experts, rows[i:i + 1])


def test_a_record_over_the_trainer_sockets_frame_limit_is_fetched_whole_and_exact():
    """A record whose prompt rows pass MAX_MESSAGE_BYTES (1 GiB, the trainer socket's ZMQ_MAXMSGSIZE: 1.4M tokens
    at Qwen3-30B-A3B's 768 bytes a token) goes in several frames. As one frame, the trainer's socket dropped it and
    the connection with it on every retry, the fetch timed out, and the consumer, having sent it, no longer held it.
    Real producer, broker, consumer and trainer client; a small record fetched alongside is exact too."""
    Lq, Kq = 48, 8
    n = wire.MAX_MESSAGE_BYTES // (Lq * Kq * 2) + 1000         # over 1 GiB
    rows = np.resize(np.arange(30011, dtype=np.int16), (n + 1, Lq, Kq))
    with EmbeddedPipeline(serve="tcp://127.0.0.1:*", finish_grace_s=0) as pipe:
        p = pipe.producer(num_layers=Lq, top_k=Kq, max_queue_bytes=2 << 30)
        p.open("big", prompt_len=n + 1)
        p.open("small", prompt_len=2)
        assert p.publish_rows(["big", "small"], [0, 0], [n, 1], rows)
        p.publish_rows(["big", "small"], [n, 1], [1, 1], rows[:2])
        p.finish("big", num_output_tokens=1)
        p.finish("small", num_output_tokens=1)
        assert p.flush(60)
        with TrainerClient(pipe.serve) as tc:
            got = tc.fetch(["big", "small"], timeout_s=60)
            assert tc.bad_replies == 0
        p.close()
    big, small = got["big"], got["small"]
    assert (big.complete, big.missing, small.complete, small.missing) == (True, [], True, [])
    assert big.prompt_routed_experts.shape == (n + 1, Lq, Kq)
    assert np.array_equal(big.prompt_routed_experts[:n], rows[:n])
    np.testing.assert_array_equal(big.prompt_routed_experts[n:], rows[:1])
    np.testing.assert_array_equal(small.prompt_routed_experts, rows[[n, 1]])


def test_producer_validates_shapes_at_the_caller():
    with EmbeddedPipeline() as pipe, pipe.producer(num_layers=L, top_k=K) as p:
        with pytest.raises(ValueError, match=r"rows must be \(n, 4, 2\) int16"):
            p.publish_rows(["a"], [0], [1], np.zeros((1, L, K + 1), np.int16))
        with pytest.raises(ValueError, match="rows has 2 rows, counts add up to 1"):
            p.publish_rows(["a"], [0], [1], np.zeros((2, L, K), np.int16))
        with pytest.raises(ValueError, match="int16"):
            p.publish([("a", 0, np.zeros((1, L, K), np.int32))])
        with pytest.raises(ValueError, match="num_cached_tokens"):
            p.open("a", prompt_len=3, num_cached_tokens=4)


def test_fetch_before_and_after_finish_and_subscribe(tmp_path):
    specs = workload(20, seed=7, prefix="t", features=False)
    with EmbeddedPipeline(serve="tcp://127.0.0.1:*") as pipe:
        with TrainerClient(pipe.serve) as early, TrainerClient(pipe.serve) as sub:
            sub.subscribe("t-1")       # t-1, t-10 .. t-19
            # ask for half of the records before they exist
            want_early = [s.request_id for s in specs[:10]]
            result = {}
            th = threading.Thread(target=lambda: result.update(early.fetch(want_early, timeout_s=30)))
            th.start()
            eng = SyntheticEngine(num_layers=L, top_k=K, num_experts=E)
            with pipe.producer(num_layers=L, top_k=K) as p:
                eng.run(p, specs)
                p.flush(10)
            th.join(30)
            assert set(result) == set(want_early)
            live = {r.request_id: r for r in sub.records(timeout_s=2)}
            # a subscriber that does not read while records come (this one) may miss some beyond the trainer
            # socket's queue (TRAINER_SNDHWM); each one missed is counted, and fetch still has it
            want_live = {s.request_id for s in specs if s.request_id.startswith("t-1")}
            assert set(live) <= want_live and len(live) + pipe.consumer.subscriber_drops == len(want_live)
            later = early.fetch([s.request_id for s in specs[10:]], timeout_s=30)
        for s in specs:
            r = result.get(s.request_id) or later[s.request_id]
            assert r.equals(expected_record(s, L, K, E))
            if s.request_id in live:
                assert live[s.request_id].equals(r)
        assert len(pipe.consumer.store) == 0     # fetched records leave the store


def _record(rid, n=100):
    return wire.Record(rid, np.zeros((n, L, K), np.int16), np.ones((3, L, K), np.int16), 0,
                       np.arange(L, dtype=np.int32), True)


def test_store_evicts_with_report_or_spills(tmp_path):
    s = RecordStore(max_bytes=3 * _record("x").nbytes)
    for i in range(5):
        s.put(_record(f"r{i}"))
    assert (len(s), s.evicted) == (3, 2)
    assert s.take("r0") == "evicted" and s.take("r1") == "evicted"
    assert s.take("r4").equals(_record("r4"))
    assert s.take("nope") is None
    sp = RecordStore(max_bytes=2 * _record("x").nbytes, spill_dir=tmp_path / "spill")
    for i in range(5):
        sp.put(_record(f"r{i}"))
    assert (sp.evicted, sp.spilled, len(sp)) == (0, 3, 5)
    for i in range(5):
        assert sp.take(f"r{i}").equals(_record(f"r{i}"))
    assert list((tmp_path / "spill").iterdir()) == []


def test_fetch_of_evicted_record_raises(tmp_path):
    with EmbeddedPipeline(serve="tcp://127.0.0.1:*", store_max_bytes=1) as pipe:
        with pipe.producer(num_layers=L, top_k=K) as p:
            for rid in ("a", "b"):
                p.open(rid, prompt_len=2)
                p.publish_rows([rid], [0], [2], true_rows(1, np.arange(2), L, K, E))
                p.finish(rid, num_output_tokens=1)
            p.flush(10)
        assert pipe.wait_idle(10)
        with TrainerClient(pipe.serve) as t:
            assert t.fetch(["b"], timeout_s=10)["b"].complete
            with pytest.raises(RecordEvicted, match="'a'"):
                t.fetch(["a"], timeout_s=10)
            with pytest.raises(TimeoutError, match="never"):
                t.fetch(["never"], timeout_s=0.5)


@pytest.mark.parametrize("rid", ["../../etc/x", "/etc/passwd", "..", ".", "a/b", "a\x00b", "x" * 10_000,
                                 "日本語", "%2E%2E"])
def test_request_ids_never_escape_the_npz_dir(tmp_path, rid):
    d = tmp_path / "out"
    d.mkdir()
    path = write_record(d, _record(rid, 2))
    assert path.parent == d and len(path.name) < 255
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [path.name]
    assert load_records(d)[rid].equals(_record(rid, 2))


def test_safe_filenames_are_distinct():
    ids = ["a/b", "a%2Fb", "a_b", "..", "%2E.", ".", "x" * 500, "x" * 499 + "y"]
    assert len({safe_filename(i) for i in ids}) == len(ids)


def test_record_files_leave_out_files_still_being_written_and_shards(tmp_path):
    """What a harness counts or deletes as records: pathlib's glob("*.npz") also matches the ".tmp-*.npz" file
    a writer has not renamed yet (counted, a check ran one record early; deleted, the writer's rename failed)."""
    a, b = write_record(tmp_path, _record("a", 1)), write_record(tmp_path, _record("b", 2))
    (tmp_path / ".tmp-x1y2.npz").write_bytes(b"partial")
    (tmp_path / "shard-000000.npz").write_bytes(b"")
    assert len(list(tmp_path.glob("*.npz"))) == 4
    assert record_files(tmp_path) == sorted([a, b])
    assert sorted(load_records(tmp_path)) == ["a", "b"]


def test_shards_with_index_and_loader(tmp_path):
    w = NpzWriter(tmp_path, shard_size=3)
    recs = [_record(f"s/{i}", i + 1) for i in range(7)]
    for r in recs:
        w.put(r)
    w.close()
    assert sorted(p.name for p in tmp_path.glob("*.npz")) == ["shard-000000.npz", "shard-000001.npz",
                                                              "shard-000002.npz"]
    assert len((tmp_path / "index.jsonl").read_text().splitlines()) == 7
    got = load_records(tmp_path)
    assert all(got[r.request_id].equals(r) for r in recs) and len(got) == 7
    assert not list(tmp_path.glob(".tmp-*"))


def test_cli_help_and_errors(tmp_path):
    for sub in ("broker", "consume", "subscribe", "synth"):
        out = subprocess.run([sys.executable, "-m", "routing_replay.apps.cli", sub, "--help"], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0 and "--log-level" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "routing_replay.apps.cli", "broker", "--frontend", "tcp://256.0.0.1:1"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].startswith("routing-replay broker: cannot bind tcp://256.0.0.1:1")
    nosub = subprocess.run([sys.executable, "-m", "routing_replay.apps.cli"], capture_output=True, text=True, timeout=60)
    assert nosub.returncode == 2


def test_bind_conflict_exits_with_reason(tmp_path):
    b1, fe, be = start_broker(f"ipc://{tmp_path}/f", "tcp://127.0.0.1:*")
    try:
        out = subprocess.run([sys.executable, "-m", "routing_replay.apps.cli", "broker", "--frontend",
                              f"ipc://{tmp_path}/f2", "--backend", be], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "Address already in use" in out.stderr.splitlines()[-1]
    finally:
        assert b1.stop() == 0


def test_subscribe_cli_prints_matching_records(tmp_path):
    broker, fe, be = start_broker(f"ipc://{tmp_path}/f", f"ipc://{tmp_path}/b")
    c = start_consumer(be, "--serve", "tcp://127.0.0.1:*")
    serve = c.wait_for(r"serve=(\S+)").group(1)
    sub = Proc(["subscribe", "--connect", serve, "--prefix", "keep-", "--count", "3"])
    broker.wait_for("consumers=1")
    try:
        wait_until(lambda: any("subscriber" in x for x in c.lines), 20, "subscription registered")
        with Producer(fe, num_layers=L, top_k=K) as p:
            for rid in ("keep-1", "drop-1", "keep-2", "keep-3"):
                p.open(rid, prompt_len=2)
                p.publish_rows([rid], [0], [2], true_rows(1, np.arange(2), L, K, E))
                p.finish(rid, num_output_tokens=1)
        assert sub.p.wait(30) == 0
        printed = [x for x in sub.lines if x.startswith(("keep-", "drop-"))]
        assert [x.split()[0] for x in printed] == ["keep-1", "keep-2", "keep-3"]
        assert "prompt=2 output=1 layers=4 top_k=2 cached=0 complete=True" in printed[0]
    finally:
        sub.stop()
        c.stop()
        broker.stop()


def test_producer_close_delivers_everything_before_the_process_exits(tmp_path):
    """close() must not return before queued messages are on the wire (a rollout worker exits right after)."""
    import zmq
    ctx = zmq.Context.instance()
    rx = ctx.socket(zmq.ROUTER)
    rx.setsockopt(zmq.LINGER, 0)
    ep = f"ipc://{tmp_path}/rx"
    rx.bind(ep)
    code = (
        "import numpy as np\n"
        "from producer import Producer\n"
        f"p = Producer({ep!r}, num_layers=48, top_k=8)\n"
        "rows = np.ones((256, 48, 8), np.int16)\n"
        "ids = [f'r{i}' for i in range(256)]\n"
        "for s in range(300):\n"
        "    p.publish_rows(ids, [s] * 256, [1] * 256, rows)\n"
        "p.close()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    rows = 0                  # steps queued together leave as one delta: count the rows, not the messages
    try:
        while rx.poll(10_000):
            frames = rx.recv_multipart()
            h = wire.decode_header(frames[1])
            if h.kind == "delta":
                d = wire.parse_delta(h)
                wire.check_payload(d, frames[2:])
                # one step per 256 entries, or steps that queued up merged: 256 entries of k rows each
                counts = set(d.counts.tolist())
                assert len(d.request_ids) % 256 == 0 and len(counts) == 1
                assert counts == {1} or len(d.request_ids) == 256
                rows += d.total_rows
                assert sum(len(f) for f in frames[2:]) == d.total_rows * 48 * 8 * 2
            if rows == 300 * 256:
                break
    finally:
        assert proc.wait(30) == 0
        rx.close(0)
    assert rows == 300 * 256


@pytest.mark.parametrize("transport", ["ipc", "tcp", "inproc"])
def test_prefill_rows_stay_in_the_frames_the_socket_received(tmp_path, transport):
    """A real broker and consumer: a prefill message's rows stay in the frames the consumer's socket received
    (Accumulator._adopt) and the records of requests that ended with them have their prompt rows as a view of
    them; a request that goes on is moved to the arena; every record bit for bit. Over inproc a frame may be the
    sender's own memory, so nothing is kept there."""
    import zmq

    from routing_replay.broker import Broker
    from routing_replay.consumer import Consumer
    ctx = zmq.Context()
    if transport == "ipc":
        fe, be = f"ipc://{tmp_path}/f", f"ipc://{tmp_path}/b"
    elif transport == "tcp":
        fe, be = "tcp://127.0.0.1:0", "tcp://127.0.0.1:0"
    else:
        fe, be = f"inproc://f-{tmp_path.name}", f"inproc://b-{tmp_path.name}"
    got = {}
    b = Broker(fe, be, context=ctx, stats_interval_s=60).start()
    c = Consumer(b.backend, context=ctx, finish_grace_s=0.1, stats_interval_s=60,
                 on_record=lambda r: got.__setitem__(r.request_id, r)).start()
    P = {"a": 5000, "b": 4200, "c": 4100, "small": 8}          # rows of 16 bytes: a, b, c >= 64 KiB each
    G = {"a": 1, "b": 1, "c": 3, "small": 1}
    truth = {r: true_rows(i, np.arange(P[r] + G[r]), L, K, E) for i, r in enumerate(P)}
    try:
        wait_until(lambda: len(b.ownership.live_ids) == 1, 10, "consumer joined")
        with Producer(b.frontend, num_layers=L, top_k=K, context=ctx) as p:
            for r in P:
                p.open(r, prompt_len=P[r])
            big = ["a", "b", "c"]
            assert p.publish_rows(big, [0, 0, 0], [P[r] for r in big], np.concatenate([truth[r][:P[r]] for r in big]))
            assert p.flush(10)
            assert p.publish_rows(["small"], [0], [P["small"]], truth["small"][:P["small"]])
            for s in range(P["c"], P["c"] + G["c"] - 1):          # c decodes on (its last token is never fed)
                assert p.publish_rows(["c"], [s], [1], truth["c"][s:s + 1])
                assert p.flush(10)
            for r in P:
                p.finish(r, num_output_tokens=G[r])
            assert p.flush(10)
        wait_until(lambda: len(got) == 4, 20, "4 records")
        for r in P:
            rec = got[r]
            want = truth[r].copy()
            want[-1] = -1                                          # the last output token's row
            assert rec.complete, (r, rec.reason, rec.missing)
            np.testing.assert_array_equal(rec.prompt_routed_experts, want[:P[r]])
            np.testing.assert_array_equal(rec.routed_experts, want[P[r]:])
            assert rec.prompt_routed_experts.flags.writeable
        s = c.acc.stats
        kept = (3, 2, 1) if transport != "inproc" else (0, 0, 0)
        assert (s.adopted, s.adopted_records, s.materialized) == kept
        assert c.acc.bytes_held == 0
    finally:
        c.close()
        b.close()
        ctx.term()


@pytest.mark.parametrize("flags,kept", [((), (2, 2)), (("--copy-rows",), (0, 0)),
                                        (("--keep-received-kb", "100"), (1, 1))])
def test_consume_cli_keeps_received_prefill_rows_as_configured(tmp_path, flags, kept):
    """`routing-replay consume` as a process: by default a prefill message's rows (here 80 and 64 KiB) stay in the
    received frames; --copy-rows copies them all; --keep-received-kb sets the smallest entry kept. Its stats
    line counts them, and the npz records are exact either way."""
    broker, fe, be = start_broker(f"ipc://{tmp_path}/f", f"ipc://{tmp_path}/b")
    c = start_consumer(be, "--npz-dir", str(tmp_path / "npz"), "--finish-grace-ms", "100", *flags)
    P = {"big": 6400, "edge": 4096}                               # 16-byte rows: 100 and 64 KiB
    truth = {r: true_rows(i, np.arange(P[r] + 1), L, K, E) for i, r in enumerate(P)}
    try:
        broker.wait_for(r"consumers=1")
        for r in P:                                               # one message each, kept or copied on its own
            with Producer(fe, num_layers=L, top_k=K) as p:
                p.open(r, prompt_len=P[r])
                assert p.publish_rows([r], [0], [P[r]], truth[r][:P[r]])
                p.finish(r, num_output_tokens=1)
                assert p.flush(10)
        recs = {}
        wait_until(lambda: len(recs.update(load_records(tmp_path / "npz")) or recs) == 2, 20, "2 npz records")
        for r in P:
            np.testing.assert_array_equal(recs[r].prompt_routed_experts, truth[r][:P[r]])
            assert recs[r].complete and (recs[r].routed_experts == -1).all()
        m = c.wait_for(r"records=2 .* adopted=(\d+) adopted_records=(\d+) materialized=0 ")
        assert (int(m.group(1)), int(m.group(2))) == kept
    finally:
        for p in (c, broker):
            assert p.stop() == 0
