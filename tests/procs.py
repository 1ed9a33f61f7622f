"""Start real `routing-replay` processes for tests and read their bound endpoints from their log lines."""

from __future__ import annotations

import http.client
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

BIN = [sys.executable, "-m", "routing_replay.apps.cli"]


class UnixHTTP(http.client.HTTPConnection):
    """HTTP over a unix socket (the OpenAI server started with --uds): no tcp port to pick or collide on."""

    def __init__(self, path: str, timeout: float = 60):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def http_json(uds: str, method: str, path: str, body=None, headers=None):
    """One request with a JSON body to the server at unix socket `uds`: (status, response bytes)."""
    c = UnixHTTP(uds)
    try:
        c.request(method, path, body=json.dumps(body) if body is not None else None,
                  headers={"Content-Type": "application/json", **(headers or {})})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def stop_popen(p: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM, wait up to `timeout` s, then SIGKILL."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def wait_healthy(srv: subprocess.Popen, uds: str, timeout_s: float, log_path) -> None:
    """Poll the OpenAI server `srv` (listening on unix socket `uds`) until GET /health answers 200; raise, naming
    its log, if it exits first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if srv.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {srv.returncode}; see {log_path}")
        try:
            if http_json(uds, "GET", "/health")[0] == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"vllm serve not up after {timeout_s}s; see {log_path}")
        time.sleep(0.5)


_LIVE: list = []          # every Proc started, so tests/conftest.py can reap what a failing test left behind


def reap_all() -> None:
    """Kill every Proc still running."""
    while _LIVE:
        p = _LIVE.pop()
        if p.alive():
            p.kill9()


def stop_all(*procs) -> None:
    """Stop every process given (None skipped) even when one fails to stop cleanly; then assert all exited 0."""
    codes = [(" ".join(p.args[:3]), p.stop()) for p in procs if p is not None]
    bad = [(args, rc) for args, rc in codes if rc != 0]
    assert not bad, f"processes did not exit cleanly: {bad}"


class Proc:
    """Own one child process and a thread draining its stderr into `lines` (so its pipe never fills)."""

    def __init__(self, args: list[str], env: dict | None = None):
        _LIVE.append(self)
        self.args = args
        e = dict(os.environ, PYTHONUNBUFFERED="1")
        if env:
            e.update(env)
        self.p = subprocess.Popen(BIN + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=e)
        self.lines: list[str] = []
        self._q: queue.Queue = queue.Queue()
        self._t = threading.Thread(target=self._drain, daemon=True)
        self._t.start()

    def _drain(self) -> None:
        for line in self.p.stdout:
            self.lines.append(line)
            self._q.put(line)

    def wait_for(self, pattern: str, timeout_s: float = 20.0) -> re.Match:
        rx = re.compile(pattern)
        for line in list(self.lines):
            m = rx.search(line)
            if m:
                return m
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            m = rx.search(line)
            if m:
                return m
            if self.p.poll() is not None and self._q.empty():
                break
        raise TimeoutError(f"{self.args[0]}: no line matching {pattern!r} in {timeout_s}s; "
                           f"rc={self.p.poll()}; output:\n{''.join(self.lines[-30:])}")

    def alive(self) -> bool:
        return self.p.poll() is None

    def stop(self, sig=signal.SIGTERM, timeout_s: float = 20.0) -> int:
        if self.p.poll() is None:
            self.p.send_signal(sig)
            try:
                self.p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(5)
        self._t.join(5)
        return self.p.returncode

    def kill9(self) -> None:
        self.p.kill()
        self.p.wait(5)


def start_broker(frontend: str = "tcp://127.0.0.1:*", backend: str = "tcp://127.0.0.1:*", *extra: str) -> tuple:
    b = Proc(["broker", "--frontend", frontend, "--backend", backend, "--stats-interval", "1", *extra])
    m = b.wait_for(r"broker frontend=(\S+) backend=(\S+)")
    return b, m.group(1), m.group(2)


def start_consumer(backend: str, *extra: str) -> Proc:
    c = Proc(["consume", "--connect", backend, "--stats-interval", "1", "--no-progress", *extra])
    c.wait_for(r"consumer (\S+) connected")
    return c


def wait_until(pred, timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise TimeoutError(f"{what} not reached in {timeout_s}s")


def load_script(path, name: str):
    """A script that is not a package module (bench/*.py) imported by its path, as module `name`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, str(path))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def package_dirs() -> dict:
    """Checkout folder of each installed package, by name: routing_replay/ itself and every top-level folder with an
    __init__.py but tests/ (setup.py finds them the same way)."""
    from pathlib import Path
    repo = Path(__file__).resolve().parent.parent
    return {p.parent.name: p.parent for p in repo.glob("*/__init__.py") if p.parent.name != "tests"}


def c_toolchain() -> bool:
    """What setup.py needs to build its C extension (producer/_gather.c): a C compiler and Python.h."""
    import shutil
    import sysconfig

    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return bool(shutil.which(cc)) and os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
