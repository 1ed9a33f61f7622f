"""Expose a service's counters as a Prometheus endpoint: `GET /metrics` in the text exposition format (0.0.4).

A service hands `MetricsServer` a `collect()` callable that returns `Metric`s; the server's own daemon thread calls
it on each scrape, so a scrape costs the service loop nothing. `collect()` runs on that thread and reads counters
the service thread owns: it reads plain ints and copies any dict before iterating it (a dict that changes size
while copied raises RuntimeError; `render_scrape` retries then, and answers 503 if it keeps failing).

Names follow Prometheus conventions: `routing_replay_<service>_<name>`, counters end in `_total`, bytes are
`_bytes`. Labels are a small fixed set per metric (a reason, a state), never a request id.
"""

from __future__ import annotations

import logging
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterable, NamedTuple

log = logging.getLogger("routing_replay.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "routing_replay_"
COLLECT_TRIES = 3


class Metric(NamedTuple):
    """One sample: `kind` is "counter" or "gauge"; `labels` a tuple of (name, value) pairs."""

    name: str
    kind: str
    help: str
    value: float
    labels: tuple = ()


def counter(name: str, help: str, value: float, **labels) -> Metric:
    return Metric(name if name.endswith("_total") else name + "_total", "counter", help, value,
                  tuple(sorted(labels.items())))


def gauge(name: str, help: str, value: float, **labels) -> Metric:
    return Metric(name, "gauge", help, value, tuple(sorted(labels.items())))


def _escape_label(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(v: float) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def render(metrics: Iterable[Metric], prefix: str = PREFIX) -> str:
    """The exposition text: one HELP and TYPE line per metric name (first sample's), then its samples in order.
    Samples of one name are grouped together wherever they came in the input (the format requires it)."""
    by_name: dict[str, list[Metric]] = {}
    for m in metrics:
        if m.kind not in ("counter", "gauge"):
            raise ValueError(f"metric {m.name!r}: kind must be counter or gauge, got {m.kind!r}")
        by_name.setdefault(m.name, []).append(m)
    out = []
    for name, samples in by_name.items():
        full = prefix + name
        out.append(f"# HELP {full} {samples[0].help}")
        out.append(f"# TYPE {full} {samples[0].kind}")
        for m in samples:
            lab = ",".join(f'{k}="{_escape_label(v)}"' for k, v in m.labels)
            out.append(f"{full}{{{lab}}} {_number(m.value)}" if lab else f"{full} {_number(m.value)}")
    return "\n".join(out) + "\n"


def render_scrape(collect: Callable[[], Iterable[Metric]]) -> str | None:
    """`render(collect())`, retried when the service thread changed a dict under the copy; None if it kept failing."""
    for _ in range(COLLECT_TRIES):
        try:
            return render(list(collect()))
        except RuntimeError:
            continue
    return None


def parse_address(addr: str) -> tuple[str, int]:
    """'HOST:PORT' or ':PORT' (all interfaces) or 'PORT' (loopback) -> (host, port); port 0 picks a free one."""
    host, sep, port = addr.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", addr
    host = host.strip("[]") if host else "0.0.0.0"
    try:
        p = int(port)
    except ValueError:
        raise ValueError(f"metrics address {addr!r}: port {port!r} is not a number (want HOST:PORT)") from None
    if not 0 <= p <= 65535:
        raise ValueError(f"metrics address {addr!r}: port {p} out of range 0..65535")
    return host, p


class MetricsServer:
    """Own an HTTP server thread that answers `GET /metrics` with `collect()` rendered; anything else is 404.

    `close()` is idempotent: it stops the server loop, joins the thread and closes the listening socket."""

    def __init__(self, address: str, collect: Callable[[], Iterable[Metric]], name: str = "service"):
        host, port = parse_address(address)
        self.collect = collect
        self.name = name
        self.scrapes = 0
        self.failed_scrapes = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                if self.path.split("?", 1)[0] != "/metrics":
                    self.send_error(404, "only /metrics is served")
                    return
                text = render_scrape(server.collect)
                if text is None:
                    server.failed_scrapes += 1
                    self.send_error(503, "counters changed during every read; try again")
                    return
                server.scrapes += 1
                body = text.encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, fmt, *args):  # one log line per scrape would flood the service's log
                log.debug("%s metrics: " + fmt, server.name, *args)

        try:
            self._httpd = ThreadingHTTPServer((host, port), Handler)
        except OSError as e:
            raise ValueError(f"metrics address {address!r}: cannot bind: {e}") from None
        self._httpd.daemon_threads = True
        self.host, self.port = self._httpd.server_address[:2]
        self._closed = False
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name=f"{name}-metrics", daemon=True)
        self._thread.start()
        log.info("%s metrics on http://%s:%d/metrics", name, self.host, self.port)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()
        self._thread.join()
        self._httpd.server_close()
