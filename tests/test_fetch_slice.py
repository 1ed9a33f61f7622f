"""Each trainer rank fetches only its slice: a layer range (pipeline stage), a token range (context-parallel rank)
and a sample subset (data-parallel rank); only those bytes leave the consumer (real consumer, real sockets)."""

import threading

import numpy as np
import pytest
import zmq

from routing_replay.apps.embedded import EmbeddedPipeline
from routing_replay.apps.synthetic import SyntheticEngine, workload
from routing_replay.consumer import TrainerClient
from routing_replay.consumer.client import SliceRefused
from routing_replay.protocol import wire

K, E = 2, 16
MOE = [1, 2, 3, 4, 5, 6, 7, 8]          # a 9-layer model whose layer 0 is dense
L = len(MOE)
STAGES = [(0, 3), (3, 5), (5, 7), (7, 9)]     # a 4-stage pipeline split of its 9 model layers


def _run(pipe, specs):
    with pipe.producer(num_layers=L, top_k=K, moe_layer_ids=MOE) as p:
        SyntheticEngine(num_layers=L, top_k=K, num_experts=E).run(p, specs, seed=5)
        assert p.flush(10)
    assert pipe.wait_idle(20)


def _sent_bytes(records, consumer_id: str, sl, header: bool = True) -> int:
    """What the consumer's reply frames for these records, sliced, hold (with or without the header frames)."""
    return sum(memoryview(np.ascontiguousarray(f) if isinstance(f, np.ndarray) else f).nbytes
               for rec in records for f in wire.encode_record(wire.slice_record(rec, sl), consumer_id, 0)[not header:])


def test_a_sliced_fetch_is_the_slice_of_the_full_record_and_only_its_bytes_leave_the_consumer(tmp_path):
    specs = workload(8, seed=4, prefix="s")         # cache hits, spec decode, preemption, an abort
    with EmbeddedPipeline(str(tmp_path / "npz"), serve="tcp://127.0.0.1:*") as pipe:
        _run(pipe, specs)
        with TrainerClient(pipe.serve) as t:
            full = t.fetch([s.request_id for s in specs], timeout_s=30)
        assert any(not r.complete for r in full.values()) and any(r.num_cached_tokens for r in full.values())
        cid = pipe.consumer.consumer_id
        for layers, tokens in [((3, 5), None), (None, (40, 120)), ((0, 3), (5, 9)), ((8, 100), (290, 400)),
                               ((0, 9), (0, 1 << 20))]:
            sl = wire.make_slice(layers, tokens)
            with TrainerClient(pipe.serve) as t:
                got = t.fetch(list(full), timeout_s=30, layers=layers, tokens=tokens)
                assert t.reply_bytes == _sent_bytes(full.values(), cid, sl) and t.sliced_locally == 0
            for rid, rec in full.items():
                want = wire.slice_record(rec, sl)
                assert got[rid].equals(want), (rid, layers, tokens)
                assert got[rid].layer_range == layers and got[rid].moe_layer_ids.tolist() == \
                    [x for x in MOE if layers is None or layers[0] <= x < layers[1]]
                if tokens is not None:
                    P, G = rec.prompt_routed_experts.shape[0], rec.routed_experts.shape[0]
                    lo, hi = min(tokens[0], P + G), min(tokens[1], P + G)
                    rows = np.concatenate([got[rid].prompt_routed_experts, got[rid].routed_experts])
                    whole = np.concatenate([rec.prompt_routed_experts, rec.routed_experts])
                    cols = [MOE.index(x) for x in got[rid].moe_layer_ids]
                    assert got[rid].token_range == (lo, hi, P + G) and np.array_equal(rows, whole[lo:hi][:, cols])
                    assert all(lo <= a < b <= hi for a, b in got[rid].missing)
        one_stage = _sent_bytes(full.values(), cid, wire.make_slice((3, 5)))
        whole = _sent_bytes(full.values(), cid, None)
        assert one_stage < whole // 2                        # the rows of 2 of 8 MoE layers (and all token ids)

        subset = sorted(full)[::3]                           # a data-parallel rank's samples: only those sent
        with TrainerClient(pipe.serve) as t:
            got = t.fetch(subset, timeout_s=30, layers=(3, 5))
            assert sorted(got) == subset
            assert t.reply_bytes == _sent_bytes([full[r] for r in subset], cid, wire.make_slice((3, 5)))


def test_bad_ranges_are_refused_naming_the_values_and_the_record_stays(tmp_path):
    specs = workload(2, seed=6, prefix="b", features=False)
    with EmbeddedPipeline(str(tmp_path / "npz"), serve="tcp://127.0.0.1:*") as pipe:
        _run(pipe, specs)
        rid = specs[0].request_id
        with TrainerClient(pipe.serve) as t:
            for kw, msg in [(dict(layers=(4, 4)), r"layers=\(4, 4\): expected integers 0 <= lo < hi"),
                            (dict(layers=(5, 2)), r"layers=\(5, 2\)"), (dict(tokens=(-1, 3)), r"tokens=\(-1, 3\)"),
                            (dict(layers=(1.5, 3)), r"layers=\(1.5, 3\)"), (dict(tokens=(3,)), r"tokens=\(3,\)")]:
                with pytest.raises(ValueError, match=msg):
                    t.fetch([rid], timeout_s=5, **kw)
                with pytest.raises(ValueError, match=msg):
                    t.subscribe("b", **kw)
            with pytest.raises(SliceRefused, match=r"bad_slice: layers \[9, 12\) hold no MoE layer of record "
                                                   r"'b-0' \(moe_layer_ids \[1, 2, 3, 4, 5, 6, 7, 8\]\)") as e:
                t.fetch([rid], timeout_s=10, layers=(9, 12))
            assert list(e.value.failed) == [rid] and e.value.records == {}
            assert pipe.consumer.trainers.bad_slices == 1
            assert t.fetch([rid], timeout_s=10)[rid].moe_layer_ids.tolist() == MOE      # still served whole
            held = specs[1].request_id                      # a sliced fetch straight from the store
            assert held in pipe.consumer.store
            part = t.fetch([held], timeout_s=10, layers=(7, 9), tokens=(0, 2))[held]
            whole = t.fetch([held], timeout_s=10)[held]
            assert part.equals(wire.slice_record(whole, wire.make_slice((7, 9), (0, 2))))
            assert held not in pipe.consumer.store and part.moe_layer_ids.tolist() == [7, 8]
        raw = zmq.Context.instance().socket(zmq.DEALER)          # a malformed slice on the wire: an error, no crash
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(pipe.serve)
        try:
            raw.send(wire.pack_header("fetch", "raw", 0, 1, [rid], {"layers": [5, 2]}))
            assert raw.poll(10_000)
            h = wire.decode_header(raw.recv())
            assert h.kind == "error" and wire.parse_error(h).startswith("bad_slice: layers=(5, 2): expected integers")
        finally:
            raw.close(0)
        with TrainerClient(pipe.serve) as t:
            assert t.fetch([rid], timeout_s=10, layers=(2, 3))[rid].moe_layer_ids.tolist() == [2]


def test_a_subscriber_gets_its_slice_of_each_live_record(tmp_path):
    specs = workload(3, seed=7, prefix="live", features=False)
    with EmbeddedPipeline(str(tmp_path / "npz"), serve="tcp://127.0.0.1:*") as pipe, \
            TrainerClient(pipe.serve) as sub:
        sub.subscribe("live", layers=(5, 7), tokens=(2, 30))
        trainers = pipe.consumer.trainers
        for _ in range(500):                          # until the subscription reached the consumer
            if trainers.subscribers:
                break
            list(sub.records(timeout_s=0.01))
        assert trainers.subscribers
        waited = {}                  # a sliced fetch that waits for records not finished yet (the waiter path)

        def fetch_before_finish():
            with TrainerClient(pipe.serve) as t:
                waited.update(t.fetch([s.request_id for s in specs], timeout_s=30, unknown="wait", layers=(0, 2),
                                      tokens=(1, 4)))

        th = threading.Thread(target=fetch_before_finish)
        th.start()
        for _ in range(1000):                         # until the consumer waits for all three
            if len(trainers.waiters) == 3:
                break
            th.join(0.01)
        assert len(trainers.waiters) == 3
        _run(pipe, specs)
        got = {}
        for rec in sub.records(timeout_s=5):
            got[rec.request_id] = rec
            if len(got) == 3:
                break
        th.join(30)
        with TrainerClient(pipe.serve) as t:
            full = t.fetch(list(got), timeout_s=30)
        sl = wire.make_slice((5, 7), (2, 30))
        assert sorted(got) == sorted(waited) == sorted(s.request_id for s in specs)
        for rid, rec in got.items():
            assert rec.equals(wire.slice_record(full[rid], sl)) and rec.moe_layer_ids.tolist() == [5, 6]
            assert waited[rid].equals(wire.slice_record(full[rid], wire.make_slice((0, 2), (1, 4))))
            assert waited[rid].moe_layer_ids.tolist() == [1] and waited[rid].token_range[:2] == (1, 4)


def test_a_consumer_that_sends_whole_records_is_sliced_by_the_client_and_counted(tmp_path):
    """An older consumer ignores the slice fields and sends the whole record: the client never hands that to a
    caller that asked for a slice; it slices it and counts it (sliced_locally)."""
    specs = workload(1, seed=8, prefix="old", features=False)
    with EmbeddedPipeline(str(tmp_path / "npz"), serve="tcp://127.0.0.1:*") as pipe:
        _run(pipe, specs)
        with TrainerClient(pipe.serve) as t:
            rec = t.fetch([specs[0].request_id], timeout_s=30)[specs[0].request_id]
    ctx = zmq.Context.instance()
    old = ctx.socket(zmq.ROUTER)
    old.setsockopt(zmq.LINGER, 0)
    port = old.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve_whole():            # answers every fetch with the whole record, as a consumer before slices did
        while not stop.is_set():
            if old.poll(50):
                client, head = old.recv_multipart()
                h = wire.decode_header(head)
                if h.kind == "fetch":
                    old.send_multipart([client, *wire.encode_record(rec, "old-consumer", 0)])

    th = threading.Thread(target=serve_whole, daemon=True)
    th.start()
    try:
        with TrainerClient(f"tcp://127.0.0.1:{port}") as t:
            got = t.fetch([rec.request_id], timeout_s=10, layers=(3, 5), tokens=(1, 7))
            assert got[rec.request_id].equals(wire.slice_record(rec, wire.make_slice((3, 5), (1, 7))))
            assert t.sliced_locally == 1
            assert t.reply_bytes == _sent_bytes([rec], "old-consumer", None)     # what did leave: all of it
            with pytest.raises(SliceRefused, match=r"bad_slice: layers \[20, 30\) hold no MoE layer"):
                t.fetch([rec.request_id], timeout_s=10, layers=(20, 30))
            assert t.sliced_locally == 2
    finally:
        stop.set()
        th.join(5)
        old.close(0)


def test_each_pipeline_stage_fetches_its_layers_and_megatron_gets_the_same_router_data(tmp_path):
    torch = pytest.importorskip("torch")
    from routing_replay.replay import packed, padded
    from routing_replay.replay.megatron import megatron_replay_data
    rng = np.random.default_rng(9)
    ids = [f"pp-{i}" for i in range(6)]
    with EmbeddedPipeline(str(tmp_path / "npz"), serve="tcp://127.0.0.1:*") as pipe:
        with pipe.producer(num_layers=L, top_k=K, moe_layer_ids=MOE) as p:
            for rid in ids:                 # distinct expert ids per row, as a router's top-k
                P, G = int(rng.integers(3, 40)), int(rng.integers(2, 20))
                p.open(rid, prompt_len=P)
                rows = np.argsort(rng.random((P + G - 1, L, E)), -1)[..., :K].astype(np.int16)
                p.publish_rows([rid], [0], [P + G - 1], rows)
                p.finish(rid, num_output_tokens=G)
            assert p.flush(10)
        assert pipe.wait_idle(20)
        with TrainerClient(pipe.serve) as t:
            full = t.fetch(ids, timeout_s=30)
            whole_bytes = t.reply_bytes
        per_stage = []
        for lo, hi in STAGES:
            routers = [x for x in MOE if lo <= x < hi]          # megatron_routers(stage).layers
            with TrainerClient(pipe.serve) as t:
                got = t.fetch(ids, timeout_s=30, layers=(lo, hi))
                per_stage.append(t.reply_bytes)
            mine = [got[r] for r in ids]
            assert all(r.moe_layer_ids.tolist() == routers for r in mine)
            for build in (packed, padded):
                a = megatron_replay_data(build(mine), model_layers=routers)
                b = megatron_replay_data(build([full[r] for r in ids]), model_layers=routers)
                assert len(a) == len(routers) and all(torch.equal(x, y) for x, y in zip(a, b))
            for rid in ids:                                   # and each stage's 2 context-parallel ranks
                n = full[rid].prompt_routed_experts.shape[0] + full[rid].routed_experts.shape[0]
                whole = megatron_replay_data(packed([full[rid]]), model_layers=routers)
                for lo_t, hi_t in ((0, n // 2), (n // 2, n)):
                    with TrainerClient(pipe.serve) as t:
                        chunk = t.fetch([rid], timeout_s=30, layers=(lo, hi), tokens=(lo_t, hi_t))[rid]
                    assert chunk.token_range == (lo_t, hi_t, n)
                    a = megatron_replay_data(packed([chunk]), model_layers=routers)
                    assert all(torch.equal(x, y[lo_t:hi_t]) for x, y in zip(a, whole))
        cid = pipe.consumer.consumer_id
        assert whole_bytes == _sent_bytes(full.values(), cid, None)
        for (lo, hi), n in zip(STAGES, per_stage):           # each stage: its layers' columns, nothing more
            assert n == _sent_bytes(full.values(), cid, wire.make_slice((lo, hi)))
        # the stages' row payloads (headers aside) partition the whole record's: each layer leaves once
        payload = [_sent_bytes(full.values(), cid, wire.make_slice(st), header=False) for st in STAGES]
        assert sum(payload) == _sent_bytes(full.values(), cid, None, header=False) == \
            sum(r.nbytes for r in full.values())


def test_the_subscribe_cli_refuses_a_bad_range_with_exit_2():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "routing_replay.apps.cli", "subscribe", "--connect",
                          "tcp://127.0.0.1:1", "--layers", "4", "4"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == ["routing-replay subscribe: layers=(4, 4): expected integers 0 <= lo < hi "
                                       "<= 65536"]


@pytest.mark.bench
def test_the_slice_bench_reports_exact_bytes_per_rank(tmp_path, capsys):
    """bench/slice_fetch.py, small: the per-rank figures are the encoded slices' sizes (it checks each record)."""
    import json
    from pathlib import Path

    from tests.procs import load_script
    bench = load_script(Path(__file__).resolve().parents[1] / "bench" / "slice_fetch.py", "bench_slice_fetch")
    out = tmp_path / "s.json"
    assert bench.main(["--records", "4", "--prompt", "12", "--output", "4", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert len(got["pp4"]) == 4 and len(got["pp4 x cp2"]) == 8 and len(got["dp4"]) == 4
    row, tok, n = 48 * 8 * 2, 4, 4 * 16                   # every rank: its rows and the token ids of its positions
    assert [b - hdr for b, hdr in zip(got["pp4"], got["pp4_headers"])] == [n * (row // 4 + tok)] * 4
    assert sum(got["dp4"]) == got["whole"][0]
    assert "pp4        ranks= 4" in capsys.readouterr().out


def test_a_context_parallel_chunk_that_stops_before_its_samples_end_keeps_its_last_row_a_context_row():
    """Megatron fills a sample's last row (never fed) with harmless ids; a chunk's last row is a context row
    unless the chunk reaches the sample's end (token_range hi == n), so a missing row there needs the fallback."""
    torch = pytest.importorskip("torch")
    from routing_replay.replay import packed, padded
    from routing_replay.replay.megatron import megatron_replay_data
    from tests.test_replay_tensors import K as K2, L as L2, record
    rec = record("cp", 6, 4, cached=3)                  # rows 0..2 prefix-cache hits (-1), row 9 never fed
    first = wire.slice_record(rec, wire.make_slice(tokens=(0, 3)))      # only cached rows
    last = wire.slice_record(rec, wire.make_slice(tokens=(5, 10)))
    assert first.token_range == (0, 3, 10) and last.token_range == (5, 10, 10)
    with pytest.raises(ValueError, match=r"3 context tokens have no routing"):   # all 3, its last row too
        megatron_replay_data(packed([first]))
    for build in (packed, padded):
        assert build([first]).sample_end.tolist() == [False] and build([last]).sample_end is None
        fb = [torch.full((3, K2), 7)] * L2
        got = megatron_replay_data(build([first]), fallback=fb)
        assert all(torch.equal(x, torch.full((3, K2), 7)) for x in got)
        tail = megatron_replay_data(build([last]))     # the sample's last row: the filler, as for the whole record
        whole = megatron_replay_data(build([rec]), fallback=[torch.full((10, K2), 7)] * L2)
        assert all(torch.equal(x, y[5:]) for x, y in zip(tail, whole))


def test_a_sliced_fetch_of_records_read_back_from_the_npz_dir(tmp_path):
    specs = workload(4, seed=10, prefix="disk", features=False)
    npz = str(tmp_path / "npz")
    with EmbeddedPipeline(npz) as pipe:                   # no trainer endpoint: records go to disk only
        _run(pipe, specs)
    with EmbeddedPipeline(npz, serve="tcp://127.0.0.1:*", fetched_retention_s=0) as pipe, \
            TrainerClient(pipe.serve) as t:
        ids = [s.request_id for s in specs]
        part = t.fetch(ids, timeout_s=30, layers=(4, 6), tokens=(3, 11))
        whole = t.fetch(ids, timeout_s=30)
        assert pipe.consumer.trainers.disk_reads >= 8 and pipe.consumer.trainers.sliced >= 4
        for rid in ids:
            assert part[rid].equals(wire.slice_record(whole[rid], wire.make_slice((4, 6), (3, 11))))
            assert part[rid].moe_layer_ids.tolist() == [4, 5] and part[rid].token_range[:2] == (3, 11)
