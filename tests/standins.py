"""Stand-ins shared by several test files for what an engine hands the producer."""

from __future__ import annotations


class Slot:
    """Deferred rows in a ring slot: `result()` is the array, and the slot is overwritten (-7) once released, so a
    producer that keeps reading it after `release()` sends wrong rows."""

    def __init__(self, arr):
        self.arr, self.shape, self.dtype, self.released = arr, arr.shape, arr.dtype, 0

    def result(self):
        return self.arr

    def release(self):
        self.released += 1
        self.arr[...] = -7


def worker_capture(settings, *, layers: int = 3, top_k: int = 2, max_tokens: int = 16, eager: bool = True,
                   device_type: str = "cpu", runner=None, producer=None, binding=None):
    """A WorkerCapture built through its public constructor from a plan (engines/vllm_plugin/plan.py), on the CPU,
    with no vLLM: a Model Runner V1 worker, eager (hooks in Python every step) unless eager=False (a graph
    engine's plan). `binding`: the CaptureBinding or a stand-in (default: a stand-in that binds nothing)."""
    from types import SimpleNamespace

    from routing_replay.engines.vllm_plugin.plan import make_plan
    from routing_replay.engines.vllm_plugin.worker import WorkerCapture, make_cache

    plan = make_plan(settings, kind="v1", device_type=device_type, enforce_eager=eager,
                     layer_ids=list(range(layers)), top_k=top_k, max_num_batched_tokens=max_tokens)
    cache, copier = make_cache(plan, "cpu")
    if binding is None:
        binding = SimpleNamespace(gate=eager, active=False, calls=0, min_rows=0, layers=[None] * layers)
    return WorkerCapture(runner if runner is not None else SimpleNamespace(), settings, plan, cache=cache,
                         copier=copier, binding=binding, producer=producer, randomized=False)
