"""A directory a command must write to that cannot be made or written (a path under /proc, a directory that takes no
files, a file in the way) is one line on stderr naming the flag and the path, exit status 2, for every command that
writes records: consume, synth, demo."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "routing_replay"]
NO_FILES = "/sys/kernel"          # a directory that exists and takes no new file, even as root (sysfs)

CASES = [
    (["consume", "--npz-dir", "/proc/x"],
     "routing-replay consume: --npz-dir: cannot create directory '/proc/x': No such file or directory"),
    (["consume", "--npz-dir", NO_FILES],
     f"routing-replay consume: --npz-dir: cannot write in directory '{NO_FILES}': "
     "(Permission denied|Read-only file system|Operation not permitted)"),
    (["consume", "--spill-dir", "/proc/x/y"],
     "routing-replay consume: --spill-dir: cannot create directory '/proc/x/y': No such file or directory"),
    (["synth", "--npz-dir", "/proc/x"],
     "routing-replay synth: --npz-dir: cannot create directory '/proc/x': No such file or directory"),
    (["demo", "--out", "/proc/x"],
     "routing-replay demo: --out: cannot create directory '/proc/x': No such file or directory"),
    (["demo", "--out", "{file}"], "routing-replay demo: --out: '{file}' exists and is not a directory"),
]


@pytest.mark.parametrize("args,line", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_an_unusable_output_directory_is_one_line_and_exit_2(tmp_path, args, line):
    f = tmp_path / "plain-file"
    f.write_text("x")
    out = subprocess.run(CLI + [x.format(file=f) for x in args], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout, len(out.stderr.splitlines())) == (2, "", 1), out.stderr
    assert re.fullmatch(line.format(file=re.escape(str(f))), out.stderr.strip()), out.stderr
