"""Time CaptureBinding's drain, which checks every MoE layer's top-k tensor and hands the step to the worker
(CaptureBinding's drain -> HostPath.take_step), after the last layer's hook, plus a second drain of the then
empty list: µs per step with warm caches, median of --reps. The hooks (C calls) run untimed. The
CPU build's post_step hands a step of C hooks over without this check (HostRows checks the tensors on the
producer's thread); the drain measured here is the path of a Python last hook (a foreign hook chained on the last
MoE layer, or data parallelism) and of steps that do not go by reference.

Usage: python bench/eager_drain.py [--layers 48] [--tokens 64] [--top-k 8] [--steps 20000] [--reps 7] [--json FILE]

To compare two trees, run this file from each with its tree on PYTHONPATH (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from routing_replay.engines.vllm_plugin.binding import CaptureBinding  # noqa: E402
from routing_replay.engines.vllm_plugin.settings import Settings  # noqa: E402
from routing_replay.engines.vllm_plugin.plan import make_plan  # noqa: E402
from routing_replay.engines.vllm_plugin.worker import WorkerCapture, make_cache  # noqa: E402


class _Router:
    capture_fn = None

    def set_capture_fn(self, fn) -> None:
        self.capture_fn = fn


def run(layers: int, tokens: int, top_k: int, steps: int, reps: int) -> dict:
    settings = Settings(broker="ipc://unused")
    plan = make_plan(settings, kind="v1", device_type="cpu", enforce_eager=True, layer_ids=list(range(layers)),
                     top_k=top_k, max_num_batched_tokens=tokens)
    cache, copier = make_cache(plan, "cpu")
    b = CaptureBinding([SimpleNamespace(layer_id=i, router=_Router(), top_k=top_k) for i in range(layers)],
                       cache.record, gate=True, c_hooks=True)
    cap = WorkerCapture(SimpleNamespace(), settings, plan, cache=cache, copier=copier, binding=b)   # take_step
    cap.active = True
    b.bind()
    hooks = b.hooks
    last = hooks[-1]
    ids = torch.zeros(tokens, top_k, dtype=torch.int32)
    pc = time.perf_counter_ns
    per_rep = []
    for _ in range(reps):
        total = 0
        for _ in range(steps):
            for hook in hooks[:-1]:
                hook(ids)
            b.active, b.calls, b.min_rows = True, 0, tokens
            t0 = pc()
            last(ids)               # the last layer's hook (a C call, as the others)
            b.drain()               # the check, the hand-over
            b.drain()               # nothing held
            total += pc() - t0
            if b.calls != layers or cap.path.host_step is None:
                raise RuntimeError(f"{b.calls} of {layers} layers counted; step taken: "
                                   f"{cap.path.host_step is not None}")
            cap.path.host_step = None
        per_rep.append(total / steps / 1e3)
    return {"layers": layers, "tokens": tokens, "top_k": top_k, "steps": steps,
            "us_per_step": round(statistics.median(per_rep), 2), "reps_us": [round(x, 2) for x in per_rep]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=48, help="MoE layers (Qwen3-30B-A3B: 48)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens in the step")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20000, help="steps per rep")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", help="also write the result here")
    a = ap.parse_args(argv)
    r = run(a.layers, a.tokens, a.top_k, a.steps, a.reps)
    print(json.dumps(r))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
