"""The `routing-replay` command: broker, consume, subscribe, keys, synth and demo subcommands."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

DEFAULT_FRONTEND = "tcp://127.0.0.1:5557"
DEFAULT_BACKEND = "tcp://127.0.0.1:5558"
DEFAULT_SERVE = "tcp://127.0.0.1:5559"


# ---- argument types: a bad value is refused while parsing, in one line naming the flag ---------------------------
#
# Shared by every subcommand (the consume flags included): `endpoint_arg(bind=...)` for every ZeroMQ endpoint flag,
# `directory_arg` for every directory a command writes to, `int_at_least(n)` / `float_above(x)` for counts and
# intervals. argparse turns their ArgumentTypeError into "routing-replay CMD: argument --FLAG: invalid ..." and
# exit status 2 (see _Parser.error).

MAX_PORT = 65535
MAX_IPC_PATH_BYTES = 107            # sockaddr_un.sun_path on Linux, less the terminating NUL
_TRANSPORTS = ("tcp", "ipc", "inproc")


def endpoint_problem(endpoint: str, *, bind: bool) -> str | None:
    """Why `endpoint` is not a ZeroMQ endpoint this CLI can bind (or connect), None if it is.

    libzmq does not refuse everything that is wrong: it wraps a tcp port above 65535 (tcp://127.0.0.1:99999 binds
    port 34463), so the port is checked here. Host names are left to libzmq ("cannot bind ..." from the command).
    """
    transport, sep, addr = endpoint.partition("://")
    if not sep:
        return "expected TRANSPORT://ADDRESS, e.g. tcp://127.0.0.1:5557 or ipc:///tmp/rr.sock"
    if transport not in _TRANSPORTS:
        return f"transport {transport!r} is not one of {', '.join(_TRANSPORTS)}"
    if not addr:
        return "empty address"
    if transport == "ipc":
        n = len(addr.encode("utf-8", "surrogateescape"))
        if n > MAX_IPC_PATH_BYTES:
            return f"ipc path of {n} bytes exceeds {MAX_IPC_PATH_BYTES}"
        return None
    if transport == "inproc":
        return None
    addr = addr.rsplit(";", 1)[-1]               # tcp://source;dest: the last part is bound or connected
    host, colon, port = addr.rpartition(":")
    if not colon or not host:
        return "expected tcp://HOST:PORT"
    if host == "*" and not bind:
        return "cannot connect to host '*' (a wildcard is for binding)"
    if port == "*":
        return None if bind else "cannot connect to port '*' (a wildcard is for binding)"
    if not port.isascii() or not port.isdigit():
        return f"port {port!r} is not a number" + (" or '*'" if bind else "")
    lo = 0 if bind else 1                        # bind port 0: any free port, like '*'
    if not lo <= int(port) <= MAX_PORT:
        return f"port {int(port)} is not in {lo}..{MAX_PORT}"
    return None


def endpoint_arg(*, bind: bool):
    """argparse type for a ZeroMQ endpoint flag (bound with bind=True, connected to otherwise)."""
    def endpoint(value: str) -> str:
        why = endpoint_problem(value, bind=bind)
        if why is not None:
            raise argparse.ArgumentTypeError(f"invalid endpoint {value!r}: {why}")
        return value
    return endpoint


def directory_arg(value: str) -> str:
    """argparse type for a directory the command creates or writes into: it is a directory or can be made one
    (no part of the path is an existing file). Writability is left to the command (the path may be for another
    host's mount)."""
    if not value:
        raise argparse.ArgumentTypeError("invalid directory '': empty path")
    p = Path(value)
    if p.exists():
        if not p.is_dir():
            raise argparse.ArgumentTypeError(f"invalid directory {value!r}: it exists and is not a directory")
        return value
    for parent in p.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise argparse.ArgumentTypeError(f"invalid directory {value!r}: {str(parent)!r} is not a directory")
            break
    return value


def directory_problem(value: str) -> str | None:
    """Make the directory a command writes to (parents too) and check that it takes a file; why it cannot (one
    line: a path under /proc, a read-only file system, a file in the way), or None. Run by the command itself, after
    parsing: the directory is created only when the command goes on to use it."""
    import tempfile
    p = Path(value)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        return f"{value!r} exists and is not a directory"
    except OSError as e:
        return f"cannot create directory {value!r}: {e.strerror or e}"
    if not p.is_dir():
        return f"{value!r} exists and is not a directory"
    try:
        fd, probe = tempfile.mkstemp(dir=p, prefix=".tmp-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"cannot write in directory {value!r}: {e.strerror or e}"
    return None


def int_at_least(minimum: int):
    """argparse type for an integer count or interval of at least `minimum`."""
    def count(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer {value!r}") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"invalid value {n}: must be >= {minimum}")
        return n
    return count


def float_above(minimum: float):
    """argparse type for a number of seconds (or similar) strictly greater than `minimum`."""
    def number(value: str) -> float:
        try:
            x = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number {value!r}") from None
        if not x > minimum:                      # also refuses nan
            raise argparse.ArgumentTypeError(f"invalid value {value}: must be > {minimum:g}")
        return x
    return number


def retype(parser: argparse.ArgumentParser, **types) -> None:
    """Give the options of `parser` whose dest is a key of `types` that argparse type (options defined elsewhere,
    e.g. synthetic.add_arguments). Unknown dests are skipped."""
    for action in parser._actions:
        if action.dest in types:
            action.type = types[action.dest]


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's error shape: a bad value is one line naming the (sub)command and the flag; a bad
    command line (unknown flag, missing argument) prints the usage of the (sub)command it was given to."""

    def error(self, message: str):
        if message.startswith("argument ") and ": invalid " in message:
            self.exit(2, f"{self.prog}: {message}\n")
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


POSITIVE = int_at_least(1)
NON_NEGATIVE = int_at_least(0)
BIND = endpoint_arg(bind=True)
CONNECT = endpoint_arg(bind=False)


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")


def _die(prog: str, msg: str, code: int = 2) -> int:
    print(f"routing-replay {prog}: {msg}", file=sys.stderr)
    return code


def _on_signals(stop) -> None:
    def handler(signum, frame):
        logging.getLogger("routing_replay").info("signal %d: shutting down", signum)
        stop()
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def _check_binds(prog: str, endpoints: list, curve: bool, insecure: bool) -> str | None:
    from routing_replay.protocol import security
    for what, ep in endpoints:
        try:
            security.check_bind(ep, curve=curve, insecure=insecure, what=what)
        except ValueError as e:
            return str(e)
    return None


def _metrics_server(prog: str, address: str | None, collect):
    """The `--metrics` endpoint (protocol/metrics.py), or None without one. ValueError: a bad or busy address."""
    if not address:
        return None
    from routing_replay.protocol.metrics import MetricsServer
    return MetricsServer(address, collect, name=prog)


def metrics_arg(p) -> None:
    p.add_argument("--metrics", metavar="HOST:PORT", help="serve Prometheus metrics at http://HOST:PORT/metrics "
                   "(':PORT' listens on every interface, a bare PORT on loopback; default: off)")


def cmd_broker(a) -> int:
    import zmq
    from routing_replay.broker import Broker, BrokerConfig
    try:
        b = Broker(config=BrokerConfig(
            a.frontend, a.backend, heartbeat_interval_ms=a.heartbeat_ms, liveness=a.liveness,
            stats_interval_s=a.stats_interval, max_pending_bytes=a.max_pending_mb << 20,
            producer_timeout_ms=a.producer_timeout_ms, ack_interval_ms=a.ack_interval_ms,
            restart_grace_ms=a.restart_grace_ms, curve_secret=a.curve_secret, curve_allow=a.curve_allow,
            open_group_max=a.open_group_max))
        b.bind()
    except ValueError as e:
        return _die("broker", str(e))
    except zmq.ZMQError as e:
        return _die("broker", f"cannot bind {a.frontend} / {a.backend}: {e}")
    # checked once the endpoints are known to be valid (a bad address says "cannot bind"); nothing is served yet
    err = _check_binds("broker", [("--frontend", a.frontend), ("--backend", a.backend)], bool(a.curve_secret),
                       a.insecure)
    if err:
        b._close_sockets()
        return _die("broker", err)
    try:
        served = _metrics_server("broker", a.metrics, b.metrics)
    except ValueError as e:
        b._close_sockets()
        return _die("broker", str(e))
    _on_signals(b.stop)
    try:
        b.serve()
    finally:
        if served is not None:
            served.close()
    return 0


def cmd_consume(a) -> int:
    import zmq
    from routing_replay.consumer import Consumer, ConsumerConfig
    if a.serve:
        err = _check_binds("consume", [("--serve", a.serve)], bool(a.curve_secret), a.insecure)
        if err:
            return _die("consume", err)
    for flag, d in (("--npz-dir", a.npz_dir), ("--spill-dir", a.spill_dir)):
        why = d and directory_problem(d)
        if why:
            return _die("consume", f"{flag}: {why}")
    try:
        c = Consumer(config=ConsumerConfig(
            a.connect, consumer_id=a.consumer_id, npz_dir=a.npz_dir, shard_size=a.shard_size,
            serve=a.serve, store_max_bytes=a.store_mb << 20, spill_dir=a.spill_dir,
            heartbeat_interval_ms=a.heartbeat_ms, finish_grace_s=a.finish_grace_ms / 1000,
            request_timeout_s=a.request_timeout_s, progress=a.progress and a.npz_dir is not None,
            stats_interval_s=a.stats_interval, ack_interval_ms=a.ack_interval_ms,
            curve_secret=a.curve_secret, broker_key=a.broker_key, curve_allow=a.curve_allow,
            remember_finished=a.remember_finished, fetched_retention_s=a.fetched_retention_s,
            fetched_retention_bytes=a.fetched_retention_mb << 20, write_retry_max_s=a.write_retry_max_s,
            keep_bytes=None if a.keep_mb is None else a.keep_mb << 20,
            adopt_min_bytes=None if a.copy_rows else a.keep_received_kb << 10,
            prefix_pool_bytes=a.prefix_pool_mb << 20))
    except ValueError as e:
        return _die("consume", str(e))
    try:
        served = _metrics_server("consume", a.metrics, c.metrics)
    except ValueError as e:
        return _die("consume", str(e))
    _on_signals(c.stop)
    try:
        c.run()
    except ValueError as e:
        return _die("consume", str(e))
    except zmq.ZMQError as e:
        return _die("consume", f"cannot connect {a.connect} / bind {a.serve}: {e}")
    finally:
        if served is not None:
            served.close()
        if c.writer is not None:
            c.writer.close()
            if c.progress is not None:
                c.progress.maybe(c.writer.records, c.writer.rows, c.writer.bytes, c.acc.in_flight, force=True)
    return 0


def cmd_subscribe(a) -> int:
    from routing_replay.consumer import TrainerClient
    stop = threading.Event()
    _on_signals(stop.set)
    n = 0
    try:
        client = TrainerClient(a.connect, curve_secret=a.curve_secret, server_key=a.server_key)
    except ValueError as e:
        return _die("subscribe", str(e))
    with client:
        try:
            client.subscribe(a.prefix, layers=a.layers, tokens=a.tokens)
        except ValueError as e:
            return _die("subscribe", str(e))
        while not stop.is_set() and (a.count == 0 or n < a.count):
            got = False
            for rec in client.records(timeout_s=0.5):
                got = True
                n += 1
                P, L, K = rec.prompt_routed_experts.shape
                print(f"{rec.request_id} prompt={P} output={len(rec.routed_experts)} layers={L} top_k={K} "
                      f"cached={rec.num_cached_tokens} complete={rec.complete} reason={rec.reason or '-'} "
                      f"missing={rec.missing}" + ("" if rec.layer_range is None else
                                                  f" layer_ids={rec.moe_layer_ids.tolist()}")
                      + ("" if rec.token_range is None else f" positions={list(rec.token_range[:2])} of {rec.token_range[2]}"), flush=True)
                if a.count and n >= a.count:
                    break
                if stop.is_set():
                    break
            if not got and a.timeout and stop.wait(0):
                break
    return 0


def cmd_keys(a) -> int:
    from routing_replay.protocol import security
    try:
        pub, sec = security.create_keys(a.dir, a.name)
    except (ValueError, OSError) as e:
        return _die("keys", str(e))
    print(f"wrote {pub} (public: give it to peers) and {sec} (secret: keep it here)")
    return 0


def cmd_synth(a) -> int:
    from routing_replay.apps import synthetic
    why = a.npz_dir and directory_problem(a.npz_dir)
    if why:
        return _die("synth", f"--npz-dir: {why}")
    return synthetic.main_from_args(a)


def cmd_demo(a) -> int:
    try:
        from routing_replay.apps import demo
    except ImportError as e:
        return _die("demo", f"the vLLM demo is not available: {e}")
    return demo.main(a.rest)


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="routing-replay", description="Stream MoE routing decisions from inference "
                                 "engines to RL trainers over ZeroMQ.")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def curve_server(p, clients):
        p.add_argument("--curve-secret", metavar="FILE", help="this process's own secret cert (NAME.key_secret, "
                       "from `routing-replay keys`): CURVE encryption and authentication on its sockets")
        p.add_argument("--curve-allow", metavar="DIR", help=f"directory of the public certs (NAME.key) of the "
                       f"{clients} allowed to connect")
        p.add_argument("--insecure", action="store_true", help="allow binding a non-loopback tcp address "
                       "without CURVE keys")

    def common(p):
        p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
        p.add_argument("--stats-interval", type=float_above(0), default=10.0, metavar="S",
                       help="seconds between stats lines")
        p.add_argument("--heartbeat-ms", type=POSITIVE, default=1000)

    p = sub.add_parser("broker", help="route producers' messages to consumers by request id",
                       description="Producers connect to --frontend, consumers to --backend.")
    p.add_argument("--frontend", type=BIND, default=DEFAULT_FRONTEND, help=f"endpoint producers connect to ({DEFAULT_FRONTEND})")
    p.add_argument("--backend", type=BIND, default=DEFAULT_BACKEND, help=f"endpoint consumers connect to ({DEFAULT_BACKEND})")
    p.add_argument("--liveness", type=POSITIVE, default=3, help="heartbeats a consumer may miss before it is dropped")
    p.add_argument("--max-pending-mb", type=NON_NEGATIVE, default=512, help="held while no consumer is live (MiB)")
    p.add_argument("--producer-timeout-ms", type=POSITIVE, default=10_000, help="a producer silent this long is lost: "
                   "the requests it opened are aborted (reason producer_lost)")
    p.add_argument("--ack-interval-ms", type=POSITIVE, default=20, help="acks to producers at most this often")
    p.add_argument("--restart-grace-ms", type=NON_NEGATIVE, default=None, help="after a restart, hold messages this long "
                   "while the old consumers reconnect (default: 2 heartbeats)")
    p.add_argument("--open-group-max", type=NON_NEGATIVE, default=16, help="an `opens` message of at most this many "
                   "requests puts them all on one consumer, so their rows, finishes and records travel unsplit "
                   "(0: each request by its own hash; at most 4096)")
    curve_server(p, "producers and consumers")
    common(p)
    metrics_arg(p)
    p.set_defaults(fn=cmd_broker)

    p = sub.add_parser("consume", help="accumulate records from a broker; write npz and/or serve trainers",
                       description="Connects to a broker's backend. With --npz-dir, writes one <request id>.npz per "
                       "finished request (or shards). With --serve, trainers fetch and subscribe there.")
    p.add_argument("--connect", type=CONNECT, default=DEFAULT_BACKEND, help=f"broker backend endpoint ({DEFAULT_BACKEND})")
    p.add_argument("--npz-dir", type=directory_arg, help="write records here")
    p.add_argument("--shard-size", type=NON_NEGATIVE, default=0, help="N records per shard file with index.jsonl (0: one file "
                   "per request)")
    p.add_argument("--serve", type=BIND, help=f"bind the trainer endpoint here (e.g. {DEFAULT_SERVE})")
    p.add_argument("--consumer-id", help="stable id (default: consumer:<host>:<pid>:<random>)")
    p.add_argument("--store-mb", type=NON_NEGATIVE, default=2048, help="records kept for fetch, in memory (MiB)")
    p.add_argument("--spill-dir", type=directory_arg, help="beyond --store-mb, spill records here instead of evicting them")
    p.add_argument("--finish-grace-ms", type=NON_NEGATIVE, default=500, help="wait this long for late rows after a finish")
    p.add_argument("--request-timeout-s", type=float_above(0), default=600.0, help="emit silent requests as incomplete")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--ack-interval-ms", type=POSITIVE, default=20, help="ack applied messages to the broker this often")
    p.add_argument("--remember-finished", type=NON_NEGATIVE, default=100_000, metavar="N",
                   help="finished request ids remembered, so a resent message for one is recognised as late "
                        "(memory per id: docs/RELIABILITY.md)")
    p.add_argument("--fetched-retention-s", type=float_above(-1e-9), default=600.0, metavar="S",
                   help="keep records a trainer fetched this long, so a fetch can be repeated (0: not kept; records "
                        "in --npz-dir are served again from disk regardless)")
    p.add_argument("--fetched-retention-mb", type=NON_NEGATIVE, default=256, metavar="MIB",
                   help="memory bound of the fetched records kept (MiB; the last one fetched is kept even above "
                        "it; 0: none kept)")
    p.add_argument("--write-retry-max-s", type=float_above(0), default=2.0, metavar="S",
                   help="longest wait between retries of npz writes that failed (the wait doubles up to this)")
    p.add_argument("--keep-mb", type=NON_NEGATIVE, default=None, metavar="MIB",
                   help="memory of finished requests' rows kept for the next requests, so they write without page "
                        "faults (MiB; default: the most held at once, at least 256)")
    p.add_argument("--prefix-pool-mb", type=NON_NEGATIVE, default=256, metavar="MIB",
                   help="memory bound of finished records' prompt rows kept for requests whose opens reference "
                        "them (prefix_refs: a GRPO group's shared prompt); 0: none kept, such rows come out "
                        "missing (prefix_unresolved) (MiB; default: %(default)s)")
    p.add_argument("--keep-received-kb", type=NON_NEGATIVE, default=64, metavar="KIB",    # consumer.ADOPT_MIN_BYTES
                   help="a message whose every entry is a new request's first rows, each at least this big (a "
                        "prefill step's), is not copied: the rows stay in the received message and the records "
                        "of requests that end with them are views of it (KiB; default: %(default)s)")
    p.add_argument("--copy-rows", action="store_true",
                   help="copy every row into the consumer's own memory (no record holds a received message)")
    p.add_argument("--broker-key", metavar="FILE", help="the broker's public cert (NAME.key), with --curve-secret")
    curve_server(p, "trainers on --serve")
    common(p)
    metrics_arg(p)
    p.set_defaults(fn=cmd_consume)

    p = sub.add_parser("subscribe", help="print live records from consumers' trainer endpoints")
    p.add_argument("--connect", type=CONNECT, nargs="+", default=[DEFAULT_SERVE], help="consumer --serve endpoints")
    p.add_argument("--prefix", default="", help="only request ids starting with this")
    p.add_argument("--count", type=NON_NEGATIVE, default=0, help="exit after this many records (0: run until signalled)")
    p.add_argument("--layers", type=NON_NEGATIVE, nargs=2, metavar=("LO", "HI"), help="only model layers [LO, HI) "
                   "(a pipeline stage's own): only their columns leave the consumer")
    p.add_argument("--tokens", type=NON_NEGATIVE, nargs=2, metavar=("LO", "HI"), help="only positions [LO, HI) of "
                   "prompt + output (a context-parallel rank's chunk)")
    p.add_argument("--timeout", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--curve-secret", metavar="FILE", help="this trainer's secret cert (NAME.key_secret)")
    p.add_argument("--server-key", metavar="FILE", nargs="+", help="the consumers' public cert (NAME.key): one "
                   "for all, or one per --connect endpoint")
    common(p)
    p.set_defaults(fn=cmd_subscribe)

    p = sub.add_parser("keys", help="generate a CURVE key pair: DIR/NAME.key (public) and DIR/NAME.key_secret",
                       description="Writes a key pair in pyzmq's certificate format. Give NAME.key to the peers that "
                       "must accept or pin this one; keep NAME.key_secret (mode 0600) where this process runs.")
    p.add_argument("dir", type=directory_arg, help="directory to write the pair to (created if missing)")
    p.add_argument("--name", required=True, help="the pair's name, e.g. broker, consumer, engine, trainer")
    p.add_argument("--log-level", default="info", help=argparse.SUPPRESS)
    p.set_defaults(fn=cmd_keys)

    p = sub.add_parser("synth", help="run a synthetic engine (no GPU, no vLLM) through a broker, or embedded",
                       description="Publishes a deterministic workload (chunked prefill, decode, prefix hits, "
                       "speculative overwrites, preemption, aborts) and checks the records it gets back.")
    from routing_replay.apps import synthetic
    synthetic.add_arguments(p)
    retype(p, connect=CONNECT, npz_dir=directory_arg, requests=POSITIVE, num_layers=POSITIVE, top_k=POSITIVE,
           num_experts=POSITIVE, token_budget=POSITIVE, seed=NON_NEGATIVE)
    common(p)
    p.set_defaults(fn=cmd_synth)

    p = sub.add_parser("demo", help="vLLM on a generated tiny MoE model with capture on; npz to ./out; oracle check",
                       add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.add_argument("--log-level", default="info", help=argparse.SUPPRESS)
    p.set_defaults(fn=cmd_demo)
    return ap


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"]:            # the demo owns its own flags (argparse REMAINDER drops option-like ones)
        _setup_logging("info")
        from routing_replay.apps import demo
        return demo.main(argv[1:])
    ap = build_parser()
    a, extra = ap.parse_known_args(argv)
    if extra:                           # the subcommand's usage, not the top-level one
        sub = next(x for x in ap._actions if isinstance(x, argparse._SubParsersAction))
        sub.choices[a.cmd].error(f"unrecognized arguments: {' '.join(extra)}")
    _setup_logging(a.log_level)
    return a.fn(a)


if __name__ == "__main__":
    raise SystemExit(main())
