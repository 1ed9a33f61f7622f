"""What a fetch answers: unknown ids at once, pending ones within the timeout, a record again, records from npz-dir."""

import time

import numpy as np
import pytest

from routing_replay.consumer import RecordUnknown, TrainerClient
from routing_replay.apps.embedded import EmbeddedPipeline
from routing_replay.apps.synthetic import SyntheticEngine, expected_record, true_rows, workload

L, K, E = 4, 2, 16


def _run(pipe, specs, seed=3):
    with pipe.producer(num_layers=L, top_k=K) as p:
        SyntheticEngine(num_layers=L, top_k=K, num_experts=E).run(p, specs, seed=seed)
        assert p.flush(10)
    assert pipe.wait_idle(20)


def test_unknown_answered_at_once_pending_waits_and_a_record_can_be_fetched_again(tmp_path):
    specs = workload(6, seed=3, prefix="f", features=False)
    want = {s.request_id: expected_record(s, L, K, E) for s in specs}
    with EmbeddedPipeline(str(tmp_path / "npz"), serve="tcp://127.0.0.1:*") as pipe:
        _run(pipe, specs)
        # open, never finished. The producer stays open until the end: closing it says `bye`, and the broker
        # aborts what a closed producer left open, which would end f-pending (as producer_closed)
        with pipe.producer(num_layers=L, top_k=K) as p:
            p.open("f-pending", prompt_len=2)
            p.publish_rows(["f-pending"], [0], [2], true_rows(9, np.arange(2), L, K, E))
            assert p.flush(10)
            wait_until_open = time.monotonic() + 10
            while "f-pending" not in pipe.consumer.acc.requests and time.monotonic() < wait_until_open:
                time.sleep(0.01)
            assert "f-pending" in pipe.consumer.acc.requests
            with TrainerClient(pipe.serve) as t:
                t0 = time.monotonic()
                with pytest.raises(RecordUnknown) as e:
                    t.fetch(["nope", "f-0"], timeout_s=30, unknown="raise")
                assert time.monotonic() - t0 < 1.0
                assert e.value.request_ids == ["nope"] and set(e.value.records) == {"f-0"}
                assert e.value.records["f-0"].equals(want["f-0"])
                t0 = time.monotonic()
                with pytest.raises(TimeoutError) as e:                  # pending: waited for, not unknown
                    t.fetch(["f-pending"], timeout_s=1.0, unknown="raise")
                assert not isinstance(e.value, RecordUnknown) and time.monotonic() - t0 >= 0.99
                first = t.fetch(list(want), timeout_s=30, unknown="raise")
                again = t.fetch(list(want), timeout_s=30, unknown="raise")
            with TrainerClient(pipe.serve) as crashed_and_back:
                third = crashed_and_back.fetch(list(want), timeout_s=30)
            for rid, rec in want.items():
                assert first[rid].equals(rec) and again[rid].equals(rec) and third[rid].equals(rec)
            assert len(pipe.consumer.store) == 0 and len(pipe.consumer.trainers.fetched) == 6
            assert pipe.consumer.trainers.unknown_answers >= 1
            assert "f-pending" in pipe.consumer.acc.requests            # still open: nothing ended it


def test_a_producer_closed_right_after_its_first_flush_waits_for_acks_and_its_open_request_ends_at_once(tmp_path):
    # flush() returns once everything is on the socket; a close() right after it, before the broker's first answer
    # was read, used to take the broker for a peer that does not speak acks: no wait for acks, no `bye`, and the
    # open request stayed open until the broker's producer timeout (10 s)
    with EmbeddedPipeline(str(tmp_path / "npz"), serve="tcp://127.0.0.1:*") as pipe, TrainerClient(pipe.serve) as t:
        for i in range(3):
            rid = f"closed-{i}"
            p = pipe.producer(num_layers=L, top_k=K)
            p.open(rid, prompt_len=4)
            p.publish_rows([rid], [0], [2], true_rows(i, np.arange(2), L, K, E))
            assert p.flush(10)
            p.close()
            assert p._sender.intake._broker_epoch is not None and len(p._sender._replay) == 0     # answered, all acked
            t0 = time.monotonic()
            rec = t.fetch([rid], timeout_s=5)[rid]
            assert time.monotonic() - t0 < 3.0                        # the broker's producer timeout is 10 s
            want = true_rows(i, np.arange(4), L, K, E)
            want[2:] = -1
            assert (rec.complete, rec.reason, rec.missing) == (False, "producer_closed", [(2, 4)])
            assert np.array_equal(rec.prompt_routed_experts, want) and rec.routed_experts.shape == (0, L, K)


@pytest.mark.parametrize("shard_size", [0, 4])
def test_restart_with_the_same_npz_dir_serves_the_old_records(tmp_path, shard_size):
    specs = workload(10, seed=4, prefix="r", features=False)
    want = {s.request_id: expected_record(s, L, K, E) for s in specs}
    npz = str(tmp_path / "npz")
    with EmbeddedPipeline(npz, shard_size=shard_size) as pipe:       # no trainer endpoint: records go to disk only
        _run(pipe, specs, seed=4)
    with EmbeddedPipeline(npz, serve="tcp://127.0.0.1:*", shard_size=shard_size,
                          fetched_retention_s=0) as pipe, TrainerClient(pipe.serve) as t:
        t0 = time.monotonic()
        with pytest.raises(RecordUnknown) as e:
            t.fetch(["r-0", "gone"], timeout_s=30, unknown="raise")
        assert time.monotonic() - t0 < 1.0 and e.value.request_ids == ["gone"]
        got = t.fetch(list(want), timeout_s=30, unknown="raise")
        again = t.fetch(list(want), timeout_s=30)                  # nothing retained: read from disk again
        for rid, rec in want.items():
            assert got[rid].equals(rec) and again[rid].equals(rec)
        # 1 + 10 + 10 reads, at least: nothing retained (with retention, the second fetch would read nothing). More
        # when the machine is slow: the client asks again for what is outstanding after 1 s, and a send that finds
        # the trainer's queue full is retried with another read (seen: 23)
        assert pipe.consumer.trainers.disk_reads >= 21 and len(pipe.consumer.trainers.fetched) == 0


def test_a_record_above_the_retention_bytes_can_be_fetched_again():
    # no npz dir: after its first fetch the record is only in the retention. A record larger than the whole byte
    # bound used to be dropped once sent, so a trainer that crashed while receiving it waited out every later fetch
    rid, n = "long-sample", 600
    want = true_rows(5, np.arange(n), L, K, E)
    with EmbeddedPipeline(None, serve="tcp://127.0.0.1:*", fetched_retention_bytes=n * L * K) as pipe, \
            TrainerClient(pipe.serve) as t:
        assert want.nbytes > pipe.consumer.trainers.fetched.max_bytes
        p = pipe.producer(num_layers=L, top_k=K)
        p.open(rid, prompt_len=n)
        p.publish_rows([rid], [0], [n], want)
        p.finish(rid, num_output_tokens=0)
        assert p.flush(10)
        first = t.fetch([rid], timeout_s=20)[rid]
        again = t.fetch([rid], timeout_s=5)[rid]
        for rec in (first, again):
            assert rec.complete and np.array_equal(rec.prompt_routed_experts, want)
            assert rec.routed_experts.shape == (0, L, K)
        fetched = pipe.consumer.trainers.fetched
        assert (len(fetched), fetched.bytes) == (1, want.nbytes)
        p.close()
