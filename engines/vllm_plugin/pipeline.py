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
Child side: a Broker (frontend ipc://, backend inproc://) and a Consumer in one process, as
routing_replay.apps.embedded wires them. It also exits if its parent disappears.
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
import uuid

log = logging.getLogger("vllm.routing_replay")

READY = "routing-replay-pipeline-ready"


class PipelineProcess:
    """Own the helper process: its private ipc directory, its start-up handshake and its orderly stop."""

    def __init__(self, npz_dir: str | None = None, serve: str | None = None, *, start_timeout_s: float = 60.0):
        self.dir = tempfile.mkdtemp(prefix="routing-replay-")
        self.frontend = f"ipc://{self.dir}/frontend"
        self.npz_dir, self.serve = npz_dir, serve
        cmd = [sys.executable, "-m", "routing_replay.engines.vllm_plugin.pipeline", "--frontend", self.frontend,
               "--parent", str(os.getpid())]
        if npz_dir:
            cmd += ["--npz-dir", npz_dir]
        if serve:
            cmd += ["--serve", serve]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ROUTING_REPLAY_")}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env)
        self._closed = False
        try:
            self._wait_ready(start_timeout_s)
        except BaseException:
            self.close(timeout_s=5)
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        out = self.proc.stdout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"routing-replay pipeline process not ready after {timeout_s:.0f}s")
            ready, _, _ = select.select([out], [], [], min(left, 0.5))
            if ready:
                line = out.readline().decode(errors="replace").strip()
                if line == READY:
                    return
                if not line and self.proc.poll() is not None:
                    raise RuntimeError(f"routing-replay pipeline process exited with {self.proc.returncode} "
                                       "before it was ready (its error is in this process's stderr)")
            elif self.proc.poll() is not None:
                raise RuntimeError(f"routing-replay pipeline process exited with {self.proc.returncode}")

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self, timeout_s: float = 30.0) -> None:
        """Ask the child to drain and exit (SIGTERM), wait, kill it if it does not. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("routing-replay pipeline process did not stop in %.0fs; killing it", timeout_s)
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _wait_idle(consumer, timeout_s: float, quiet_s: float = 0.3) -> bool:
    """Until no request is in flight and no message arrived for quiet_s (as EmbeddedPipeline.wait_idle)."""
    deadline = time.monotonic() + timeout_s
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        n = consumer.msgs_in
        if n != last:
            last, since = n, time.monotonic()
        elif consumer.acc.in_flight == 0 and not consumer.acc.pending_finish and time.monotonic() - since >= quiet_s:
            return True
        time.sleep(0.02)
    return False


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

    from routing_replay.broker import Broker
    from routing_replay.consumer import Consumer

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    ctx = zmq.Context()
    backend = f"inproc://routing-replay-{uuid.uuid4().hex[:12]}-backend"
    broker = Broker(a.frontend, backend, context=ctx, stats_interval_s=60.0).start()
    consumer = Consumer(backend, npz_dir=a.npz_dir, serve=a.serve, context=ctx, stats_interval_s=60.0).start()
    print(READY, flush=True)
    while not stop.wait(0.5):
        if os.getppid() != a.parent:
            logging.warning("parent %d is gone; draining and exiting", a.parent)
            break
    if not _wait_idle(consumer, a.drain_timeout_s):
        logging.warning("consumer not idle after %.0fs (requests that never finished stay unwritten): %d in flight",
                        a.drain_timeout_s, consumer.acc.in_flight)
    consumer.close()
    broker.close()
    ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
