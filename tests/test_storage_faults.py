"""An npz dir that stops taking writes: records are held, counted and retried; after a repair every one lands."""

import logging
import re
import shutil

import pytest

from routing_replay.consumer import load_records
from routing_replay.consumer.service import Intake
from routing_replay.apps.embedded import EmbeddedPipeline
from routing_replay.apps.synthetic import SyntheticEngine, expected_record, workload
from tests.procs import wait_until

L, K, E = 4, 2, 16


def _break(d):
    """A regular file where the directory was: every write fails, even as root."""
    shutil.rmtree(d)
    d.write_bytes(b"not a directory")


def _repair(d):
    d.unlink()
    d.mkdir()


@pytest.mark.parametrize("shard_size", [0, 3])
def test_records_survive_an_unwritable_npz_dir_and_land_after_repair(tmp_path, caplog, shard_size):
    npz = tmp_path / "npz"
    specs = workload(12, seed=5, prefix="w", features=False)
    want = {s.request_id: expected_record(s, L, K, E) for s in specs}
    with EmbeddedPipeline(str(npz), shard_size=shard_size, write_retry_max_s=0.2) as pipe:
        c = pipe.consumer
        _break(npz)
        with pipe.producer(num_layers=L, top_k=K) as p:
            SyntheticEngine(num_layers=L, top_k=K, num_experts=E).run(p, specs, seed=5)
            assert p.flush(10)
        assert pipe.wait_idle(20)
        wait_until(lambda: c.writer.retry_pending == 12 - 12 % max(shard_size, 1), 10, "failed writes held")
        assert c.acc.stats.finished == 12 and c.writer.records == 0 and c.writer.write_failed >= 1
        with caplog.at_level(logging.INFO, logger="routing_replay.consumer"):
            c._log_stats()
        line = [r.getMessage() for r in caplog.records if "write_failed=" in r.getMessage()][-1]
        m = re.search(r"records=(\d+) .* written=(\d+) write_failed=(\d+) write_retry_pending=(\d+)", line)
        assert (int(m.group(1)), int(m.group(2)), int(m.group(4))) == (12, 0, c.writer.retry_pending)
        assert int(m.group(3)) >= 1
        _repair(npz)
    # close() wrote the last partial shard and retried what was held
    assert c.writer.records == 12 and c.writer.retry_pending == 0 and c.writer.lost == 0
    got = load_records(npz)
    assert set(got) == set(want)
    for rid, rec in want.items():
        assert got[rid].equals(rec), rid


def test_held_records_beyond_the_bound_go_to_the_spill_dir_and_land_after_repair(tmp_path):
    npz, spill = tmp_path / "npz", tmp_path / "spill"
    specs = workload(6, seed=6, prefix="s", features=False)
    want = {s.request_id: expected_record(s, L, K, E) for s in specs}
    # a bound of 1 byte: every held record goes to spill/unwritten; intake stays open
    with EmbeddedPipeline(str(npz), store_max_bytes=1, spill_dir=str(spill), write_retry_max_s=0.2) as pipe:
        c = pipe.consumer
        _break(npz)
        with pipe.producer(num_layers=L, top_k=K) as p:
            SyntheticEngine(num_layers=L, top_k=K, num_experts=E).run(p, specs, seed=6)
            assert p.flush(10)
        wait_until(lambda: c.writer.retry_pending == 6, 10, "6 held")
        assert len(list((spill / "unwritten").glob("*.npz"))) == 6 and c.intake is Intake.OPEN
        _repair(npz)
        wait_until(lambda: c.writer.records == 6, 20, "all 6 written after the repair")
        assert c.writer.retry_pending == 0 and c.writer.lost == 0
        assert list((spill / "unwritten").glob("*.npz")) == []
    got = load_records(npz)
    for s in specs:
        assert got[s.request_id].equals(want[s.request_id]), s.request_id


def test_write_backlog_beyond_the_bound_without_spill_pauses_intake_until_repaired(tmp_path):
    npz = tmp_path / "npz"
    specs = workload(8, seed=7, prefix="b", features=False)
    want = {s.request_id: expected_record(s, L, K, E) for s in specs}
    with EmbeddedPipeline(str(npz), store_max_bytes=1, write_retry_max_s=0.2) as pipe:
        c = pipe.consumer
        _break(npz)
        with pipe.producer(num_layers=L, top_k=K) as p:
            SyntheticEngine(num_layers=L, top_k=K, num_experts=E).run(p, specs, seed=7)
            assert p.flush(10)
            wait_until(lambda: c.intake is Intake.PAUSED, 10, "intake paused")
            acked = c.link.acked
            wait_until(lambda: c.writer.write_failed >= 3, 10, "retries failing")
            assert c.link.acked == acked                      # nothing more taken while paused
            _repair(npz)
            wait_until(lambda: c.writer.records == 8, 30, "all 8 written after the repair")
            wait_until(lambda: c.intake is Intake.OPEN, 5, "intake open again")
            assert c.writer.retry_pending == 0 and c.writer.lost == 0
    got = load_records(npz)
    for s in specs:
        assert got[s.request_id].equals(want[s.request_id]), s.request_id
