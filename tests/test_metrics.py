"""The Prometheus endpoint (protocol/metrics.py): the exposition text on values alone, then real `routing-replay
broker` and `consume` processes started with `--metrics`, scraped over HTTP, their counters equal to what was sent."""

import http.client
import re
import urllib.request

import numpy as np
import pytest

from routing_replay.apps.synthetic import workload
from routing_replay.protocol.metrics import Metric, MetricsServer, counter, gauge, parse_address, render
from tests.procs import Proc, start_broker, start_consumer, wait_until
from tests.test_pipeline import E, K, L, check_records, run_engine, wait_records


def test_render_groups_samples_escapes_labels_and_types():
    text = render([
        counter("broker_msgs_in", "messages in", 7),
        gauge("broker_consumers", "live links", 2),
        counter("consumer_records", "records", 5, state="complete"),
        counter("broker_msgs_out_total", "messages out", 3),
        counter("consumer_records", "records", 1, state="incomplete", reason='bad "q"\\n'),
        gauge("ratio", "a float", 0.25),
    ])
    assert text == (
        "# HELP routing_replay_broker_msgs_in_total messages in\n"
        "# TYPE routing_replay_broker_msgs_in_total counter\n"
        "routing_replay_broker_msgs_in_total 7\n"
        "# HELP routing_replay_broker_consumers live links\n"
        "# TYPE routing_replay_broker_consumers gauge\n"
        "routing_replay_broker_consumers 2\n"
        "# HELP routing_replay_consumer_records_total records\n"
        "# TYPE routing_replay_consumer_records_total counter\n"
        'routing_replay_consumer_records_total{state="complete"} 5\n'
        'routing_replay_consumer_records_total{reason="bad \\"q\\"\\\\n",state="incomplete"} 1\n'
        "# HELP routing_replay_broker_msgs_out_total messages out\n"
        "# TYPE routing_replay_broker_msgs_out_total counter\n"
        "routing_replay_broker_msgs_out_total 3\n"
        "# HELP routing_replay_ratio a float\n"
        "# TYPE routing_replay_ratio gauge\n"
        "routing_replay_ratio 0.25\n")
    with pytest.raises(ValueError, match="kind must be counter or gauge"):
        render([Metric("x", "histogram", "h", 1)])


@pytest.mark.parametrize("addr,want", [("127.0.0.1:9400", ("127.0.0.1", 9400)), (":9400", ("0.0.0.0", 9400)),
                                       ("9400", ("127.0.0.1", 9400)), ("[::1]:0", ("::1", 0))])
def test_parse_address(addr, want):
    assert parse_address(addr) == want


@pytest.mark.parametrize("addr,msg", [("host:http", "is not a number"), ("127.0.0.1:70000", "out of range")])
def test_parse_address_refuses(addr, msg):
    with pytest.raises(ValueError, match=msg):
        parse_address(addr)


def test_server_answers_metrics_404_elsewhere_and_retries_a_changing_read():
    calls = []

    def collect():
        calls.append(1)
        if len(calls) == 1:                     # the service thread changed a dict under the first copy
            raise RuntimeError("dictionary changed size during iteration")
        return [counter("x", "x", len(calls))]

    srv = MetricsServer("127.0.0.1:0", collect, name="t")
    try:
        with urllib.request.urlopen(srv.url, timeout=10) as r:
            assert r.status == 200
            assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
            assert r.read().decode().splitlines()[-1] == "routing_replay_x_total 2"
        c = http.client.HTTPConnection(srv.host, srv.port, timeout=10)
        c.request("GET", "/other")
        assert c.getresponse().status == 404
        c.close()
        assert srv.scrapes == 1
    finally:
        srv.close()
        srv.close()                             # idempotent


def test_server_refuses_a_busy_port():
    srv = MetricsServer("127.0.0.1:0", lambda: [], name="t")
    try:
        with pytest.raises(ValueError, match="cannot bind"):
            MetricsServer(f"127.0.0.1:{srv.port}", lambda: [], name="t2")
    finally:
        srv.close()


def scrape(url: str) -> dict:
    """{(name, labels text): value} of one scrape."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.fullmatch(r"(\w+)(?:\{(.*)\})? (\S+)", line)
        assert m, line
        out[(m.group(1), m.group(2) or "")] = float(m.group(3))
    return out


def test_broker_and_consumer_processes_serve_exact_counts(tmp_path):
    broker, fe, be = start_broker("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "--metrics", "127.0.0.1:0")
    burl = broker.wait_for(r"broker metrics on (http://\S+)").group(1)
    d = tmp_path / "c"
    c = start_consumer(be, "--npz-dir", str(d), "--metrics", "127.0.0.1:0")
    curl = c.wait_for(r"consume metrics on (http://\S+)").group(1)
    broker.wait_for(r"consumers=1")
    try:
        specs = workload(30, seed=3, prefix="met")
        run_engine(fe, specs, seed=3, token_budget=64)
        recs = wait_records([d], 30)
        exact, flagged = check_records(specs, recs)
        n_abort = sum(s.abort_at is not None for s in specs)
        assert exact + flagged == 30 and flagged == n_abort
        rows = sum(r.prompt_routed_experts.shape[0] + r.routed_experts.shape[0] for r in recs.values())
        missing = sum(hi - lo for r in recs.values() for lo, hi in r.missing)
        cm = {}

        def consumer_done():
            cm.update(scrape(curl))
            return cm.get(("routing_replay_consumer_npz_records_written_total", ""), 0) == 30
        wait_until(consumer_done, 20, "30 records written, as the consumer's metrics say")
        assert cm[("routing_replay_consumer_records_total", 'state="complete"')] == 30 - n_abort
        assert sum(v for (n, lab), v in cm.items()
                   if n == "routing_replay_consumer_records_total" and 'state="incomplete"' in lab) == n_abort
        if n_abort:
            assert cm[("routing_replay_consumer_records_total", 'reason="abort",state="incomplete"')] == n_abort
        assert cm[("routing_replay_consumer_record_rows_total", "")] == rows
        assert cm[("routing_replay_consumer_missing_rows_total", "")] == missing
        assert cm[("routing_replay_consumer_in_flight_requests", "")] == 0
        bm = scrape(burl)
        assert bm[("routing_replay_broker_requests_opened_total", "")] == 30
        assert bm[("routing_replay_broker_consumers", "")] == 1
        assert bm[("routing_replay_broker_dropped_bad_total", "")] == 0
        # the stats line and the endpoint read the same counter
        m = broker.wait_for(r"broker msgs_in=(\d+) .*requests_opened=30 ")
        wait_until(lambda: scrape(burl)[("routing_replay_broker_msgs_in_total", "")] >= int(m.group(1)), 10,
                   "msgs_in as logged")
    finally:
        for p in (c, broker):
            assert p.stop() == 0


def test_cli_refuses_a_bad_metrics_address():
    p = Proc(["broker", "--frontend", "tcp://127.0.0.1:*", "--backend", "tcp://127.0.0.1:*", "--metrics", "x:y"])
    assert p.p.wait(30) == 2
    p.stop()
    assert any("metrics address 'x:y'" in line for line in p.lines), p.lines
