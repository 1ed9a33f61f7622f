"""A subscription survives its consumer's restart: `routing-replay subscribe` (a real process) resubscribes when the
restarted consumer (kill -9, then a new process on the same endpoint) is back, says so, and gets the records."""

import re
import signal

from tests.procs import Proc, start_broker, start_consumer, stop_all


def test_subscribe_gets_records_after_its_consumer_is_killed_and_restarted(tmp_path):
    serve = f"ipc://{tmp_path}/serve"
    broker, fe, be = start_broker("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "--heartbeat-ms", "200")
    c1 = start_consumer(be, "--serve", serve, "--heartbeat-ms", "200")
    sub = Proc(["subscribe", "--connect", serve, "--count", "10", "--prefix", "rs-"])
    c2 = synth = None
    try:
        c1.wait_for(r"subscriber .* prefix='rs-' subscribers=1")
        c1.kill9()
        c2 = start_consumer(be, "--serve", serve, "--heartbeat-ms", "200")
        # the subscriber noticed the cut and subscribed again to the new process
        c2.wait_for(r"subscriber .* prefix='rs-' subscribers=1", 20)
        sub.wait_for(r"consumer ipc://\S+ back after [\d.]+s: resubscribed prefix='rs-' gaps=1", 20)
        broker.wait_for(r"consumers=1\b", 20)
        synth = Proc(["synth", "--connect", fe, "--requests", "10", "--prefix", "rs", "--seed", "3"])
        assert synth.p.wait(120) == 0
        assert sub.p.wait(60) == 0
        sub.stop()
        got = {m.group(1): (m.group(2), m.group(3)) for m in (
            re.match(r"(rs-\S+) prompt=\d+ .* complete=(\w+) reason=(\S+) ", ln) for ln in sub.lines) if m}
        assert sorted(got) == sorted(f"rs-{i}" for i in range(10)), "".join(sub.lines[-20:])
        # the synthetic workload aborts some requests (synth's own run checks those records exactly)
        assert all(v in (("True", "-"), ("False", "abort")) for v in got.values()), got
        assert any("disconnected: subscription prefix='rs-' cut" in ln for ln in sub.lines)
    finally:
        for p in (sub, synth, c1):
            if p is not None and p.alive():
                p.stop(signal.SIGKILL)
        stop_all(c2, broker)
