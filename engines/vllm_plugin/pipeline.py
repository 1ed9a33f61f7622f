"""Run the embedded broker and consumer in a helper process that the publishing vLLM worker starts and owns.

ROUTING_REPLAY_BROKER=embedded means: no broker or consumer to start by hand, records appear in
ROUTING_REPLAY_NPZ_DIR and/or at ROUTING_REPLAY_SERVE while the engine runs. They run in a child process of the
worker rather than as threads inside it because the consumer's work (accumulating rows of every request,
writing npz files) is Python that would take the GIL from vLLM's engine thread, whose own step loop is Python
too: as threads they cost several times more engine throughput than the same work in another process
(docs/PERFORMANCE.md). The worker keeps only the producer thread.

Parent side: `PipelineProcess(npz_dir, serve)` starts `python -m routing_replay.engines.vllm_plugin.pipeline`, waits for
its "ready" line, and exposes `frontend` (an ipc:// endpoint in a private temp dir). `close()` (after the
producer has sent everything) sends SIGTERM; the child lets its consumer go idle, closes, and exits 0.
Child side: routing_replay.engines.embedded.EmbeddedPipeline (a Broker and a Consumer joined by inproc://) with an
ipc:// frontend. It also exits if its parent disappears.

A helper that dies (killed, out of memory, a crash) is noticed by a watch thread in the parent within
`watch_interval_s`, named in one WARNING line (its pid, exit status, the restart count, and the record keys of the
requests in flight, which lose the rows the dead consumer held), and started again on the same frontend: the
producer reconnects and resends what the dead broker had not acknowledged, as after any broker restart
(docs/RELIABILITY.md), and the worker sends the opens of its requests in flight again (`on_restart`), so those
requests' records come out incomplete with the lost positions in `missing`, and every later request is captured
as before. A helper that dies within `crash_window_s` of its start waits
longer before the next start (doubling up to `max_backoff_s`).
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

log = logging.getLogger("vllm.routing_replay")

READY = "routing-replay-pipeline-ready"


class PipelineProcess:
    """Own the helper process: its private ipc directory, its start-up handshake, the watch that starts it again
    when it dies, and its orderly stop."""

    def __init__(self, npz_dir: str | None = None, serve: str | None = None, *, start_timeout_s: float = 60.0,
                 in_flight: Callable[[], list] | None = None, on_restart: Callable[[], None] | None = None,
                 watch_interval_s: float = 0.5,
                 crash_window_s: float = 10.0, max_backoff_s: float = 30.0):
        self.dir = tempfile.mkdtemp(prefix="routing-replay-")
        self.frontend = f"ipc://{self.dir}/frontend"
        self.npz_dir, self.serve = npz_dir, serve
        self.start_timeout_s = start_timeout_s
        self.in_flight, self.on_restart = in_flight, on_restart
        self.watch_interval_s, self.crash_window_s, self.max_backoff_s = watch_interval_s, crash_window_s, max_backoff_s
        self.restarts = 0               # helpers started again after one died
        self.lost_in_flight = 0         # requests in flight when a helper died, summed over deaths
        self._lock = threading.Lock()   # self.proc is replaced (watch thread) or stopped (close) under it
        self._closed = False
        self._stop = threading.Event()
        self._dead_pid = None           # the dead helper last named (_watch_loop)
        self.proc = None
        try:
            self.proc, self.started_at = self._start(), time.monotonic()
        except BaseException:
            self.close(timeout_s=5)
            raise
        self._watch = threading.Thread(target=self._watch_loop, name="rr-pipeline-watch", daemon=True)
        self._watch.start()

    def _start(self) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "routing_replay.engines.vllm_plugin.pipeline", "--frontend", self.frontend,
               "--parent", str(os.getpid())]
        if self.npz_dir:
            cmd += ["--npz-dir", self.npz_dir]
        if self.serve:
            cmd += ["--serve", self.serve]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ROUTING_REPLAY_")}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env)
        try:
            self._wait_ready(proc, self.start_timeout_s)
        except BaseException:
            _stop_proc(proc, 5)
            raise
        return proc

    def _watch_loop(self) -> None:
        """Notice a dead helper and start another (watch thread). Never raises: a failed start is logged and tried
        again after the backoff."""
        backoff_s = self.watch_interval_s
        while not self._stop.wait(self.watch_interval_s):
            proc = self.proc
            if proc is None or proc.poll() is None:
                continue
            ran_s = time.monotonic() - self.started_at
            if ran_s < self.crash_window_s:
                backoff_s = min(self.max_backoff_s, backoff_s * 2)
            else:
                backoff_s = self.watch_interval_s
            if proc.pid != self._dead_pid:      # (a start that failed leaves the dead one: named once)
                self._dead_pid = proc.pid
                try:
                    keys = list(self.in_flight()) if self.in_flight is not None else []
                except Exception as e:  # noqa: BLE001 -- the names are for the log line; the restart must happen
                    keys = [f"<not known: {type(e).__name__}: {e}>"]
                self.lost_in_flight += len(keys)
                log.warning("routing-replay: embedded helper process %d died (exit status %s) after %.1fs; %d "
                            "requests in flight lose the rows it held (their records come out incomplete): %s; "
                            "starting it again in %.1fs (restarts=%d, lost_in_flight=%d)", proc.pid,
                            proc.returncode, ran_s, len(keys),
                            [k[:64] for k in keys[:32]] + (["..."] if len(keys) > 32 else []), backoff_s,
                            self.restarts + 1, self.lost_in_flight)
            if self._stop.wait(backoff_s):
                return
            with self._lock:
                if self._closed:
                    return
                if proc.stdout is not None:
                    proc.stdout.close()
                t0 = time.monotonic()
                try:
                    self.proc, self.started_at = self._start(), time.monotonic()
                except Exception as e:  # noqa: BLE001 -- tried again at the next look (proc stays the dead one)
                    log.error("routing-replay: embedded helper process did not start again: %s: %s; next try in "
                              "%.1fs or more", type(e).__name__, e, min(self.max_backoff_s, backoff_s * 2))
                    self.started_at = time.monotonic()
                    continue
                self.restarts += 1
            log.warning("routing-replay: embedded helper process started again: pid %d, ready in %.1fs "
                        "(restarts=%d)", self.proc.pid, time.monotonic() - t0, self.restarts)
            if self.on_restart is not None:
                self.on_restart()

    @staticmethod
    def _wait_ready(proc: subprocess.Popen, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        out = proc.stdout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"routing-replay pipeline process not ready after {timeout_s:.0f}s")
            ready, _, _ = select.select([out], [], [], min(left, 0.5))
            if ready:
                line = out.readline().decode(errors="replace").strip()
                if line == READY:
                    return
                if not line and proc.poll() is not None:
                    raise RuntimeError(f"routing-replay pipeline process exited with {proc.returncode} "
                                       "before it was ready (its error is in this process's stderr)")
            elif proc.poll() is not None:
                raise RuntimeError(f"routing-replay pipeline process exited with {proc.returncode}")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the watch, ask the child to drain and exit (SIGTERM), wait, kill it if it does not. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop.set()
            proc = self.proc
        watch = getattr(self, "_watch", None)
        if watch is not None and watch is not threading.current_thread():
            watch.join()
        if proc is not None:
            _stop_proc(proc, timeout_s)
        shutil.rmtree(self.dir, ignore_errors=True)


def _stop_proc(proc: subprocess.Popen, timeout_s: float) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("routing-replay pipeline process did not stop in %.0fs; killing it", timeout_s)
            proc.kill()
            proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m routing_replay.engines.vllm_plugin.pipeline",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--frontend", required=True)
    ap.add_argument("--parent", type=int, required=True, help="exit when this process is gone")
    ap.add_argument("--npz-dir")
    ap.add_argument("--serve")
    ap.add_argument("--drain-timeout-s", type=float, default=20.0)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="routing-replay pipeline %(levelname)s %(message)s")

    import zmq

    from routing_replay.engines.embedded import EmbeddedPipeline

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    ctx = zmq.Context()
    # the serve address was checked by the plugin's settings (ROUTING_REPLAY_SERVE_INSECURE included)
    pipe = EmbeddedPipeline(a.npz_dir, a.serve, frontend=a.frontend, context=ctx, insecure=True)
    print(READY, flush=True)
    while not stop.wait(0.5):
        if os.getppid() != a.parent:
            logging.warning("parent %d is gone; draining and exiting", a.parent)
            break
    if not pipe.wait_idle(a.drain_timeout_s, quiet_s=0.3):
        logging.warning("consumer not idle after %.0fs (requests that never finished stay unwritten): %d in flight",
                        a.drain_timeout_s, pipe.consumer.acc.in_flight)
    pipe.close()
    ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
