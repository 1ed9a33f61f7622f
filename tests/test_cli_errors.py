"""The real CLI (`python -m routing_replay.apps.cli`, and `python -m routing_replay`) refuses bad values with exit
status 2 and one line on stderr naming the subcommand and the flag; a bad flag prints the subcommand's usage."""

from __future__ import annotations

import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "routing_replay.apps.cli"]


def _run(args, cmd=CLI):
    return subprocess.run(cmd + args, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def a_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("cli") / "plain-file"
    f.write_text("x")
    return f


CASES = [
    (["consume", "--npz-dir", "{file}"],
     "routing-replay consume: argument --npz-dir: invalid directory '{file}': it exists and is not a directory"),
    (["consume", "--npz-dir", "{file}/sub"],
     "routing-replay consume: argument --npz-dir: invalid directory '{file}/sub': '{file}' is not a directory"),
    (["consume", "--spill-dir", "{file}/x"],
     "routing-replay consume: argument --spill-dir: invalid directory '{file}/x': '{file}' is not a directory"),
    (["subscribe", "--connect", "nonsense"],
     "routing-replay subscribe: argument --connect: invalid endpoint 'nonsense': expected TRANSPORT://ADDRESS, "
     "e.g. tcp://127.0.0.1:5557 or ipc:///tmp/rr.sock"),
    (["broker", "--frontend", "tcp://127.0.0.1:99999"],
     "routing-replay broker: argument --frontend: invalid endpoint 'tcp://127.0.0.1:99999': port 99999 is not "
     "in 0..65535"),
    (["broker", "--backend", "udp://127.0.0.1:5"],
     "routing-replay broker: argument --backend: invalid endpoint 'udp://127.0.0.1:5': transport 'udp' is not one "
     "of tcp, ipc, inproc"),
    (["consume", "--connect", "tcp://127.0.0.1:65536"],
     "routing-replay consume: argument --connect: invalid endpoint 'tcp://127.0.0.1:65536': port 65536 is not in "
     "1..65535"),
    (["consume", "--serve", "tcp://127.0.0.1:http"],
     "routing-replay consume: argument --serve: invalid endpoint 'tcp://127.0.0.1:http': port 'http' is not a "
     "number or '*'"),
    (["synth", "--connect", "tcp://*:5557"],
     "routing-replay synth: argument --connect: invalid endpoint 'tcp://*:5557': cannot connect to host '*' "
     "(a wildcard is for binding)"),
    (["synth", "--requests", "-5"], "routing-replay synth: argument --requests: invalid value -5: must be >= 1"),
    (["subscribe", "--count", "-1"], "routing-replay subscribe: argument --count: invalid value -1: must be >= 0"),
    (["broker", "--liveness", "0"], "routing-replay broker: argument --liveness: invalid value 0: must be >= 1"),
    (["broker", "--heartbeat-ms", "x"], "routing-replay broker: argument --heartbeat-ms: invalid integer 'x'"),
    (["consume", "--keep-mb", "-1"], "routing-replay consume: argument --keep-mb: invalid value -1: must be >= 0"),
    (["consume", "--stats-interval", "-1"],
     "routing-replay consume: argument --stats-interval: invalid value -1: must be > 0"),
    (["keys", "{file}/k", "--name", "n"],
     "routing-replay keys: argument dir: invalid directory '{file}/k': '{file}' is not a directory"),
]


@pytest.mark.parametrize("args,line", CASES, ids=[" ".join(a[:2]) for a, _ in CASES])
def test_bad_value_is_one_line_and_exit_2(a_file, args, line):
    out = _run([x.format(file=a_file) for x in args])
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == [line.format(file=a_file)]


def test_package_entry_point_says_the_same(a_file):
    out = _run(["broker", "--frontend", "tcp://127.0.0.1:99999"], [sys.executable, "-m", "routing_replay"])
    assert out.returncode == 2
    assert out.stderr.splitlines() == ["routing-replay broker: argument --frontend: invalid endpoint "
                                       "'tcp://127.0.0.1:99999': port 99999 is not in 0..65535"]


@pytest.mark.parametrize("sub", ["broker", "consume", "subscribe", "synth", "keys"])
def test_unknown_flag_prints_the_subcommands_usage(sub):
    out = _run([sub, "--no-such-flag"] + (["d", "--name", "n"] if sub == "keys" else []))
    assert out.returncode == 2
    lines = out.stderr.splitlines()
    assert lines[0].startswith(f"usage: routing-replay {sub} ")
    assert lines[-1] == f"routing-replay {sub}: error: unrecognized arguments: --no-such-flag"


def test_good_values_still_parse():
    from routing_replay.apps.cli import build_parser

    a = build_parser().parse_args(["broker", "--frontend", "tcp://*:0", "--backend", "ipc:///tmp/rr-b"])
    assert (a.frontend, a.backend) == ("tcp://*:0", "ipc:///tmp/rr-b")
    a = build_parser().parse_args(["subscribe", "--connect", "tcp://[::1]:5559", "inproc://x", "--count", "0"])
    assert a.connect == ["tcp://[::1]:5559", "inproc://x"] and a.count == 0
    a = build_parser().parse_args(["consume", "--serve", "tcp://127.0.0.1:*", "--npz-dir", "/nonexistent/dir/x"])
    assert a.serve == "tcp://127.0.0.1:*" and a.npz_dir == "/nonexistent/dir/x"


def test_consumes_defaults_are_the_consumers_own():
    """`consume`'s defaults written in the CLI (it imports the consumer only once it runs) are the Consumer's."""
    from routing_replay.apps.cli import build_parser
    from routing_replay.consumer.accumulator import ADOPT_MIN_BYTES
    a = build_parser().parse_args(["consume"])
    assert a.keep_received_kb * 1024 == ADOPT_MIN_BYTES and not a.copy_rows
