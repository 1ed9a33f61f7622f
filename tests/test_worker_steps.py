"""WorkerCapture's pre_step/post_step through its public surface, without vLLM: a Model Runner V1 stand-in (the
fields the worker reads), the real RoutingCache, AsyncCopier and StepBatch, and a producer stand-in that records
what the worker hands it (the producer is tested on its own sockets). What a captured step hands over is specified
here with exact values."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from routing_replay.engines.vllm_plugin import scheduler_hooks
from routing_replay.engines.vllm_plugin.settings import Settings
from tests.standins import worker_capture

L, K = 2, 2


class Producer:
    """Records open_many / end_many / publish_steps in order; publish_steps resolves and reads the deferred rows
    as the producer's thread does, then releases them."""

    healthy = True

    def __init__(self):
        self.calls = []

    def open_many(self, items, **kw):
        self.calls.append(("open", [it[0] for it in items]))
        return []

    def end_many(self, items, **kw):
        self.calls.append(("end", [(kind, key, n) for kind, key, n, *_ in items]))

    def publish_steps(self, ids, starts, counts, rows, checked=False):
        if rows.deferred:
            ids, starts, counts = rows.resolve(ids, starts, counts)
        self.calls.append(("rows", [list(k) for k in ids], [np.asarray(s).tolist() for s in starts],
                           [np.asarray(c).tolist() for c in counts], rows.result().tolist()))
        rows.release()


class Runner:
    """Model Runner V1 after execute_model: the persistent batch and query_start_loc (what the worker reads)."""

    def __init__(self):
        self.input_batch = SimpleNamespace(num_reqs=0, req_ids=[], num_computed_tokens_cpu=np.zeros(8, np.int32))
        self.query_start_loc = SimpleNamespace(np=np.zeros(9, np.int32))

    def lay_out(self, sched: list, computed: list) -> None:
        ib = self.input_batch
        ib.num_reqs, ib.req_ids = len(sched), [r for r, _ in sched]
        ib.num_computed_tokens_cpu[:len(sched)] = computed
        q = self.query_start_loc.np
        q[0] = 0
        np.cumsum([n for _, n in sched], out=q[1:len(sched) + 1])


def _new(rid, n, captured=True):
    return SimpleNamespace(req_id=rid, sampling_params=SimpleNamespace(extra_args={"return_routed_experts": captured}),
                           prompt_token_ids=list(range(n)), prompt_embeds=None, num_computed_tokens=0,
                           block_ids=([0],))


def _so(new, sched: list, finished=()):
    so = SimpleNamespace(scheduled_new_reqs=new, num_scheduled_tokens=dict(sched),
                         total_num_scheduled_tokens=sum(n for _, n in sched), finished_req_ids=set(finished),
                         preempted_req_ids=set(), scheduled_spec_decode_tokens={})
    setattr(so, scheduler_hooks.ATTR, {r: scheduler_hooks.Finished(1, "stop", [9]) for r in finished})
    return so


def _forward(cap, n: int, step: int) -> list:
    """Every MoE layer's router writes its top-k for the step's n tokens (as a graph replay does): distinct ids per
    step, layer and token. Returns the (n, L, K) rows as int lists."""
    ids = [(torch.arange(n * K, dtype=torch.int64).reshape(n, K) + 100 * layer + 10 * step) for layer in range(L)]
    for layer, t in enumerate(ids):
        cap.cache.record(layer, t)
    return torch.stack(ids, dim=1).tolist()


@pytest.mark.parametrize("path", ["general", "ring"])
def test_captured_steps_reach_the_producer_as_their_requests_rows_and_finishes_follow_them(path):
    """The general path (no step stamps: the -1 fill, a snapshot per step) and the step ring (the step by
    reference, its engine ids resolved on the producer's side) hand over the same rows."""
    runner, producer = Runner(), Producer()
    settings = Settings(broker="ipc://unused", step_stamp=path == "ring", ring_needs_kernels=False)
    cap = worker_capture(settings, layers=L, top_k=K, max_tokens=16, eager=False, device_type="cuda",
                         runner=runner, producer=producer)
    assert type(cap.path).__name__ == {"general": "StepPath", "ring": "RingPath"}[path]
    cap.stamp_baseline()                            # (as after vLLM's warm-up; no stamps: nothing)
    # step 1: a (3 prompt tokens, captured) and b (2, opted out) prefill
    sched = [("a", 3), ("b", 2)]
    cap.pre_step(_so([_new("a", 3), _new("b", 2, captured=False)], sched))
    rows1 = _forward(cap, 5, 1)
    runner.lay_out(sched, [0, 0])
    cap.post_step(_so([], sched))
    # step 2: both decode one token
    sched = [("a", 1), ("b", 1)]
    cap.pre_step(_so([], sched))
    rows2 = _forward(cap, 2, 2)
    runner.lay_out(sched, [3, 2])
    cap.post_step(_so([], sched))
    assert producer.calls == [] and len(cap.batch.parts) == 2       # batched: nothing handed over yet
    # step 3: a finishes (its note from the scheduler), b (not captured) decodes: no captured request runs, so
    # the batch goes before the forward, then a's finish; the step itself hands nothing over
    sched = [("b", 1)]
    cap.pre_step(_so([], sched, finished=["a"]))
    assert not cap.active and cap.requests.closing == {} and cap.batch.parts == []
    _forward(cap, 1, 3)
    runner.lay_out(sched, [3])
    cap.post_step(_so([], sched))
    cap.flush()
    assert producer.calls == [
        ("open", ["a"]),
        ("rows", [["a"], ["a"]], [[0], [3]], [[3], [1]], rows1[:3] + rows2[:1]),
        ("end", [("finish", "a", 1)]),
    ]
    st = cap.stats
    assert (st.steps, st.active_steps, st.opened, st.finished, cap.forwards) == (3, 2, 1, 1, 3)
    # rows handed over: the general path's are the captured requests' own, a ring step's the whole step's (the
    # producer's side leaves the rest out)
    assert (st.rows, st.ring_steps) == ((4, 0) if path == "general" else (7, 2))
    assert cap.tracked == {} and cap.requests.seen == {}
