"""Compact expert ids end to end with real processes and sockets: uint8 (16 experts) and uint16 (300 experts)
rows through producer -> `routing-replay broker` -> `routing-replay consume` -> npz and trainer fetch, every
record bit-identical to the int16 reference once widened; a delta of another dtype than its request's open is
refused for that request only; the broker's byte counters are exactly the rows' bytes at the compact itemsize."""

import numpy as np
import pytest
import zmq

from routing_replay.apps.embedded import EmbeddedPipeline
from routing_replay.apps.synthetic import SyntheticEngine, expected_record, workload
from routing_replay.consumer import TrainerClient, load_records
from routing_replay.producer import Producer
from routing_replay.protocol import wire
from tests.procs import start_broker, start_consumer, wait_until

L, K = 4, 2


def wait_records(d, n, ids="int16"):
    wait_until(lambda: sum(1 for p in d.glob("*.npz") if not p.name.startswith(".")) >= n, 60, f"{n} npz files")
    return load_records(d, ids=ids)


@pytest.mark.parametrize("num_experts,dtype", [(16, np.dtype("u1")), (300, np.dtype("<u2"))])
def test_compact_rows_round_trip_through_real_processes(tmp_path, num_experts, dtype):
    broker, fe, be = start_broker(f"ipc://{tmp_path}/f", f"ipc://{tmp_path}/b")
    out = tmp_path / "out"
    c = start_consumer(be, "--npz-dir", str(out), "--serve", "tcp://127.0.0.1:*")
    serve = c.wait_for(r"serve=(\S+)").group(1)
    broker.wait_for("consumers=1")
    try:
        specs = workload(30, seed=7, prefix=f"c{num_experts}")
        eng = SyntheticEngine(num_layers=L, top_k=K, num_experts=num_experts, token_budget=64)
        with Producer(fe, num_layers=L, top_k=K, num_experts=num_experts) as p:
            assert p.id_dtype == dtype
            eng.run(p, specs, seed=7)
            assert p.flush(30) and p.stats.dropped_msgs == 0
        wide = wait_records(out, 30)
        small = load_records(out, ids="compact")
        finished = [s for s in specs if s.abort_at is None]
        assert len(finished) == len(eng.finished) > 10
        for s in specs:
            w, sm = wide[s.request_id], small[s.request_id]
            assert w.id_dtype == np.int16 and sm.id_dtype == dtype
            assert sm.widened().equals(w)
            if s.abort_at is None:      # bit-identical to the int16 path's reference record
                assert w.equals(expected_record(s, L, K, num_experts)), s.request_id
            else:
                assert not w.complete and w.reason == "abort"
        # the files hold the compact dtype and say so
        with np.load(next(p for p in out.glob("*.npz"))) as z:
            assert z["prompt_routed_experts"].dtype == dtype and str(z["ids"]) == wire.ids_code(dtype)
            assert int(z["missing_id"]) == wire.missing_id(dtype)
        # the trainer's fetch: int16 by default (today's records exactly), compact on request
        rids = [s.request_id for s in finished]
        with TrainerClient(serve) as t:
            got16 = t.fetch(rids, timeout_s=30)
            gotc = t.fetch(rids, timeout_s=30, ids="compact")
            with pytest.raises(ValueError, match="ids='uint8'"):
                t.fetch(rids, ids="uint8")
        assert all(got16[r].equals(wide[r]) for r in rids)
        assert all(gotc[r].id_dtype == dtype and gotc[r].equals(small[r]) for r in rids)
        def row_bytes(recs):
            return sum(r.prompt_routed_experts.nbytes + r.routed_experts.nbytes for r in recs.values())
        assert row_bytes(gotc) * 2 == row_bytes(got16) * dtype.itemsize
    finally:
        assert c.stop() == 0
        assert broker.stop() == 0


def test_delta_of_another_dtype_is_refused_for_its_request_only(tmp_path):
    broker, fe, be = start_broker(f"ipc://{tmp_path}/f", f"ipc://{tmp_path}/b")
    out = tmp_path / "out"
    c = start_consumer(be, "--npz-dir", str(out), "--finish-grace-ms", "0")
    broker.wait_for("consumers=1")
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(fe)
    try:
        rows = np.arange(6 * L * K, dtype=np.int16).reshape(6, L, K) % 16
        with Producer(fe, num_layers=L, top_k=K, num_experts=16) as p8, \
                Producer(fe, num_layers=L, top_k=K) as p16:
            for rid in ("x", "y"):
                p8.open(rid, prompt_len=4)
            assert p8.flush(10)
            p16.publish([("x", 0, rows[:4])])           # int16 rows for a uint8 request: refused for x only
            assert p16.flush(10)
            p8.publish([("y", 0, rows[:4])])
            p8.publish([("x", 4, rows[4:5]), ("y", 4, rows[4:5])])
            for rid in ("x", "y"):
                p8.finish(rid, num_output_tokens=2)
            assert p8.flush(10)
        # an unknown ids code never gets past the broker: refused whole, named in its error
        raw.send_multipart([wire.pack_header("hello", "raw", 0, 0, "raw", {"unacked_from": 1})])
        raw.send_multipart([wire.pack_header("delta", "raw", 0, 1, ["y"],
                                             dict(wire.delta_body([0], [1], L, K), ids="u3")), bytes(L * K)])
        reasons = []
        wait_until(lambda: raw.poll(100) and reasons.append(wire.decode_header(raw.recv_multipart()[0]))
                   is None and any(h.kind == "error" and "ids 'u3'" in h.body.get("reason", "") for h in reasons),
                   10, "the broker's error naming ids 'u3'")
        recs = wait_records(out, 2)
        x, y = recs["x"], recs["y"]
        assert not x.complete and x.reason == "consumer_refused" and x.missing == [(0, 4)]
        assert x.id_dtype == np.int16 and (x.prompt_routed_experts == -1).all()
        assert y.complete and y.reason == "" and np.array_equal(y.prompt_routed_experts, rows[:4])
        assert np.array_equal(y.routed_experts, np.concatenate([rows[4:5], np.full((1, L, K), -1, np.int16)]))
        # the consumer kept running: a later request goes through
        with Producer(fe, num_layers=L, top_k=K, num_experts=16) as p8:
            p8.open("z", prompt_len=2)
            p8.publish([("z", 0, rows[:2])])
            p8.finish("z", num_output_tokens=1)
            assert p8.flush(10)
        z = wait_records(out, 3)["z"]
        assert z.complete and np.array_equal(z.prompt_routed_experts, rows[:2])
        assert c.alive() and broker.alive()
        wait_until(lambda: any("refused" in x and "'x'" in x for x in c.lines), 10, "the consumer's refusal line")
    finally:
        raw.close(0)
        assert c.stop() == 0
        assert broker.stop() == 0


@pytest.mark.parametrize("num_experts,itemsize", [(None, 2), (128, 1), (300, 2)])
def test_broker_byte_counters_are_the_rows_at_their_itemsize(num_experts, itemsize):
    """3 requests, a 10-token prefill step each, then 4 decode steps: 42 rows of L*K ids at `itemsize` bytes."""
    n_req, P, steps = 3, 10, 4
    rng = np.random.default_rng(3)
    with EmbeddedPipeline() as pipe:
        with pipe.producer(num_layers=L, top_k=K, num_experts=num_experts, coalesce_max_bytes=0) as p:
            rids = [f"b{i}" for i in range(n_req)]
            for rid in rids:
                p.open(rid, prompt_len=P)
            p.publish([(rid, 0, rng.integers(0, 100, (P, L, K)).astype(np.int16)) for rid in rids])
            for s in range(steps):
                p.publish([(rid, P + s, rng.integers(0, 100, (1, L, K)).astype(np.int16)) for rid in rids])
            for rid in rids:
                p.finish(rid, num_output_tokens=steps + 1)
            assert p.flush(10)
            sent = p.stats.sent_bytes
        assert pipe.wait_idle(30)
        rows = n_req * (P + steps)
        assert pipe.broker.stats.bytes_in == pipe.broker.stats.bytes_out == rows * L * K * itemsize == \
            pipe.consumer.acc.stats.bytes
        assert pipe.consumer.acc.stats.complete == n_req
    assert sent == rows * L * K * itemsize          # the producer counts the payload it sent, at the wire itemsize
