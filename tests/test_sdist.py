"""The package as a source distribution: what `pip install routing-replay` builds where no wheel fits (another
Python, another platform; the wheel is tagged for the interpreter that built it since it carries the producer's C
copy, producer/_gather.c).

The sdist is made by setuptools' own PEP 517 hook, the one `python -m build --sdist` and `make dist` call, and
installed by pip outside the checkout twice:

  * with this machine's C toolchain: the C copy is compiled into the install, the producer uses it, and it equals
    the numpy copy;
  * with CC pointing at no compiler (a machine without one): the install still succeeds, without the module, and
    the producer copies with numpy.

Each install then runs `python -m routing_replay synth` from outside the checkout, its interpreter started without
`site` (-S: no .pth file runs, so this checkout's editable install cannot answer for a module the install lacks)
and with only the install and this interpreter's site-packages (numpy, pyzmq, msgpack) on PYTHONPATH: a producer,
an embedded broker and consumer, real sockets, every record checked (exit 0), and the producer's first line names
the copy it runs (`copy=native` or `copy=numpy`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

import pytest

from tests.procs import c_toolchain, package_dirs

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
ROOT = "routing_replay"


def _package_sources() -> set:
    """Every file the installed package is built from, relative to the checkout: each package folder's modules
    (routing_replay/ and every top-level folder with an __init__.py but tests/) and C sources."""
    out = set()
    for folder in package_dirs().values():
        for f in [*folder.rglob("*.py"), *folder.rglob("*.c")]:
            if "__pycache__" not in f.parts:
                out.add(f.relative_to(REPO).as_posix())
    return out


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sdist")
    code = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    r = subprocess.run([sys.executable, "-c", code, str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"build_sdist failed:\n{r.stdout}{r.stderr}"
    path = out / r.stdout.strip().splitlines()[-1]
    assert path.is_file() and path.name == "routing_replay-0.1.0.tar.gz", path
    return path


def test_the_sdist_carries_every_source_and_nothing_built(sdist):
    with tarfile.open(sdist) as t:
        names = {m.name.split("/", 1)[1] for m in t.getmembers() if m.isfile()}
    want = _package_sources() | {"setup.py", "pyproject.toml", "README.md", "LICENSE"}
    assert "producer/_gather.c" in want
    missing = sorted(want - names)
    assert not missing, f"the sdist lacks {missing[:10]}"
    built = sorted(n for n in names if n.endswith((".so", ".pyd", ".pyc", ".o", ".whl"))
                   or n.split("/")[0] in ("build", ".venv", ".carry", ".git", "dist"))
    assert not built, f"the sdist carries build outputs: {built[:10]}"


PROBE = r"""
import json, sys
import numpy as np
import routing_replay
from routing_replay.producer import outpool as messages
rng = np.random.default_rng(0)
arrs = [rng.integers(0, 128, (256, 48, 8)).astype(np.int16) for _ in range(16)]
inverse = rng.permutation(256)
want = messages.request_major(arrs, inverse, native=False)
same = None if messages._gather is None else bool(np.array_equal(messages.request_major(arrs, inverse, native=True),
                                                                  want))
print(json.dumps({"file": routing_replay.__file__,
                  "editable": [repr(f) for f in sys.meta_path if "editable" in repr(f)],
                  "native": getattr(messages._gather, "__file__", None),
                  "used": messages.NATIVE and messages._gather is not None, "same": same}))
"""


def _install(sdist: Path, target: Path, outside: Path, **env: str) -> tuple[dict, str]:
    """pip-install the sdist into `target` (no dependencies: this interpreter has them), then probe it and run
    `routing_replay synth` from `outside` with only `target` on PYTHONPATH. Returns (probe, synth's output)."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "CC") and not k.startswith("ROUTING_REPLAY_")}
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--no-compile", "--target", str(target), str(sdist)],
                       cwd=outside, env={**base, **env}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"pip install of the sdist failed:\n{r.stdout}{r.stderr}"
    # -S: no site module, so no .pth file: the editable install of this checkout (a finder that answers for any
    # routing_replay module the install lacks) stays out; the dependencies come from this interpreter's site-packages
    deps = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    run_env = {**base, "PYTHONPATH": os.pathsep.join([str(target), *deps])}
    p = subprocess.run([sys.executable, "-S", "-c", PROBE], cwd=outside, env=run_env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, f"the probe failed:\n{p.stdout}{p.stderr}"
    probe = json.loads(p.stdout.strip().splitlines()[-1])
    assert Path(probe["file"]).resolve() == (target / ROOT / "__init__.py").resolve(), probe["file"]
    assert not probe["editable"], probe
    s = subprocess.run([sys.executable, "-S", "-m", ROOT, "synth", "--requests", "12",
                        "--npz-dir", str(target.parent / "npz"), "--log-level", "info"],
                       cwd=outside, env=run_env, capture_output=True, text=True, timeout=300)
    out = s.stdout + s.stderr
    assert s.returncode == 0, f"synth from the sdist's install exited {s.returncode}:\n{out[-3000:]}"
    assert "requests=12 " in out and " wrong_or_missing=0 " in out, out[-2000:]
    assert len(list((target.parent / "npz").glob("*.npz"))) == 12
    return probe, out


def test_installed_from_the_sdist_with_a_compiler_it_builds_and_uses_the_c_copy(sdist, outside, tmp_path):
    if not c_toolchain():
        pytest.skip("no C compiler or Python.h here (.ci/run installs gcc where it can)")
    target = tmp_path / "site"
    probe, out = _install(sdist, target, outside)
    built = sorted((target / ROOT / "producer").glob("_gather*.so"))
    assert len(built) == 1, f"expected the compiled module in the install, found {built}"
    assert Path(probe["native"]).resolve() == built[0].resolve(), probe
    assert probe["used"] is True and probe["same"] is True, probe
    assert "copy=native" in out and "copy=numpy" not in out, out[-2000:]


def test_installed_from_the_sdist_without_a_compiler_it_copies_with_numpy(sdist, outside, tmp_path):
    target = tmp_path / "site"
    probe, out = _install(sdist, target, outside, CC="/nonexistent/cc")
    assert not list((target / ROOT / "producer").glob("_gather*")), "a module was built without a compiler"
    assert not list((target / ROOT / "producer").glob("*.c")), "the install carries the C source"
    assert probe["native"] is None and probe["used"] is False and probe["same"] is None, probe
    assert "copy=numpy" in out and "copy=native" not in out, out[-2000:]
