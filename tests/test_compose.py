"""docker-compose.yml, proven without Docker: its services' commands run here as local processes.

Fast checks (no vLLM): the file passes `docker compose config -q` / `docker-compose config -q` when one of them is
installed; every image is built here or pinned to a tag; every Dockerfile builds the wheel from every package
folder setup.py finds (and its .dockerignore lets them in), installs only that wheel and checks the console script
and the imports from / (no source tree in the image to shadow the install); every `routing-replay` and trainer
command parses with the real argument parsers.

The deployment test reads docker-compose.yml and starts, with the same arguments and environment:
  keys        `sh docker/make-keys.sh` into a temp dir (only with CURVE, see below)
  broker      `routing-replay broker ...`
  consumer-0  `routing-replay consume ...`
  consumer-1  `routing-replay consume ...`
  engine-cpu  the CPU image's entrypoint (read from docker/engine-cpu.Dockerfile) + the service's flags
  trainer     `python3 docker/trainer.py ...` (rollouts with shared prefixes, fetch, check, --out copies)
rewritten for one machine: binds `tcp://0.0.0.0:P` become `tcp://127.0.0.1:*` and the bound endpoint is read from
the process's log line; `tcp://SERVICE:P` / `http://SERVICE:P` (and a service's own 127.0.0.1:P in health checks)
become those endpoints; vLLM's `--port` gets a free port from the kernel; /run/secrets/X is a per-service temp dir
holding the service's secrets at their targets; a named volume is a temp dir; /opt/routing-replay (where the
images hold this repository) is this checkout. Deviations for this 2-core CPU machine, and only these: the engine
loads a generated tiny Qwen3-MoE model instead of ${MODEL}, with `--kv-cache-memory-bytes 128M --dtype float32
--enforce-eager` (fp32 so the HF oracle agrees; eager so start-up skips torch.compile). The GPU `engine` service
is not started; its flags are parsed by vLLM's own parser instead.

CURVE: with `routing-replay keys` and the CURVE flags in the CLI (`routing-replay broker --help` lists
--curve-secret), the keys service runs (docker/make-keys.sh). When, in addition, the vLLM plugin reads
ROUTING_REPLAY_CURVE_SECRET, every process gets the real key files at their /run/secrets targets. Until both have
landed, the CURVE flags (--curve-secret, --curve-allow, --broker-key, --server-key) and the env vars
ROUTING_REPLAY_CURVE_SECRET / ROUTING_REPLAY_BROKER_KEY are stripped from every service (a plaintext engine cannot
talk to a CURVE broker), so the rest of the file is still exercised; the test prints which mode ran.

Then it checks: the trainer exits 0; a batch completion sent by the test itself has records keyed
"<response id>-<prompt index>"; every record is complete, agrees with the HF oracle, and the trainer's fetched
copies equal the consumers' npz files bit for bit; each record is in exactly one consumer's directory and both
consumers got some; the health checks pass; the broker and consumer stats lines show no loss.
"""

from __future__ import annotations

import functools
import http.client
import importlib.util
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML parses docker-compose.yml (vLLM depends on it)")

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
IMAGE_ROOT = "/opt/routing-replay"              # where docker/Dockerfile and the engine images copy the repo
CLI = [sys.executable, "-m", "routing_replay.apps.cli"]
CURVE_FLAGS = ("--curve-secret", "--curve-allow", "--broker-key", "--server-key")
CURVE_ENV = ("ROUTING_REPLAY_CURVE_SECRET", "ROUTING_REPLAY_BROKER_KEY")
ENGINE_TEST_FLAGS = {"--kv-cache-memory-bytes": "128M"}
ENGINE_TEST_EXTRA = ["--dtype", "float32", "--enforce-eager"]
STARTUP_S = 300
# Which log line tells the endpoint each bind flag got (per routing-replay subcommand).
BOUND = {"broker": (r"broker frontend=(\S+) backend=(\S+)", ("--frontend", "--backend")),
         "consume": (r"consumer \S+ connected to \S+ serve=(\S+)", ("--serve",))}

_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}|\$\$")
_ENDPOINT = re.compile(r"(?P<scheme>tcp://|http://)?(?P<host>[A-Za-z0-9_.-]+):(?P<port>\d+)")


def interpolate(v, env: dict | None = None):
    """Compose's ${VAR:-default} / ${VAR-default} / ${VAR} / $$ substitution, from `env` (default: defaults only)."""
    env = env or {}
    if isinstance(v, str):
        def sub(m):
            if m.group(0) == "$$":
                return "$"
            if m.group(1) in env:
                return env[m.group(1)]
            if m.group(2) is None:
                raise KeyError(f"${{{m.group(1)}}} has no default in {v!r}")
            return m.group(2)
        return _VAR.sub(sub, v)
    if isinstance(v, list):
        return [interpolate(x, env) for x in v]
    if isinstance(v, dict):
        return {k: interpolate(x, env) for k, x in v.items()}
    return v


def load_compose() -> dict:
    with open(COMPOSE) as f:
        return interpolate(yaml.safe_load(f))


@functools.lru_cache(maxsize=1)
def curve_cli() -> bool:
    """The routing-replay commands take the CURVE flags (and `routing-replay keys` exists)."""
    out = subprocess.run(CLI + ["broker", "--help"], capture_output=True, text=True, timeout=60).stdout
    return "--curve-secret" in out


def curve_plugin() -> bool:
    """The vLLM plugin reads ROUTING_REPLAY_CURVE_SECRET (without it the engine cannot reach a CURVE broker)."""
    files = list((ROOT / "engines" / "vllm_plugin").glob("*.py"))
    assert files, "engines/vllm_plugin/ has no modules: the plugin moved?"
    return any(CURVE_ENV[0] in p.read_text() for p in files)


def strip_curve(args: list[str]) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in CURVE_FLAGS:
            skip = True
        elif a != "--insecure":
            out.append(a)
    return out


def _dockerfile(service: dict) -> Path:
    return ROOT / service["build"].get("context", ".") / service["build"].get("dockerfile", "Dockerfile")


# ---- checks that need neither Docker nor vLLM ---------------------------------------------------------------------

def _compose_cli() -> list[str] | None:
    if shutil.which("docker"):
        r = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=60)
        if r.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def test_compose_file_valid():
    cli = _compose_cli()
    if cli is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed (Debian: apt-get install -y "
                    "docker-compose); only the YAML itself was checked by the other tests")
    for profiles in ([], ["--profile", "cpu", "--profile", "gpu", "--profile", "setup"]):
        r = subprocess.run(cli + ["-f", str(COMPOSE), *profiles, "config", "-q"], capture_output=True, text=True,
                           timeout=120, cwd=ROOT, env={k: v for k, v in os.environ.items() if k != "KEYS_DIR"})
        assert r.returncode == 0, f"{' '.join(cli)} {' '.join(profiles)} config -q: {r.stdout}{r.stderr}"


def _pinned(image: str) -> bool:
    name, _, tag = image.rpartition(":")
    return bool(name) and "/" not in tag and tag not in ("", "latest")


def test_images_built_here_or_pinned():
    c = load_compose()
    for name, s in c["services"].items():
        image = s.get("image")
        assert "build" in s or image, f"service {name} has neither image nor build"
        if image:
            assert _pinned(image) or ("@sha256:" in image), f"service {name}: image {image!r} is not pinned to a tag"
        if "build" in s:
            df = _dockerfile(s)
            assert df.is_file(), f"service {name}: {df} does not exist"
            text = df.read_text()
            args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
            args.update(s["build"].get("args") or {})
            for ref in re.findall(r"^FROM (\S+)", text, re.M):
                base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], ref)
                assert _pinned(base), f"{df.name}: FROM {ref} -> {base!r} is not pinned to a tag"


def _package_sources() -> list[str]:
    """What the wheel is built from: setup.py and its metadata, and every top-level package folder (setup.py
    finds them the same way: a folder with an __init__.py, tests excepted)."""
    folders = sorted(p.parent.name for p in ROOT.glob("*/__init__.py") if p.parent.name != "tests")
    return ["setup.py", "pyproject.toml", "README.md", *folders]


def _stages(text: str) -> list[tuple[str, str]]:
    """(FROM line, body) per build stage of a Dockerfile, continuation lines joined."""
    text = re.sub(r"\s*\\\n\s*", " ", text)
    parts = re.split(r"^(FROM .*)$", text, flags=re.M)
    return list(zip(parts[1::2], parts[2::2]))


DOCKERFILES = sorted(p.name for p in (ROOT / "docker").glob("*Dockerfile"))


@pytest.mark.parametrize("name", DOCKERFILES)
def test_images_install_the_wheel_and_check_it_outside_the_source(name):
    """A builder stage copies every source folder and builds the wheel; the image installs only that wheel (the
    source tree is not in it, so nothing can shadow the install) and checks the console script and the imports
    from /; the build context allow-lists everything the Dockerfile copies."""
    df = ROOT / "docker" / name
    stages = _stages(df.read_text())
    assert len(stages) == 2 and stages[0][0].endswith(" AS wheel"), f"{name}: want stages `wheel` and the image"
    (_, build), (_, image) = stages
    copied = {m.group(1).rstrip("/") for m in re.finditer(r"^COPY (\S+) \./", build, re.M)}
    copied |= {f for m in re.finditer(r"^COPY ((?:\S+ )+)\./$", build, re.M) for f in m.group(1).split()}
    missing = [src for src in _package_sources() if src not in copied]
    assert not missing, f"{name}: the wheel stage does not COPY {missing}"
    assert re.search(r"^RUN pip wheel .*--no-deps -w /dist \.$", build, re.M), f"{name}: no `pip wheel` of the sources"
    in_image = [ln for ln in image.splitlines() if ln.startswith("COPY ") and "--from=wheel" not in ln]
    assert all(" docker/" in ln for ln in in_image), f"{name}: the image copies more than docker/ helpers: {in_image}"
    assert "COPY --from=wheel /dist/ /tmp/dist/" in image, f"{name}: the image does not take the built wheel"
    run = next((ln for ln in image.splitlines() if ln.startswith("RUN ") and "/tmp/dist/routing_replay-" in ln), "")
    assert re.search(r"install .*/tmp/dist/routing_replay-\*\.whl && rm -rf /tmp/dist && cd / && "
                     r"routing-replay --help >/dev/null && python3? -c \"import routing_replay\.", run), \
        f"{name}: install the wheel, then run the script and import from /: {run}"
    if name.startswith("engine"):
        assert "import routing_replay.engines.vllm_plugin" in run and "vllm.general_plugins" in run, run
    ignore = (ROOT / "docker" / f"{name}.dockerignore").read_text().splitlines()
    sources = _package_sources() + [f for m in re.finditer(r"^COPY (docker/\S+(?: docker/\S+)*) ", df.read_text(), re.M)
                                    for f in m.group(1).split()]
    assert ignore[ignore.index("*") + 1:] and not [s for s in sources if f"!{s}" not in ignore], \
        f"{name}.dockerignore does not allow {[s for s in sources if f'!{s}' not in ignore]}"


def _trainer_module():
    spec = importlib.util.spec_from_file_location("compose_trainer", ROOT / "docker" / "trainer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_commands_parse_with_the_real_parsers():
    from routing_replay.apps.cli import build_parser
    c = load_compose()
    seen = set()
    for name, s in c["services"].items():
        cmd = s.get("command")
        if not cmd or (cmd[0].startswith("--")):
            continue                                    # engines: vLLM's parser, in the vllm-marked test
        args = cmd if curve_cli() else strip_curve(cmd)
        if args[0] == "routing-replay":
            a = build_parser().parse_args(args[1:])
            seen.add(a.cmd)
        elif args[0].startswith("python") and args[1] == f"{IMAGE_ROOT}/docker/trainer.py":
            _trainer_module().build_parser().parse_args(args[2:])
            seen.add("trainer")
        elif args[0] == "sh":
            script = args[1].replace(IMAGE_ROOT, str(ROOT))
            assert Path(script).is_file(), f"service {name}: {args[1]} is not in the repository"
            seen.add(name)
        else:
            pytest.fail(f"service {name}: unexpected command {cmd}")
        hc = s.get("healthcheck", {}).get("test")
        if hc:
            assert hc[0] == "CMD" and hc[2] == f"{IMAGE_ROOT}/docker/healthcheck.py", hc
    assert {"broker", "consume", "trainer"} <= seen, seen


def test_trainer_curve_flags_make_an_admitted_client(tmp_path):
    """trainer.py's --curve-secret/--server-key make its TrainerClients CURVE clients: a CURVE server that allows
    the trainer's key receives its fetch; with a key outside the allow-list nothing arrives."""
    import zmq
    import zmq.auth
    from zmq.auth.thread import ThreadAuthenticator

    if not zmq.has("curve"):
        pytest.skip("libzmq built without CURVE")
    try:
        from routing_replay.consumer import TrainerClient
        TrainerClient([], curve_secret=None, server_key=None).close()
    except TypeError:
        pytest.skip("TrainerClient takes no CURVE keys in this checkout")
    trainer = _trainer_module()
    allow = tmp_path / "allow"
    allow.mkdir()
    for name, d in (("server", tmp_path), ("trainer", allow), ("stranger", tmp_path)):
        zmq.auth.create_certificates(str(d), name)
    ctx = zmq.Context()
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(allow))
    server = ctx.socket(zmq.ROUTER)
    server.linger = 0
    server.curve_publickey, server.curve_secretkey = zmq.auth.load_certificate(str(tmp_path / "server.key_secret"))
    server.curve_server = True
    try:
        port = server.bind_to_random_port("tcp://127.0.0.1")
        for who, admitted in (("stranger", False), ("trainer", True)):
            secret = (allow if who == "trainer" else tmp_path) / f"{who}.key_secret"
            a = trainer.build_parser().parse_args(["--consumers", f"tcp://127.0.0.1:{port}", "--curve-secret",
                                                   str(secret), "--server-key", str(tmp_path / "server.key")])
            with trainer.client(a) as client:
                with pytest.raises(TimeoutError):
                    client.fetch([f"cmpl-{who}-0"], timeout_s=1.0)     # nobody answers; the server only looks
                got = server.poll(1000 if admitted else 200)
                assert bool(got) == admitted, (who, got)
                if admitted:
                    assert b"cmpl-trainer-0" in b"".join(server.recv_multipart())
    finally:
        server.close(0)
        auth.stop()
        ctx.term()


@pytest.mark.vllm
def test_engine_flags_parse_with_vllm():
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    c = load_compose()
    engines = {n: s for n, s in c["services"].items() if s.get("command", [""])[0].startswith("--")}
    assert set(engines) == {"engine", "engine-cpu"}, engines.keys()
    for name, s in engines.items():
        ns = make_arg_parser(FlexibleArgumentParser()).parse_args(s["command"])    # `vllm serve`'s parser
        validate_parsed_serve_args(ns)
        assert ns.port == 8000 and ns.host == "0.0.0.0", (name, ns.host, ns.port)
        assert s["environment"]["ROUTING_REPLAY_BROKER"] == "tcp://broker:5557"
    assert engines["engine"]["environment"] == engines["engine-cpu"]["environment"]
    assert "engine" in engines["engine-cpu"]["networks"]["default"]["aliases"]


# ---- the deployment, as local processes ---------------------------------------------------------------------------

class Service:
    """Own one compose service running as a local process, and a thread draining its output into `lines`."""

    def __init__(self, name: str, argv: list[str], env: dict):
        self.name, self.argv = name, argv
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                  cwd=ROOT)
        self.lines: list[str] = []
        self._q: queue.Queue = queue.Queue()
        self._t = threading.Thread(target=self._drain, daemon=True)
        self._t.start()

    def _drain(self) -> None:
        for line in self.p.stdout:
            self.lines.append(line)
            self._q.put(line)

    def tail(self, n: int = 40) -> str:
        return "".join(self.lines[-n:])

    def wait_for(self, pattern: str, timeout_s: float = 30.0) -> re.Match:
        rx = re.compile(pattern)
        for line in list(self.lines):
            if m := rx.search(line):
                return m
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                continue
            if m := rx.search(line):
                return m
        raise TimeoutError(f"{self.name}: no line matching {pattern!r} in {timeout_s}s; rc={self.p.poll()}; "
                           f"output:\n{self.tail()}")

    def wait(self, timeout_s: float) -> int:
        try:
            return self.p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{self.name} still running after {timeout_s}s; output:\n{self.tail()}") from None

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(10)
        self._t.join(10)
        return self.p.returncode


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalDeployment:
    """Own the local processes standing in for the compose services, and the mapping from the services' view
    (service host names, 0.0.0.0 binds, /run/secrets, named volumes, /opt/routing-replay) to this machine."""

    def __init__(self, compose: dict, tmp: Path, model: Path, curve: bool):
        self.c, self.tmp, self.model, self.curve = compose, tmp, model, curve
        self.endpoints: dict[tuple[str, int], str] = {}      # (service or alias, container port) -> host:port
        self.alias = {n: n for n in compose["services"]}
        for n, s in compose["services"].items():
            for a in ((s.get("networks") or {}).get("default") or {}).get("aliases", []):
                self.alias[a] = n
        self.procs: dict[str, Service] = {}
        self.base_env = {k: v for k, v in os.environ.items() if not k.startswith("ROUTING_REPLAY_")}
        self.base_env["PYTHONUNBUFFERED"] = "1"
        # the images have `routing-replay` on PATH (make-keys.sh calls it); so does this interpreter's venv
        self.base_env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"

    # -- mapping -----------------------------------------------------------------------------------------------

    def _host_path(self, src: str) -> Path:
        """A bind-mount or secret source, relative to the compose file, moved under the temp dir."""
        rel = os.path.relpath(os.path.normpath(ROOT / src), ROOT)
        assert not rel.startswith(".."), f"{src} lies outside the compose project"
        return self.tmp / "binds" / rel

    def _mounts(self, name: str) -> list[tuple[str, str]]:
        s = self.c["services"][name]
        m = [(IMAGE_ROOT, str(ROOT)), ("/run/secrets", str(self.tmp / "secrets" / name))]
        for v in s.get("volumes", []):
            src, target = v.split(":")[:2]
            local = self._host_path(src) if src.startswith((".", "/")) else self.tmp / "volumes" / src
            local.mkdir(parents=True, exist_ok=True)
            m.append((target, str(local)))
        return m

    def _secrets(self, name: str) -> None:
        for sec in self.c["services"][name].get("secrets", []):
            src = self._host_path(self.c["secrets"][sec["source"]]["file"])
            dst = self.tmp / "secrets" / name / os.path.relpath(sec["target"], "/run/secrets")
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)

    def localize(self, name: str, value: str, bind: bool = False) -> str:
        for target, local in self._mounts(name):
            if value == target or value.startswith(target + "/"):
                return local + value[len(target):]

        def sub(m):
            host, port = m.group("host"), int(m.group("port"))
            if bind and m.group("scheme") == "tcp://" and host in ("0.0.0.0", "*"):
                return "tcp://127.0.0.1:*"
            svc = name if host in ("127.0.0.1", "localhost") else self.alias.get(host)
            if svc is None:
                return m.group(0)
            if (svc, port) not in self.endpoints:
                raise KeyError(f"{name} refers to {m.group(0)} before {svc} bound port {port}")
            return (m.group("scheme") or "") + self.endpoints[svc, port]
        return _ENDPOINT.sub(sub, value)

    def command(self, name: str) -> tuple[list[str], dict]:
        s = self.c["services"][name]
        cmd = list(s["command"])
        env = dict(self.base_env)
        env.update({k: str(v) for k, v in (s.get("environment") or {}).items()})
        if not self.curve:
            cmd = strip_curve(cmd)
            for k in CURVE_ENV:
                env.pop(k, None)
        else:
            self._secrets(name)
        if cmd[0] == "routing-replay":
            head, cmd = CLI, cmd[1:]
        elif cmd[0].startswith("python"):
            head, cmd = [sys.executable], cmd[1:]
        elif cmd[0].startswith("--"):                    # flags for the image's entrypoint
            m = re.search(r"^ENTRYPOINT (\[.*\])$", _dockerfile(s).read_text(), re.M)
            entry = json.loads(m.group(1))
            head = [sys.executable if entry[0].startswith("python") else entry[0]] + entry[1:]
        else:
            head, cmd = [cmd[0]], cmd[1:]
        out = []
        for i, a in enumerate(cmd):
            prev = cmd[i - 1] if i else ""
            out.append(self.localize(name, a, bind=True) if not prev.startswith("--host") else "127.0.0.1")
        for k in env:
            if k in (s.get("environment") or {}):
                env[k] = self.localize(name, env[k])
        return head + out, env

    # -- processes ---------------------------------------------------------------------------------------------

    def run_once(self, name: str, timeout_s: float = 120) -> Service:
        argv, env = self.command(name)
        p = self.procs[name] = Service(name, argv, env)
        rc = p.wait(timeout_s)
        assert rc == 0, f"{name} exited {rc}:\n{p.tail()}"
        return p

    def start(self, name: str) -> Service:
        argv, env = self.command(name)
        sub = self.c["services"][name]["command"][1]
        p = self.procs[name] = Service(name, argv, env)
        rx, flags = BOUND[sub]
        m = p.wait_for(rx)
        orig = self.c["services"][name]["command"]
        for flag, got in zip(flags, m.groups()):
            port = int(orig[orig.index(flag) + 1].rsplit(":", 1)[1])
            self.endpoints[name, port] = got.split("://", 1)[1]
        return p

    def start_engine(self, name: str) -> Service:
        cmd = self.c["services"][name]["command"]
        port = int(cmd[cmd.index("--port") + 1])
        local = _free_port()
        self.endpoints[name, port] = f"127.0.0.1:{local}"
        argv, env = self.command(name)
        argv[argv.index("--model") + 1] = str(self.model)
        for flag, value in ENGINE_TEST_FLAGS.items():
            argv[argv.index(flag) + 1] = value
        argv[argv.index("--port") + 1] = str(local)
        self.procs[name] = Service(name, argv + ENGINE_TEST_EXTRA, env)
        return self.procs[name]

    def healthcheck(self, name: str) -> subprocess.CompletedProcess:
        test = self.c["services"][name]["healthcheck"]["test"]
        assert test[0] == "CMD", test
        argv = [sys.executable if test[1].startswith("python") else test[1]]
        argv += [self.localize(name, a) for a in test[2:]]
        return subprocess.run(argv, capture_output=True, text=True, timeout=30)

    def stop_all(self) -> None:
        for name in reversed(list(self.procs)):
            self.procs[name].stop()


def _post(base: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _wait_healthy(svc: Service, base: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if svc.p.poll() is not None:
            raise RuntimeError(f"{svc.name} exited with {svc.p.returncode}:\n{svc.tail()}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (OSError, http.client.HTTPException):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{svc.name} not healthy after {timeout_s}s:\n{svc.tail()}")
        time.sleep(0.5)


def _union_records(dirs: list[Path]) -> dict:
    from routing_replay.consumer import load_records
    return {k: r for d in dirs if d.exists() for k, r in load_records(d).items()}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    pytest.importorskip("vllm")
    from routing_replay.apps.vllm_harness import tiny_model

    t0 = time.monotonic()
    tmp = tmp_path_factory.mktemp("compose")
    compose = load_compose()
    dep = LocalDeployment(compose, tmp, tiny_model("qwen3_moe"), curve_cli() and curve_plugin())
    consumers = [n for n, s in compose["services"].items() if s.get("command", [None, None])[1] == "consume"]
    try:
        if curve_cli():
            dep.run_once("keys")
        dep.start("broker")
        for n in consumers:
            dep.start(n)
        engine = dep.start_engine("engine-cpu")
        trainer_argv, trainer_env = dep.command("trainer")
        trainer = dep.procs["trainer"] = Service("trainer", trainer_argv, trainer_env)
        base = "http://" + dep.endpoints["engine-cpu", 8000]
        _wait_healthy(engine, base, STARTUP_S)
        rc = trainer.wait(STARTUP_S)
        assert rc == 0, f"trainer exited {rc}:\n{trainer.tail(60)}"
        # The test's own request: one completion with two prompts sharing a prefix (ids "<id>-0", "<id>-1").
        prefix = "A shared prefix long enough to fill a few KV-cache blocks of the tiny byte-level model. " * 2
        ecmd = compose["services"]["engine-cpu"]["command"]
        own = _post(base, "/v1/completions", {"model": ecmd[ecmd.index("--served-model-name") + 1],
                                              "prompt": [prefix + "first", prefix + "second"], "max_tokens": 8,
                                              "temperature": 0, "return_token_ids": True})
        npz_dirs = [Path(dep.localize(n, compose["services"][n]["command"][
            compose["services"][n]["command"].index("--npz-dir") + 1])) for n in consumers]
        own_keys = {f"{own['id']}-{c['index']}": c for c in own["choices"]}
        deadline = time.monotonic() + 60
        while not own_keys.keys() <= _union_records(npz_dirs).keys():
            assert time.monotonic() < deadline, f"no records for {sorted(own_keys)} after 60s"
            time.sleep(0.1)
        health = {n: dep.healthcheck(n) for n in ["broker", *consumers, "engine-cpu"]}
        for n in ["engine-cpu", *consumers, "broker"]:
            rc = dep.procs[n].stop()
            assert rc == 0 or n == "engine-cpu", f"{n} exited {rc}:\n{dep.procs[n].tail()}"
        trainer_out = Path(dep.localize("trainer", "/data/trainer"))
        yield dict(dep=dep, npz_dirs=npz_dirs, trainer_out=trainer_out, own=own_keys, health=health,
                   consumers=consumers, model=dep.model, elapsed_s=time.monotonic() - t0)
    finally:
        dep.stop_all()


@pytest.mark.vllm
@pytest.mark.slow
def test_trainer_and_npz_records_agree_bit_for_bit(deployment):
    from routing_replay.consumer import load_records
    d = deployment
    per_consumer = [load_records(p) for p in d["npz_dirs"]]
    # which consumer a record lands on is the broker's placement: a step's opens go to one consumer together, so
    # with a few rounds both shards may land on one consumer; every record must be on exactly one of them
    union = {k: r for recs in per_consumer for k, r in recs.items()}
    assert sum(map(len, per_consumer)) == len(union), "a record was written by both consumers"
    rollouts = [json.loads(x) for x in (d["trainer_out"] / "rollouts.jsonl").read_text().splitlines()]
    fetched = load_records(d["trainer_out"])
    trainer_args = d["dep"].c["services"]["trainer"]["command"]
    rounds, batch = (int(trainer_args[trainer_args.index(f) + 1]) for f in ("--rounds", "--batch"))
    assert len(rollouts) == len(fetched) == rounds * batch
    assert set(union) == set(fetched) | set(d["own"]), sorted(set(union) ^ (set(fetched) | set(d["own"])))[:6]
    for ro in rollouts:
        key = ro["record"]
        assert key == ro["response_id"] + "-0" and ro["response_id"].startswith("cmpl-"), ro
        if not ro["live"]:          # what the consumers said about their subscribers (drops, unreachable)
            said = [ln for c in d["consumers"] for ln in d["dep"].procs[c].lines
                    if "subscriber" in ln or "unreachable" in ln]
            raise AssertionError(f"{key} never reached the trainer's live subscription; consumers: {said[-12:]}")
        rec = fetched[key]
        assert rec.equals(union[key]), f"{key}: the trainer's copy differs from the npz file"
        assert rec.prompt_token_ids.tolist() == ro["prompt_token_ids"]
        assert rec.output_token_ids.tolist() == ro["token_ids"]
    # the test's own request: record keys are the OpenAI response id plus the prompt's index
    for key, choice in d["own"].items():
        assert union[key].prompt_token_ids.tolist() == choice["prompt_token_ids"]
        assert union[key].output_token_ids.tolist() == choice["token_ids"]


@pytest.mark.vllm
@pytest.mark.slow
def test_records_complete_and_agree_with_the_oracle(deployment):
    from routing_replay.apps.oracle import Oracle
    recs = _union_records(deployment["npz_dirs"])
    oracle = Oracle(str(deployment["model"]))
    L = len(oracle.layer_ids)
    for key, r in recs.items():
        assert r.complete and not r.missing and r.reason == "", (key, r.reason, r.missing)
        assert r.finish_reason in ("length", "stop"), (key, r.finish_reason)
        P, G = len(r.prompt_token_ids), len(r.output_token_ids)
        assert r.prompt_routed_experts.shape[:2] == (P, L) and r.routed_experts.shape[:2] == (G, L)
        v = oracle.check(r)
        assert v.ok, (key, v.error, v.mismatches[:3], v.sentinel_errors[:3])
        assert v.rows == (P + G - 1 - r.num_cached_tokens) * L, (key, v.rows, P, G, r.num_cached_tokens)
    # shared prefixes: later rollouts hit vLLM's prefix cache, and the cached rows are the -1 sentinel
    assert any(r.num_cached_tokens > 0 for r in recs.values())


def _stats(log: str, start: str) -> dict:
    """The key=value fields of the last stats line beginning with `start` (docs/DEPLOY.md lists them)."""
    lines = [ln[ln.index(start):] for ln in log.splitlines() if start in ln]
    assert lines, f"no stats line {start!r}"
    return dict(re.findall(r"(\w+)=(\S+)", lines[-1]))


@pytest.mark.vllm
@pytest.mark.slow
def test_health_checks_and_stats_lines(deployment):
    d = deployment
    for name, r in d["health"].items():
        assert r.returncode == 0, f"{name} health check failed: {r.stdout}{r.stderr}"
    procs = d["dep"].procs
    recs = _union_records(d["npz_dirs"])
    broker = "".join(procs["broker"].lines)
    services = d["dep"].c["services"]
    ids = {n: services[n]["command"][services[n]["command"].index("--consumer-id") + 1] for n in d["consumers"]}
    for n in d["consumers"]:
        assert f"broker consumer joined id={ids[n]} " in broker
    assert "broker producer joined" in broker
    last = _stats(broker, "broker msgs_in=")        # the final line, logged at shutdown
    assert last["bad"] == "0" and all(v == "0" for k, v in last.items() if k.startswith("dropped")), last
    written = 0
    for n in d["consumers"]:
        st = _stats("".join(procs[n].lines), f"consumer {ids[n]} records=")
        assert st["records"] == st["complete"] and st["incomplete"] == st["bad"] == "0", (n, st)
        written += int(st["records"])
    assert written == len(recs)
    curve = "on" if d["dep"].curve else f"stripped (CLI: {curve_cli()}, plugin reads {CURVE_ENV[0]}: {curve_plugin()})"
    print(f"compose deployment: {len(recs)} records, CURVE {curve}, {d['elapsed_s']:.0f}s")
    print("".join(ln for ln in procs["trainer"].lines if "trainer round=" in ln))
