"""Faults on real processes: kill -9 of broker, consumer and producer, a 10 s broker outage, a full replay buffer,
a slow trainer; and the delivery machinery on real sockets (link gaps, sequence gaps, acks, rewinds).

Every finished request's record must be complete and bit-exact, or flagged incomplete with exactly the positions
it lacks; a wrong record fails the test. Each fault test prints one `figures:` line (pytest -s) with the numbers
docs/RELIABILITY.md reports.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import zmq

from routing_replay.broker import Broker
from routing_replay.broker.ownership import rendezvous as _hrw
from routing_replay.consumer import Consumer
from routing_replay.producer import Producer
from routing_replay.protocol import wire
from routing_replay.apps.synthetic import SyntheticEngine, expected_record, true_rows, workload
from tests.procs import start_broker, start_consumer, stop_all, wait_until
from tests.test_pipeline import check_records, wait_records

L, K, E = 4, 2, 16


class Paced:
    """Stand in for a Producer whose engine steps come at a fixed rate; samples the producer's buffers per step."""

    def __init__(self, p: Producer, step_s: float):
        self._p = p
        self.step_s = step_s
        self.steps = 0
        self.peak_replay_bytes = 0
        self._next = time.monotonic()
        self._stop = threading.Event()

    def __getattr__(self, name):
        return getattr(self._p, name)

    def publish_rows(self, *a):
        self.steps += 1
        self._next += self.step_s
        delay = self._next - time.monotonic()
        if delay > 0:
            self._stop.wait(delay)             # the load generator's clock (a fixed step rate), not a wait for state
        self.peak_replay_bytes = max(self.peak_replay_bytes, self._p.replay_bytes)
        return self._p.publish_rows(*a)


class EngineThread:
    """Run a SyntheticEngine in a thread; keep its exception for the test."""

    def __init__(self, eng: SyntheticEngine, producer, specs, seed: int):
        self.eng, self.error = eng, None
        self.t = threading.Thread(target=self._run, args=(producer, specs, seed), daemon=True)
        self.t.start()

    def _run(self, producer, specs, seed):
        try:
            self.eng.run(producer, specs, seed=seed)
        except BaseException as e:   # re-raised by join()
            self.error = e

    def join(self, timeout_s: float) -> None:
        self.t.join(timeout_s)
        assert not self.t.is_alive(), f"engine still running after {timeout_s}s"
        if self.error is not None:
            raise self.error


def spread(specs, every: int):
    for i, s in enumerate(specs):
        s.arrive_step = i * every
    return specs


def figures(name: str, **kv) -> None:
    print(f"\nfigures: {name} " + " ".join(f"{k}={v}" for k, v in kv.items()), flush=True)


def stats_line(proc, pattern: str) -> re.Match:
    """The last stats line of a process matching pattern (every stats line is one event with all numbers)."""
    for line in reversed(proc.lines):
        m = re.search(pattern, line)
        if m:
            return m
    raise AssertionError(f"no line matching {pattern!r}")


# ---- fault tests on real processes ------------------------------------------------------------------------------


def test_broker_killed_mid_stream_and_restarted_every_record_exact(tmp_path):
    broker, fe, be = start_broker("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "--heartbeat-ms", "200",
                                  "--restart-grace-ms", "1000")
    d1, d2 = tmp_path / "c1", tmp_path / "c2"
    c1 = start_consumer(be, "--npz-dir", str(d1), "--consumer-id", "c1", "--heartbeat-ms", "200")
    c2 = start_consumer(be, "--npz-dir", str(d2), "--consumer-id", "c2", "--heartbeat-ms", "200")
    broker.wait_for("consumers=2")
    broker2 = None
    specs = spread(workload(120, seed=21, prefix="bk"), 4)
    eng = SyntheticEngine(num_layers=L, top_k=K, num_experts=E, token_budget=64)
    try:
        with Producer(fe, num_layers=L, top_k=K, heartbeat_interval_ms=200, resend_timeout_ms=2000) as p:
            paced = Paced(p, 0.003)
            run = EngineThread(eng, paced, specs, 21)
            wait_until(lambda: len(eng.finished) >= 25, 60, "25 requests finished")
            in_flight = p.unacked_msgs                     # sent or queued, not yet acknowledged
            broker.kill9()
            step_at_kill = paced.steps
            broker2, _, _ = start_broker(fe, be, "--heartbeat-ms", "200", "--restart-grace-ms", "1000")
            run.join(120)
            assert p.wait_acked(60)
            assert p.stats.dropped_msgs == 0 and p.stats.rewinds >= 1
            st = p.stats
        recs = wait_records([d1, d2], len(specs))
        exact, flagged = check_records(specs, recs)
        assert exact == len(eng.finished) and flagged == len(eng.aborted) and exact + flagged == len(specs)
        # the restarted broker saw both consumers come back before it routed anything, and each one claimed the
        # requests it held (no request moved: a moved one would be incomplete on both consumers)
        assert len(list(d1.glob("*.npz"))) + len(list(d2.glob("*.npz"))) == len(specs)
        for c in ("c1", "c2"):
            broker2.wait_for(rf"broker consumer {c} holds=\d+ claimed=\d+ refused=0 ", 10)
        figures("broker_kill", steps_at_kill=step_at_kill, msgs_unacked_at_kill=in_flight, resent=st.resent_msgs,
                rewinds=st.rewinds, records_checked=len(recs),
                records_complete=exact, records_flagged=flagged, records_wrong=0)
    finally:
        stop_all(c1, c2, broker2)
        broker.stop()


def test_consumer_killed_with_unacked_rows_is_recovered_by_replay(tmp_path):
    """c2 cannot apply (SIGSTOP) the rows sent to it, then dies: the producer resends them to c2's successor."""
    # (--open-group-max 0: each request on its own hash's consumer, which the test picks its ids by)
    broker, fe, be = start_broker(f"ipc://{tmp_path}/f", f"ipc://{tmp_path}/b", "--heartbeat-ms", "200",
                                  "--open-group-max", "0")
    d1, d2 = tmp_path / "c1", tmp_path / "c2"
    c1 = start_consumer(be, "--npz-dir", str(d1), "--consumer-id", "c1", "--heartbeat-ms", "200",
                        "--stats-interval", "0.1")
    c2 = start_consumer(be, "--npz-dir", str(d2), "--consumer-id", "c2", "--heartbeat-ms", "200")
    broker.wait_for("consumers=2")
    c2b = None
    P, G, split = 40, 10, 25
    ids = [f"k{i}" for i in range(16)]
    owner = {rid: _hrw(rid.encode(), [b"c1", b"c2"]) for rid in ids}
    assert set(owner.values()) == {b"c1", b"c2"}
    try:
        with Producer(fe, num_layers=L, top_k=K, heartbeat_interval_ms=200, resend_timeout_ms=2000) as p:
            for rid in ids:
                p.open(rid, prompt_len=P)
            assert p.wait_acked(10)
            c2.p.send_signal(signal.SIGSTOP)
            p.publish_rows(ids, [0] * 16, [split] * 16,
                           np.concatenate([true_rows(i, np.arange(split), L, K, E) for i in range(16)]))
            assert p.flush(10)
            # c1 applies its part of the delta; c2 cannot (the broker may already count it silent)
            wait_until(lambda: any(re.search(r"consumer c1 .*delta_msgs=[12] ", x) for x in c1.lines), 10, "c1 rows")
            unacked_at_kill = p.unacked_msgs
            c2.kill9()
            c2b = start_consumer(be, "--npz-dir", str(d2), "--consumer-id", "c2", "--heartbeat-ms", "200")
            # the rest goes out once the broker has the successor (before that it would still go to c2's dead
            # link: more unacked parts, the same records; tests/test_broker.py covers that order)
            epoch = c2b.wait_for(r"consumer c2 connected .* epoch=(\d+)").group(1)
            broker.wait_for(rf"consumer joined id=c2 epoch={epoch} ")
            end = P + G - 1
            p.publish_rows(ids, [split] * 16, [end - split] * 16,
                           np.concatenate([true_rows(i, np.arange(split, end), L, K, E) for i in range(16)]))
            for rid in ids:
                p.finish(rid, num_output_tokens=G)
            assert p.wait_acked(30)
            st = p.stats
        recs = wait_records([d1, d2], 16)
        for i, rid in enumerate(ids):
            full = true_rows(i, np.arange(P + G), L, K, E)
            full[P + G - 1] = -1
            r = recs[rid]
            assert (r.complete, r.reason, r.missing) == (True, "", []), (rid, r.reason, r.missing)
            assert np.array_equal(r.prompt_routed_experts, full[:P]) and np.array_equal(r.routed_experts, full[P:])
            if owner[rid] == b"c1":
                assert (d1 / f"{rid}.npz").exists()        # c1's requests never moved
        assert st.rewinds >= 1 and st.resent_msgs >= 1
        lost = broker.wait_for(r"consumer (?:expired|lost) id=c2 .*unacked_parts=(\d+)")
        assert int(lost.group(1)) == 1
        figures("consumer_kill", msgs_unacked_at_kill=unacked_at_kill, resent=st.resent_msgs, rewinds=st.rewinds,
                records_checked=16, records_complete=16, records_flagged=0, records_wrong=0)
    finally:
        stop_all(c1, c2b, broker)


def test_consumer_killed_after_acking_its_rows_flags_exactly_what_it_held(tmp_path):
    """Acknowledged means applied in the consumer's memory: rows c2 applied and acked die with it. Its requests
    move to c1 and are flagged consumer_lost with exactly those positions missing; c1's requests are untouched."""
    # (--open-group-max 0: each request on its own hash's consumer, which the test picks its ids by)
    broker, fe, be = start_broker(f"ipc://{tmp_path}/f", f"ipc://{tmp_path}/b", "--heartbeat-ms", "200",
                                  "--open-group-max", "0")
    d1, d2 = tmp_path / "c1", tmp_path / "c2"
    c1 = start_consumer(be, "--npz-dir", str(d1), "--consumer-id", "c1", "--heartbeat-ms", "200")
    c2 = start_consumer(be, "--npz-dir", str(d2), "--consumer-id", "c2", "--heartbeat-ms", "200")
    broker.wait_for("consumers=2")
    P, G, split = 40, 10, 25
    ids = [f"k{i}" for i in range(16)]
    owner = {rid: _hrw(rid.encode(), [b"c1", b"c2"]) for rid in ids}
    try:
        with Producer(fe, num_layers=L, top_k=K, heartbeat_interval_ms=200) as p:
            for rid in ids:
                p.open(rid, prompt_len=P)
            p.publish_rows(ids, [0] * 16, [split] * 16,
                           np.concatenate([true_rows(i, np.arange(split), L, K, E) for i in range(16)]))
            assert p.wait_acked(10)                        # both consumers applied and acked: nothing to resend
            c2.kill9()
            broker.wait_for(r"consumer expired id=c2 .*in_flight_requests=8 unacked_parts=0", 10)
            end = P + G - 1
            p.publish_rows(ids, [split] * 16, [end - split] * 16,
                           np.concatenate([true_rows(i, np.arange(split, end), L, K, E) for i in range(16)]))
            for rid in ids:
                p.finish(rid, num_output_tokens=G)
            assert p.wait_acked(10) and p.stats.resent_msgs == 0
        recs = wait_records([d1], 16)
        flagged = 0
        for i, rid in enumerate(ids):
            r = recs[rid]
            full = true_rows(i, np.arange(P + G), L, K, E)
            full[P + G - 1] = -1
            if owner[rid] == b"c1":                        # untouched
                assert (r.complete, r.reason, r.missing) == (True, "", [])
            else:                                          # moved to c1: the rows c2 held are missing, exactly
                assert (r.complete, r.reason, r.missing) == (False, "consumer_lost", [(0, split)])
                full[:split] = -1
                flagged += 1
            assert np.array_equal(r.prompt_routed_experts, full[:P]) and np.array_equal(r.routed_experts, full[P:])
        figures("consumer_kill_after_ack", msgs_unacked_at_kill=0, records_checked=16, records_complete=16 - flagged,
                records_flagged=flagged, records_wrong=0)
    finally:
        stop_all(c1, broker)


PRODUCER_SCRIPT = """
import sys
import numpy as np
from routing_replay.producer import Producer
from routing_replay.apps.synthetic import true_rows
p = Producer(sys.argv[1], num_layers=48, top_k=8, heartbeat_interval_ms=200, producer_id="doomed")
ids = [f"pk{i}" for i in range(8)]
for rid in ids:
    p.open(rid, prompt_len=3000)
rows = np.concatenate([true_rows(i, np.arange(2000), 48, 8, 128) for i in range(8)])
p.publish_rows(ids, [0] * 8, [2000] * 8, rows)
assert p.wait_acked(20)
print("READY", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("rows_kept", [True, False], ids=["kept_as_received", "copied"])
def test_producer_killed_its_requests_aborted_and_consumer_memory_freed(tmp_path, rows_kept):
    """The 8 requests' rows came in one prefill message: by default the consumer keeps them as received and moves
    them into its arena when the aborts come (their records are not complete); with --copy-rows they were copied
    on arrival, and the arena's kept pages are checked exactly."""
    Lp, Kp = 48, 8
    broker, fe, be = start_broker(f"ipc://{tmp_path}/f", f"ipc://{tmp_path}/b", "--heartbeat-ms", "200",
                                  "--producer-timeout-ms", "1000")
    c = start_consumer(be, "--npz-dir", str(tmp_path / "out"), "--heartbeat-ms", "200", "--stats-interval", "0.2",
                       *(() if rows_kept else ("--copy-rows",)))
    broker.wait_for("consumers=1")
    base = c.wait_for(r"held_MB=([\d.]+)").group(1)
    proc = subprocess.Popen([sys.executable, "-c", PRODUCER_SCRIPT, fe], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        assert proc.stdout.readline().strip() == "READY"
        wait_until(lambda: re.search(r"in_flight=8 .*held_MB=1[2-4]\.", c.lines[-1]) is not None, 10,
                   "8 requests of 2000 rows held")
        held = stats_line(c, r"held_MB=([\d.]+)").group(1)
        t_kill = time.monotonic()
        proc.kill()
        proc.wait(10)
        m = broker.wait_for(r"producer lost id=doomed .*why=producer_lost .*open_requests=(\d+) aborted=(\d+)", 10)
        assert (m.group(1), m.group(2)) == ("8", "8")
        recs = wait_records([tmp_path / "out"], 8, 10)
        t_records = time.monotonic() - t_kill
        for i in range(8):
            r = recs[f"pk{i}"]
            assert (r.complete, r.reason, r.missing) == (False, "producer_lost", [(2000, 3000)])
            rows = true_rows(i, np.arange(3000), Lp, Kp, 128)
            rows[2000:] = -1
            assert np.array_equal(r.prompt_routed_experts, rows) and r.routed_experts.shape == (0, Lp, Kp)
        wait_until(lambda: re.search(r"in_flight=0 .*held_MB=0\.0 ", c.lines[-1]) is not None, 10, "memory freed")
        kept = re.search(r"adopted=(\d+) adopted_records=(\d+) materialized=(\d+) ", c.lines[-1]).groups()
        assert kept == (("8", "0", "8") if rows_kept else ("0", "0", "0"))
        if rows_kept:           # moved to the arena one record at a time, as the npz writer let go of the last
            return
        # the records' pages (8 x 3000 rows of 768 B = 2.304 MB each, their -1 tails included) are kept for the
        # next requests once their views are gone: all 8, or 7 while the npz writer still holds its last record
        wait_until(lambda: re.search(r" kept_MB=(16\.1|18\.4) peak_MB=18\.4 ", c.lines[-1]) is not None, 10,
                   "pages of freed records kept")
        figures("producer_kill", open_requests=8, aborted=8, seconds_kill_to_records=round(t_records, 2),
                held_MB_before=held, held_MB_after="0.0", held_MB_baseline=base, records_checked=8,
                records_complete=0, records_flagged=8, records_wrong=0)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stdin.close()
        stop_all(c, broker)


def test_broker_unreachable_for_10s_then_back_nothing_lost_within_the_bound(tmp_path):
    broker, fe, be = start_broker("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "--heartbeat-ms", "200",
                                  "--restart-grace-ms", "1000")
    d1, d2 = tmp_path / "c1", tmp_path / "c2"
    c1 = start_consumer(be, "--npz-dir", str(d1), "--consumer-id", "c1", "--heartbeat-ms", "200")
    c2 = start_consumer(be, "--npz-dir", str(d2), "--consumer-id", "c2", "--heartbeat-ms", "200")
    broker.wait_for("consumers=2")
    broker2 = None
    specs = spread(workload(200, seed=31, prefix="out"), 8)
    eng = SyntheticEngine(num_layers=L, top_k=K, num_experts=E, token_budget=64)
    bound = 64 << 10
    spill = tmp_path / "spill"
    try:
        p = Producer(fe, num_layers=L, top_k=K, heartbeat_interval_ms=200, resend_timeout_ms=2000,
                     replay_max_bytes=bound, spill_dir=spill)
        with p:
            paced = Paced(p, 0.008)
            run = EngineThread(eng, paced, specs, 31)
            wait_until(lambda: paced.steps >= 120, 30, "120 steps")
            broker.kill9()
            t_down = time.monotonic()
            threading.Event().wait(10)                     # the outage: 10 s of engine steps with no broker
            outage_steps = paced.steps
            unacked_at_return = p.unacked_msgs
            spilled_at_return = p.spilled_bytes
            broker2, _, _ = start_broker(fe, be, "--heartbeat-ms", "200", "--restart-grace-ms", "1000")
            down_s = time.monotonic() - t_down
            run.join(120)
            assert p.wait_acked(60)
            st = p.stats
        assert not spill.exists() or not list(spill.rglob("*.seg"))   # the spill files are gone with their acks
        assert st.dropped_msgs == 0 and st.spilled_msgs > 0 and st.replay_full == 0
        assert paced.peak_replay_bytes <= bound            # memory stayed within the bound: the rest was spilled
        recs = wait_records([d1, d2], len(specs))
        exact, flagged = check_records(specs, recs)
        assert exact + flagged == len(specs)
        figures("broker_outage", down_s=round(down_s, 1), steps_during_outage=outage_steps - 120,
                msgs_unacked_at_return=unacked_at_return, spilled_MB_at_return=round(spilled_at_return / 1e6, 2),
                replay_peak_KB=paced.peak_replay_bytes >> 10, replay_bound_KB=bound >> 10, resent=st.resent_msgs,
                dropped=st.dropped_msgs, records_checked=len(recs), records_complete=exact,
                records_flagged=flagged, records_wrong=0)
    finally:
        stop_all(c1, c2, broker2)
        broker.stop()


def test_beyond_the_bound_steps_are_dropped_and_records_flagged_never_wrong(tmp_path):
    broker, fe, be = start_broker(f"ipc://{tmp_path}/f", f"ipc://{tmp_path}/b", "--heartbeat-ms", "200",
                                  "--restart-grace-ms", "600")
    c = start_consumer(be, "--npz-dir", str(tmp_path / "out"), "--heartbeat-ms", "200")
    broker.wait_for("consumers=1")
    broker2 = None
    specs = spread(workload(60, seed=41, prefix="ov"), 3)
    eng = SyntheticEngine(num_layers=L, top_k=K, num_experts=E, token_budget=64)
    try:
        with Producer(fe, num_layers=L, top_k=K, heartbeat_interval_ms=200, resend_timeout_ms=2000,
                      replay_max_bytes=24 << 10, max_queue_bytes=32 << 10) as p:
            assert p.wait_acked(5)
            broker.kill9()
            eng.run(p, specs[:40], seed=41)                # while the broker is down: the bounds are hit
            assert p.stats.dropped_msgs > 0
            dropped_while_down = p.stats.dropped_msgs
            broker2, _, _ = start_broker(fe, be, "--heartbeat-ms", "200", "--restart-grace-ms", "600")
            assert p.wait_acked(30)
            eng.run(Paced(p, 0.003), specs[40:], seed=42)  # after it, at a rate the bounds carry: in full
            assert p.wait_acked(30)
            st = p.stats
        assert st.replay_full >= 1 and st.dropped_msgs == dropped_while_down
        recs = wait_records([tmp_path / "out"], len(specs))
        complete = flagged = 0
        for s in specs:
            r = recs[s.request_id]
            if s.abort_at is not None:
                assert not r.complete
                flagged += 1
                continue
            exp = expected_record(s, L, K, E)
            if r.complete:
                assert r.equals(exp), s.request_id
                complete += 1
                continue
            assert r.reason == "producer_queue_full" and r.missing, (s.request_id, r.reason)
            # every row outside the missing ranges is exact; every row inside is -1
            want = np.concatenate([exp.prompt_routed_experts, exp.routed_experts])
            got = np.concatenate([r.prompt_routed_experts, r.routed_experts])
            for a, b in r.missing:
                want[a:b] = -1
            assert np.array_equal(got, want), s.request_id
            flagged += 1
        assert flagged >= 1 and all(recs[s.request_id].complete for s in specs[40:] if s.abort_at is None)
        figures("beyond_bound", dropped_steps=st.dropped_msgs, dropped_rows=st.dropped_rows,
                replay_full_episodes=st.replay_full, records_checked=len(specs), records_complete=complete,
                records_flagged=flagged, records_wrong=0)
    finally:
        stop_all(c, broker2)
        broker.stop()


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_slow_trainer_on_the_fetch_path_keeps_consumer_memory_bounded(tmp_path):
    """A trainer that asks for every record and then does not read: records wait in the store (1 MiB, then the
    spill dir), the consumer's memory stays flat, and the trainer later gets every record, exact."""
    Lb, Kb = 48, 8
    broker, fe, be = start_broker(f"ipc://{tmp_path}/f", f"ipc://{tmp_path}/b")
    c = start_consumer(be, "--serve", "tcp://127.0.0.1:*", "--store-mb", "1", "--spill-dir", str(tmp_path / "sp"),
                       "--stats-interval", "0.2")
    serve = c.wait_for(r"serve=(\S+)").group(1)
    broker.wait_for("consumers=1")
    ctx = zmq.Context.instance()
    slow = ctx.socket(zmq.DEALER)
    slow.setsockopt(zmq.LINGER, 0)
    slow.setsockopt(zmq.RCVHWM, 1)
    slow.connect(serve)
    specs = workload(48, seed=51, prefix="sl", max_prompt=400, features=False)
    ids = [s.request_id for s in specs]
    try:
        base = _rss_mb(c.p.pid)
        slow.send(wire.pack_header("fetch", "slow", 0, 1, ids, {"timeout_ms": 120_000}))
        eng = SyntheticEngine(num_layers=Lb, top_k=Kb, num_experts=128)
        with Producer(fe, num_layers=Lb, top_k=Kb) as p:
            eng.run(p, specs, seed=51)
            assert p.wait_acked(30)
        total_mb = sum((s.prompt_len + s.num_output) * Lb * Kb * 2 for s in specs) / 2**20
        wait_until(lambda: re.search(r"records=48 ", c.lines[-1]) is not None, 20, "48 records")
        store = stats_line(c, r"store=(\d+) store_MB=([\d.]+) spilled=(\d+) evicted=(\d+)")
        peak = _rss_mb(c.p.pid)
        in_store = int(store.group(1))
        assert int(store.group(3)) > 0 and int(store.group(4)) == 0
        assert all(float(m.group(1)) <= 1.05 for m in (re.search(r"store_MB=([\d.]+)", x) for x in c.lines) if m)
        # the trainer reads now, slowly, asking again for what has not come (TrainerClient does the same)
        got = {}
        deadline = time.monotonic() + 60
        while len(got) < len(ids) and time.monotonic() < deadline:
            if not slow.poll(1000):
                slow.send(wire.pack_header("fetch", "slow", 0, 2, sorted(set(ids) - set(got)),
                                           {"timeout_ms": 60_000}))
                continue
            frames = slow.recv_multipart(copy=False)
            h = wire.decode_header(frames[0].buffer)
            assert h.kind == "record", h.body
            got[h.key] = wire.decode_record(h, frames[1:])
        assert set(got) == set(ids)
        for s in specs:
            assert got[s.request_id].equals(expected_record(s, Lb, Kb, 128)), s.request_id
        wait_until(lambda: re.search(r" store=0 store_MB=0\.0 ", c.lines[-1]) is not None, 10, "store drained")
        assert not list((tmp_path / "sp").glob("*.npz"))
        figures("slow_trainer", records=len(ids), records_MB=round(total_mb, 1), store_bound_MB=1,
                in_store_while_stalled=in_store, spilled=store.group(3), evicted=store.group(4),
                rss_base_MB=round(base, 1), rss_stalled_MB=round(peak, 1), records_wrong=0)
        assert peak - base < 40                            # bound + 64 records queued to one trainer + slack
    finally:
        slow.close(0)
        stop_all(c, broker)


# ---- the delivery machinery on real sockets, one peer faked -----------------------------------------------------


def _data(kind, rid, seq, body, link=None, producer="p", epoch=7):
    return wire.pack_header(kind, producer, epoch, seq, rid, body, link)


def _open_body(P=4):
    return {"prompt_len": P, "num_cached": 0, "num_layers": L, "top_k": K}


def test_consumer_applies_only_the_next_link_number_and_asks_for_a_resync_after_a_gap(tmp_path):
    ctx = zmq.Context.instance()
    fake = ctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    ep = f"ipc://{tmp_path}/b"
    fake.bind(ep)
    got = {}
    c = Consumer(ep, consumer_id="cx", heartbeat_interval_ms=100, ack_interval_ms=10, finish_grace_s=0,
                 on_record=lambda r: got.__setitem__(r.request_id, r), context=ctx).start()

    def recv(kind, deadline_s=5.0):
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if fake.poll(100):
                cid, head = fake.recv_multipart()
                h = wire.decode_header(head)
                if h.kind == kind:
                    return h
        raise AssertionError(f"no {kind} from the consumer")

    def send(head, *payload):
        fake.send_multipart([b"cx", head, *payload])

    try:
        hello = recv("hello")
        assert hello.epoch == c.epoch
        rows = true_rows(1, np.arange(4), L, K, E)
        body = wire.delta_body([0], [2], L, K)
        send(_data("open", "a", 1, _open_body(), (99, 5, 1)))
        send(_data("delta", ["a"], 2, body, (99, 5, 2)), rows[:2].tobytes())
        send(_data("delta", ["a"], 4, wire.delta_body([3], [1], L, K), (99, 5, 4)), rows[3:].tobytes())  # lseq 3 lost
        ack = recv("ack")
        while "gap" not in ack.body:
            ack = recv("ack")
        assert ack.body == {"link": [99, 5, 2], "gap": 3}
        # a resync: generation 6 starts at lseq 1 and carries the producer's resend
        send(_data("delta", ["a"], 3, wire.delta_body([2], [2], L, K), (99, 6, 1)), rows[2:].tobytes())
        send(_data("finish", "a", 5, {"num_output": 1, "reason": "stop"}, (99, 6, 2)))
        # a message of the old generation that was still on its way is dropped
        send(_data("delta", ["a"], 9, wire.delta_body([0], [1], L, K), (99, 5, 5)), np.full((1, L, K), 7,
                                                                                           np.int16).tobytes())
        ack = recv("ack")
        while ack.body["link"] != [99, 6, 2]:
            ack = recv("ack")
        wait_until(lambda: "a" in got, 5, "record a")
        r = got["a"]
        assert (r.complete, r.missing) == (True, [])
        assert np.array_equal(r.prompt_routed_experts, rows)
        # a data message without a link number is refused (only the broker numbers them)
        send(_data("open", "b", 6, _open_body()))
        wait_until(lambda: c.bad.get("no_link") == 1, 5, "no_link counted")
        assert c.link.dropped == 2 and "b" not in c.acc.requests
    finally:
        c.close()
        fake.close(0)


def _broker_with_hand_driven_peers(tmp_path):
    """A real broker, a producer socket and a consumer socket (routing id c1) connected to it, driven by hand."""
    ctx = zmq.Context.instance()
    b = Broker(f"ipc://{tmp_path}/f", f"ipc://{tmp_path}/b", context=ctx, heartbeat_interval_ms=5000,
               ack_interval_ms=5).start()
    prod = ctx.socket(zmq.DEALER)
    cons = ctx.socket(zmq.DEALER)
    cons.setsockopt(zmq.ROUTING_ID, b"c1")
    for s in (prod, cons):
        s.setsockopt(zmq.LINGER, 0)
    prod.connect(b.frontend)
    cons.connect(b.backend)
    return b, prod, cons


def test_broker_accepts_in_seq_order_asks_rewinds_and_acks_a_contiguous_prefix(tmp_path):
    b, prod, cons = _broker_with_hand_driven_peers(tmp_path)

    def recv(sock, kind, deadline_s=5.0):
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if sock.poll(100):
                frames = sock.recv_multipart()
                h = wire.decode_header(frames[0])
                if h.kind == kind:
                    return h, frames[1:]
        raise AssertionError(f"no {kind}")

    try:
        cons.send(wire.pack_header("hello", "c1", 3, 1, "c1", {"broker": 0}))
        wait_until(lambda: len(b.ownership.live_ids) == 1, 5, "consumer joined")
        # data before hello: refused, and the producer is asked to say hello and rewind
        prod.send(_data("open", "a", 1, _open_body()))
        h, _ = recv(prod, "ack")
        assert h.body == {"epoch": 7, "upto": -1, "rewind": True, "hello": True} and h.epoch == b.epoch
        prod.send(wire.pack_header("hello", "p", 7, 0, "p", {"unacked_from": 1}))
        hb, _ = recv(prod, "heartbeat")
        assert hb.body == {"consumers": 1, "takes": ["opens", "finishes"]}
        prod.send(_data("open", "a", 1, _open_body()))
        prod.send_multipart([_data("delta", ["a"], 3, wire.delta_body([1], [1], L, K)), bytes(L * K * 2)])   # seq 2 missing
        h, _ = recv(prod, "ack")
        assert h.body == {"epoch": 7, "upto": 0, "rewind": True, "expect": 2}
        # the rewind: 1 again (a resend), then 2 and 3
        prod.send(_data("open", "a", 1, _open_body()))
        prod.send_multipart([_data("delta", ["a"], 2, wire.delta_body([0], [1], L, K)), bytes(L * K * 2)])
        prod.send_multipart([_data("delta", ["a"], 3, wire.delta_body([1], [1], L, K)), bytes(L * K * 2)])
        links = []
        for want in ("open", "open", "delta", "delta"):
            h, _ = recv(cons, want)
            links.append((h.seq, h.link))
        assert links == [(1, (b.epoch, 1, 1)), (1, (b.epoch, 1, 2)), (2, (b.epoch, 1, 3)), (3, (b.epoch, 1, 4))]
        assert b.stats.resent_in == 1 and b.stats.refused_gap == 1 and b.stats.refused_unknown == 1
        # nothing is acked to the producer before the consumer acks; then the contiguous prefix
        assert not prod.poll(100)
        cons.send(wire.pack_header("ack", "c1", 3, 2, "c1", {"link": [b.epoch, 1, 3]}))
        h, _ = recv(prod, "ack")
        # with the owner hint of the request opened (its consumer link's number), once
        assert h.body == {"epoch": 7, "upto": 2, "owners": [["a"], [b.links[b"c1"].num]]} and b.links[b"c1"].num == 1
        # an ack from the wrong link generation or consumer epoch moves nothing
        cons.send(wire.pack_header("ack", "c1", 3, 3, "c1", {"link": [b.epoch, 0, 4]}))
        cons.send(wire.pack_header("ack", "c1", 4, 3, "c1", {"link": [b.epoch, 1, 4]}))
        assert not prod.poll(200)
        # a gap report: the link starts generation 2, the broker goes back to the lowest seq lost on the link (it
        # refuses what follows until then) and the producer is asked to rewind from what is unacked
        cons.send(wire.pack_header("ack", "c1", 3, 4, "c1", {"link": [b.epoch, 1, 3], "gap": 4}))
        h, _ = recv(prod, "ack")
        assert h.body == {"epoch": 7, "upto": 2, "rewind": True, "expect": 3}
        prod.send_multipart([_data("delta", ["a"], 4, wire.delta_body([2], [1], L, K)), bytes(L * K * 2)])
        wait_until(lambda: b.stats.refused_gap == 2, 5, "seq 4 refused before 3 came again")
        prod.send_multipart([_data("delta", ["a"], 3, wire.delta_body([1], [1], L, K)), bytes(L * K * 2)])
        h, _ = recv(cons, "delta")
        assert (h.seq, h.link) == (3, (b.epoch, 2, 1))
        cons.send(wire.pack_header("ack", "c1", 3, 5, "c1", {"link": [b.epoch, 2, 1]}))
        h, _ = recv(prod, "ack")
        assert h.body == {"epoch": 7, "upto": 3}
        assert b.stats.link_resyncs == 1
    finally:
        prod.close(0)
        cons.close(0)
        b.close()


def test_a_link_resync_resends_the_brokers_own_messages_the_consumer_dropped(tmp_path):
    """`refused` and `abort` are the broker's own messages: no producer's rewind sends them again. When a consumer
    reports a gap, those it dropped (not acked) go first in the new link generation, in their order; those it acked
    do not. Real broker; the producer and the consumer are sockets driven by hand."""
    b, prod, cons = _broker_with_hand_driven_peers(tmp_path)

    def data_in(n, deadline_s=5.0):
        """The next n data messages on the consumer's socket: (kind, key, seq, link)."""
        out, deadline = [], time.monotonic() + deadline_s
        while len(out) < n and time.monotonic() < deadline:
            if cons.poll(100):
                h = wire.decode_header(cons.recv_multipart()[0])
                if h.kind != "heartbeat":
                    out.append((h.kind, h.key, h.seq, h.link))
        return out

    try:
        cons.send(wire.pack_header("hello", "c1", 3, 1, "c1", {"broker": 0}))
        wait_until(lambda: len(b.ownership.live_ids) == 1, 5, "consumer joined")
        prod.send(wire.pack_header("hello", "p", 7, 0, "p", {"unacked_from": 1}))
        wait_until(lambda: "p" in b.intake.producers, 5, "producer said hello")
        prod.send(_data("open", "a", 1, _open_body()))
        prod.send(_data("open", "b", 2, _open_body()))
        for seq, rid in ((3, "a"), (4, "b")):       # one row announced, half a row sent: refused for good
            prod.send_multipart([_data("delta", [rid], seq, wire.delta_body([0], [1], L, K)), bytes(L * K)])
        ep = b.epoch
        got = data_in(4)
        assert got == [("open", "a", 1, (ep, 1, 1)), ("open", "b", 2, (ep, 1, 2)),
                       ("refused", ["a"], 3, (ep, 1, 3)), ("refused", ["b"], 4, (ep, 1, 4))]
        prod.send(wire.pack_header("bye", "p", 7, 0, "p", {}))    # the producer leaves: a and b are aborted
        aborts = data_in(2)                          # in the ownership table's order
        first, second = sorted(aborts, key=lambda m: m[3])[0][1], sorted(aborts, key=lambda m: m[3])[1][1]
        assert {first, second} == {"a", "b"}
        assert aborts == [("abort", first, 0, (ep, 1, 5)), ("abort", second, 0, (ep, 1, 6))]
        wait_until(lambda: b.stats.aborted_for_lost_producer == 2, 5, "aborts counted")   # (after the sends)
        assert b.stats.refusals_out == 2
        # the consumer applied lseq 1-3 and missed 4: refused [b] and both aborts go again, in generation 2
        cons.send(wire.pack_header("ack", "c1", 3, 2, "c1", {"link": [ep, 1, 3], "gap": 4}))
        got = data_in(3)
        wait_until(lambda: b.stats.notices_resent == 3, 5, "resent counted")     # (after the sends)
        assert got == [("refused", ["b"], 4, (ep, 2, 1)), ("abort", first, 0, (ep, 2, 2)),
                       ("abort", second, 0, (ep, 2, 3))]
        assert (b.stats.link_resyncs, b.stats.notices_resent) == (1, 3)
        # acked: kept no longer, so a later resync sends nothing
        cons.send(wire.pack_header("ack", "c1", 3, 3, "c1", {"link": [ep, 2, 3]}))
        wait_until(lambda: b.stats.acks_in == 2, 5, "ack applied")
        cons.send(wire.pack_header("ack", "c1", 3, 4, "c1", {"link": [ep, 2, 3], "gap": 4}))
        wait_until(lambda: b.stats.link_resyncs == 2, 5, "second resync")
        assert data_in(1, 0.5) == [] and b.stats.notices_resent == 3 and not b.links[b"c1"].notices
    finally:
        prod.close(0)
        cons.close(0)
        b.close()


def test_producer_rewinds_for_a_new_broker_and_resends_in_seq_order(tmp_path):
    """A fake broker: the producer keeps what was not acked, and sends it again, hello first, to a new epoch."""
    ctx = zmq.Context.instance()
    fake = ctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    ep = f"ipc://{tmp_path}/f"
    fake.bind(ep)

    def recv_data(n):
        out = []
        deadline = time.monotonic() + 5
        while len(out) < n and time.monotonic() < deadline:
            if fake.poll(100):
                frames = fake.recv_multipart()
                h = wire.decode_header(frames[1])
                out.append((frames[0], h.kind, h.seq, h.body.get("unacked_from")))
        return out

    with Producer(ep, num_layers=L, top_k=K, heartbeat_interval_ms=60_000, resend_timeout_ms=60_000) as p:
        p.open("a", prompt_len=4)
        p.publish_rows(["a"], [0], [2], true_rows(1, np.arange(2), L, K, E))
        p.finish("a", num_output_tokens=1)
        got = recv_data(4)
        ident = got[0][0]
        assert [g[1:] for g in got] == [("hello", 0, 1), ("open", 1, None), ("delta", 2, None), ("finish", 3, None)]

        def reply(epoch, kind, body):
            fake.send_multipart([ident, wire.pack_header(kind, "broker", epoch, 0, p.producer_id, body)])

        reply(100, "heartbeat", {"consumers": 1})
        reply(100, "ack", {"epoch": p.epoch, "upto": 1})
        wait_until(lambda: p.unacked_msgs == 2, 5, "seq 1 acked")
        reply(200, "heartbeat", {"consumers": 1})          # another broker incarnation answers
        again = recv_data(3)
        assert [g[1:] for g in again] == [("hello", 0, 2), ("delta", 2, None), ("finish", 3, None)]
        assert again[0][0] == ident                         # the routing id survives, so acks find the producer
        reply(200, "ack", {"epoch": p.epoch, "upto": 3})
        assert p.wait_acked(5)
        assert (p.stats.rewinds, p.stats.resent_msgs, p.stats.acked_msgs, p.stats.broker_epochs) == (1, 2, 3, 2)
    fake.close(0)


# ---- replays applied to an accumulator (no sockets) ---------------------------------------------------------------

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from routing_replay.consumer import Accumulator  # noqa: E402


class Msgs:
    """Numbered wire messages of one producer, applied to an accumulator in any order a test chooses."""

    def __init__(self, **kw):
        self.acc = Accumulator(**kw)
        self.out: list = []
        self.msgs: list = []

    def add(self, kind, key, body, frames=()):
        self.msgs.append((wire.pack_header(kind, "p", 5, len(self.msgs) + 1, key, body), list(frames)))
        return len(self.msgs)

    def open(self, rid, P):
        return self.add("open", rid, {"prompt_len": P, "num_cached": 0, "num_layers": L, "top_k": K})

    def delta(self, rid, start, rows):
        return self.add("delta", [rid], wire.delta_body([start], [len(rows)], L, K),
                        [np.ascontiguousarray(rows, np.int16).tobytes()])

    def finish(self, rid, G):
        return self.add("finish", rid, {"num_output": G, "reason": "stop"})

    def apply(self, seq, now=0.0):
        head, frames = self.msgs[seq - 1]
        self.out += self.acc.apply(wire.decode_header(head), frames, now)


def test_replayed_open_finish_and_deltas_never_resurrect_duplicate_or_wipe():
    m = Msgs(finish_grace_s=1.0)
    P, G = 6, 3
    good = true_rows(1, np.arange(P + G), L, K, E)
    m.open("a", P)                                        # 1
    m.delta("a", 0, good[:4])                             # 2
    m.delta("a", 4, good[4:8])                            # 3
    m.finish("a", G)                                      # 4
    for s in (1, 2, 1, 3):                                # a re-sent open in flight keeps the rows
        m.apply(s)
    assert m.acc.requests["a"].ranges[(0, L)].n == 8
    m.apply(4)
    assert len(m.out) == 1 and m.out[0].complete
    for s in (1, 2, 3, 4):                                # the whole stream again, after the record went out
        m.apply(s)
    assert len(m.out) == 1 and m.acc.in_flight == 0
    assert (m.acc.stats.replayed_opens, m.acc.stats.late_msgs) == (1, 3)
    # the same request id opened again by a newer message is a new request
    m.open("a", 2)                                        # 5
    m.apply(5)
    assert m.acc.in_flight == 1 and m.acc.requests["a"].prompt_len == 2


def test_replayed_open_while_the_finish_waits_for_late_rows_is_ignored():
    m = Msgs(finish_grace_s=1.0)
    good = true_rows(2, np.arange(8), L, K, E)
    m.open("a", 5)
    m.delta("a", 0, good[:3])                             # positions 3..6 come late (another stage, say)
    m.finish("a", 3)
    m.delta("a", 3, good[3:7])
    for s in (1, 2, 3, 1, 3):                             # finish, then open and finish re-sent during the grace
        m.apply(s, now=0.1)
    assert m.out == [] and m.acc.stats.replayed_opens == 1
    m.apply(4, now=0.2)
    (r,) = m.out
    assert r.complete and np.array_equal(np.concatenate([r.prompt_routed_experts, r.routed_experts])[:7], good[:7])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_rewind_schedule_gives_the_record_of_in_order_delivery(data):
    """The delivery guarantee at the consumer: messages arrive in seq order, except that delivery may go back to
    any seq after the last acknowledged one and replay from there (a rewind). Whatever the schedule, the record
    equals the one in-order delivery gives, including overwrites (spec decode, preemption)."""
    P = data.draw(st.integers(1, 12), "P")
    G = data.draw(st.integers(1, 6), "G")
    T = P + G - 1
    m = Msgs(finish_grace_s=0.0)
    m.open("r", P)
    # writes: a first pass over everything, then overwrites of random ranges with other values
    m.delta("r", 0, true_rows(7, np.arange(T), L, K, E, 1))
    for _ in range(data.draw(st.integers(0, 6), "overwrites")):
        a = data.draw(st.integers(0, T - 1))
        b = data.draw(st.integers(a + 1, T))
        m.delta("r", a, true_rows(7, np.arange(a, b), L, K, E, data.draw(st.integers(0, 3))))
    m.finish("r", G)
    n = len(m.msgs)
    truth = np.full((T, L, K), -1, np.int16)
    for head, frames in m.msgs:
        h = wire.decode_header(head)
        if h.kind == "delta":
            d = wire.parse_delta(h)
            s0, c0 = int(d.starts[0]), int(d.counts[0])
            truth[s0:s0 + c0] = np.frombuffer(frames[0], np.int16).reshape(c0, L, K)
    acked, seq, applied = 0, 1, 0
    while seq <= n:
        m.apply(seq)
        applied += 1
        if data.draw(st.booleans(), "ack"):
            acked = seq
        if acked < seq < n and applied < 100 and data.draw(st.integers(0, 3), "rewind?") == 3:
            seq = data.draw(st.integers(acked + 1, seq), "rewind to")
        else:
            seq += 1
    assert len(m.out) == 1
    r = m.out[0]
    got = np.concatenate([r.prompt_routed_experts, r.routed_experts])
    assert r.complete and np.array_equal(got[:T], truth) and (got[T:] == -1).all()
