"""Real vLLM (CPU build, in-process engine) with the plugin, embedded pipeline and npz output; every record is
checked against the HF transformers oracle: exact top-k sets in float32, -1 exactly at prefix-cached positions
and the last output token.

One engine for the whole module (Qwen3-MoE, float32, prefix caching with vLLM's CPU block size of 128 tokens,
chunked prefill with a 256-token budget). Scenarios: shared prefixes, prompts longer than the chunk budget,
many concurrent requests, n > 1, opt-out, aborts (running, mid-prefill, never scheduled), stop strings,
user-chosen request ids, rebuilt routers and weight reload (re-bind), and a lost hook (loud failure).
No sampling seeds: vLLM 0.32's CPU runner fails seeded sampling under chunked prefill ("CPU Generator does not
use offset", gpu_model_runner.py, discard_request_mask path).
"""

from __future__ import annotations

import copy
import os
import random

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
vllm = pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402

from routing_replay.apps.oracle import Oracle  # noqa: E402
from routing_replay.engines.vllm_plugin import capture_of, record_key  # noqa: E402
from routing_replay.engines.vllm_plugin.runners import batch_refs  # noqa: E402
from routing_replay.apps.vllm_harness import (inprocess_llm, shutdown, tiny_model, wait_records,  # noqa: E402
                                                worker_of)

ENV = ("ROUTING_REPLAY_BROKER", "ROUTING_REPLAY_NPZ_DIR", "ROUTING_REPLAY_SERVE", "ROUTING_REPLAY_REQUESTS")
CHUNK = 256


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    saved = {k: os.environ.get(k) for k in ENV}
    npz = tmp_path_factory.mktemp("npz")
    serve = f"ipc://{tmp_path_factory.mktemp('serve')}/trainer"
    os.environ.update(ROUTING_REPLAY_BROKER="embedded", ROUTING_REPLAY_NPZ_DIR=str(npz), ROUTING_REPLAY_REQUESTS="all",
                      ROUTING_REPLAY_SERVE=serve)
    model = tiny_model("qwen3_moe")
    llm = inprocess_llm(model, max_num_batched_tokens=CHUNK, enable_prefix_caching=True, max_num_seqs=64)
    cap = capture_of(worker_of(llm))
    assert cap is not None and cap.layer_ids == [0, 1, 2, 3]
    yield Engine(llm, npz, Oracle(str(model)), cap, serve)
    shutdown(llm)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


class Engine:
    def __init__(self, llm, npz, oracle, cap, serve):
        self.llm, self.npz, self.oracle, self.cap, self.serve = llm, npz, oracle, cap, serve

    def generate(self, prompts, sp):
        return self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)

    def records(self, ids):
        return wait_records(self.npz, ids)

    def check(self, outputs, *, cached=None) -> dict:
        """Every completion of `outputs` has a complete record that matches vLLM's tokens and the oracle."""
        want = {}
        for o in outputs:
            n = len(o.outputs)
            for c in o.outputs:
                want[record_key(o.request_id, c.index, n)] = (o, c)
        recs = self.records(want)
        L = len(self.oracle.layer_ids)
        for key, (o, c) in want.items():
            r = recs[key]
            P, G = len(o.prompt_token_ids), len(c.token_ids)
            assert r.complete and r.reason == "" and r.missing == [], (key, r.reason, r.missing)
            assert r.finish_reason == c.finish_reason, (key, r.finish_reason, c.finish_reason)
            assert r.prompt_routed_experts.shape == (P, L, 2) and r.routed_experts.shape == (G, L, 2)
            assert r.prompt_token_ids.tolist() == list(o.prompt_token_ids)
            assert r.output_token_ids.tolist() == list(c.token_ids)
            assert r.num_cached_tokens == o.num_cached_tokens, (key, r.num_cached_tokens, o.num_cached_tokens)
            if cached is not None:
                assert r.num_cached_tokens == cached
            v = self.oracle.check(r)
            assert v.ok, (key, v.error, v.mismatches[:3], v.sentinel_errors[:3])
            assert v.rows == (P + G - 1 - r.num_cached_tokens) * L
        return {k: recs[k] for k in want}


def _tokens(rnd, n):
    return [rnd.randrange(256) for _ in range(n)]


def test_block_size_is_128(eng):
    assert eng.llm.llm_engine.vllm_config.cache_config.block_size == 128


def test_shared_prefix_hits_are_minus_one(eng):
    rnd = random.Random(1)
    prefix = _tokens(rnd, 300)
    eng.check(eng.generate([prefix + _tokens(rnd, 5)], SamplingParams(max_tokens=8, temperature=0)))
    outs = eng.generate([prefix + _tokens(rnd, rnd.randrange(20, 60)) for _ in range(8)],
                        SamplingParams(max_tokens=24, temperature=0.8, ignore_eos=True))
    recs = eng.check(outs, cached=256)              # two full 128-token blocks of the 300-token prefix
    for r in recs.values():
        assert (r.prompt_routed_experts[:256] == -1).all() and (r.prompt_routed_experts[256:] >= 0).all()


def test_prompts_longer_than_the_chunk_budget(eng):
    rnd = random.Random(2)
    outs = eng.generate([_tokens(rnd, n) for n in (700, 3 * CHUNK, 2 * CHUNK + 1, 40)],
                        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    eng.check(outs)


def test_many_concurrent_requests(eng):
    rnd = random.Random(3)
    prompts = [_tokens(rnd, rnd.randrange(5, 200)) for _ in range(48)]
    sps = [SamplingParams(max_tokens=rnd.choice([1, 2, 7, 33, 64]), temperature=rnd.choice([0.0, 1.0]))
           for i in range(48)]
    st = eng.cap.stats
    h0, a0 = st.host_steps, st.active_steps
    outs = eng.llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    recs = eng.check(outs)
    # an eager CPU engine hands every captured step's router tensors over by reference (HostRows)
    assert st.host_steps - h0 == st.active_steps - a0 > 0
    one = [r for k, r in recs.items() if r.routed_experts.shape[0] == 1]
    assert one and all((r.routed_experts == -1).all() for r in one)      # max_tokens=1: never fed back


@pytest.mark.parametrize("direct", [True, False])
def test_the_runners_batch_read_directly_or_through_its_properties_gives_the_same_records(eng, direct):
    """An eager CPU step reads V1's InputBatch `_req_ids` and `req_id_to_index` itself where vLLM's `req_ids` and
    `num_reqs` hand out just those (batch_refs), else the two properties; under churn (requests of different
    lengths finishing, the batch condensed and reordered) both ways give every record exact."""
    rnd = random.Random(21)
    cap = eng.cap
    ib = worker_of(eng.llm).model_runner.input_batch
    assert batch_refs(ib) == (ib, True)            # vLLM 0.27-0.32: the properties hand out those two
    reader = cap.path.reader                        # (runners.V1BatchReader: what the step paths read)
    reader.ib_refs = (ib, direct)                   # (the same InputBatch: kept as it is, not checked again)
    lens = [rnd.randrange(3, 40) for _ in range(12)]
    h0 = cap.stats.host_steps
    try:
        outs = eng.generate([_tokens(rnd, rnd.randrange(10, 90)) for _ in lens],
                            [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lens])
        assert reader.ib_refs == (ib, direct)
    finally:
        reader.ib_refs = (None, False)
    eng.check(outs)
    assert cap.stats.host_steps - h0 >= max(lens)   # (a prefill step, then a decode step per token but the last)


@pytest.mark.parametrize("skip", [True, False])
def test_steps_of_the_running_batch_enter_the_plugin_once_with_the_same_records(eng, skip):
    """After an eager CPU step of the running batch (its router tensors handed over, HostPath), a step that opens,
    ends and preempts nothing skips pre_step: post_step does its work (_late_pre_step). Under churn (requests of
    different lengths finishing, so pre_step runs again at each finish; new requests joining mid-way) every record
    is exact either way; with the skip disarmed before every step (as if no step were of the running batch), none
    is skipped."""
    rnd = random.Random(22)
    cap = eng.cap
    st = cap.stats
    lens = [rnd.randrange(3, 40) for _ in range(10)]
    s0, p0 = st.steps, st.pre_skipped
    e = eng.llm.llm_engine
    prompts = [_tokens(rnd, rnd.randrange(10, 90)) for _ in lens]
    sps = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lens]
    for i, (p, sp) in enumerate(zip(prompts[:6], sps[:6])):
        e.add_request(f"once-{skip}-{i}", {"prompt_token_ids": p}, sp)
    outs, steps = {}, 0
    while e.has_unfinished_requests():
        if not skip:
            cap.host_next = False      # (the engine runs in this process: its next execute_model runs pre_step)
        for out in e.step():
            if out.finished:
                outs[out.request_id] = out
        steps += 1
        if steps == 5:                  # four more join while the first six decode
            for i, (p, sp) in enumerate(zip(prompts[6:], sps[6:]), 6):
                e.add_request(f"once-{skip}-{i}", {"prompt_token_ids": p}, sp)
    eng.check(list(outs.values()))
    assert len(outs) == 10
    skipped = st.pre_skipped - p0
    if skip:
        # decode steps that open or end nothing; at least the longest request's last steps alone
        assert skipped >= max(lens) - sorted(lens)[-2] - 1 and skipped < st.steps - s0, (skipped, st.steps - s0)
    else:
        assert skipped == 0


def test_trainer_fetches_from_the_embedded_consumer(eng):
    from routing_replay.consumer import TrainerClient
    rnd = random.Random(12)
    outs = eng.generate([_tokens(rnd, 50) for _ in range(3)], SamplingParams(max_tokens=9, temperature=0))
    ids = [o.request_id for o in outs]
    with TrainerClient(eng.serve) as client:
        fetched = client.fetch(ids, timeout_s=30)
        compact = client.fetch(ids, timeout_s=30, ids="compact")
    on_disk = eng.records(ids)
    for i in ids:
        assert fetched[i].equals(on_disk[i]) and fetched[i].complete
        # the plugin told its producer the model's expert count: uint8 rows on the wire and in the consumer
        assert compact[i].id_dtype.name == "uint8" and compact[i].widened().equals(fetched[i])


def test_n_greater_than_one_keys_each_sample(eng):
    rnd = random.Random(4)
    outs = eng.generate([_tokens(rnd, 30), _tokens(rnd, 50)],
                        SamplingParams(n=3, max_tokens=20, temperature=1.0, ignore_eos=True))
    recs = eng.check(outs)
    for o in outs:
        assert {f"{i}_{o.request_id}" for i in range(3)} <= recs.keys()
        assert o.request_id not in recs


def test_opted_out_requests_cost_no_copy_and_no_message(eng):
    rnd = random.Random(5)
    st, cop, prod = eng.cap.stats, eng.cap.copier.stats, eng.cap.producer.stats
    before = (st.opened, st.active_steps, cop.submitted_steps, prod.sent_msgs)
    prod_queued = eng.cap.producer.queued_msgs
    outs = eng.generate([_tokens(rnd, 40) for _ in range(3)],
                        SamplingParams(max_tokens=10, extra_args={"return_routed_experts": False}))
    assert eng.cap.producer.flush(10)
    after = (st.opened, st.active_steps, cop.submitted_steps, prod.sent_msgs)
    assert after[:3] == before[:3] and after[3] - before[3] <= prod_queued      # nothing new was sent
    mixed = eng.generate([_tokens(rnd, 40), _tokens(rnd, 40)],
                         [SamplingParams(max_tokens=10, extra_args={"return_routed_experts": False}),
                          SamplingParams(max_tokens=10)])
    eng.check(mixed[1:])
    later = eng.generate([_tokens(rnd, 20)], SamplingParams(max_tokens=3))
    # one producer, one broker, one consumer, records written in order: once this later record exists, a record
    # of any request that finished before it would exist too
    have = eng.records([later[0].request_id])
    assert not ({o.request_id for o in outs} | {mixed[0].request_id}) & have.keys()


def test_timing_counts_each_section_once_and_its_clocks_apart(eng):
    """Benchmarks read WorkerStats.host_ns per step: pre_step is timed on every step it runs in (all but the steps of
    the running batch after an eager CPU one, whose pre_step work post_step does: pre_skipped), post_step only on
    steps that publish rows (sentinel mode: nothing else to do), and the clocks' own cost is counted apart, inside
    it."""
    rnd = random.Random(13)
    st = eng.cap.stats
    eng.cap.timing = True
    try:
        def counters():
            return (st.steps, st.active_steps, st.rows, st.timed_sections, st.host_ns, st.clock_ns, st.host_wall_ns,
                    st.clock_wall_ns, st.pre_skipped)

        c0 = counters()
        eng.generate([_tokens(rnd, 40)], SamplingParams(max_tokens=10, extra_args={"return_routed_experts": False}))
        c1 = counters()
        out = eng.generate([_tokens(rnd, 40)], SamplingParams(max_tokens=10, ignore_eos=True))
        c2 = counters()
    finally:
        eng.cap.timing = False
    eng.check(out)
    d_out = [b - a for a, b in zip(c0, c1)]
    d_on = [b - a for a, b in zip(c1, c2)]
    steps, active, rows, sections, host, clock, wall, clock_wall, skipped = d_out
    assert steps >= 10 and (active, rows, skipped) == (0, 0, 0) and sections == steps      # opted out: pre_step only
    assert 0 < clock < host and 0 < clock_wall < wall
    steps, active, rows, sections, host, clock, wall, clock_wall, skipped = d_on
    # one prefill + 9 decode steps; the 9 decode steps' pre_step work ran in their post_step (no section of its own)
    assert (active, rows, skipped) == (10, 40 + 9, 9) and sections == steps + active - skipped
    assert 0 < clock < host and 0 < clock_wall < wall


def test_user_request_ids_and_aborts(eng):
    rnd = random.Random(6)
    eng_ = eng.llm.llm_engine
    seen = {}

    def step_until(done, limit=200):
        for _ in range(limit):
            if done():
                return
            for out in eng_.step():
                seen[out.request_id] = out
        raise AssertionError("engine did not get there")

    # aborted mid-prefill: one step computes the first CHUNK prompt tokens of 700
    eng_.add_request("abort-prefill", {"prompt_token_ids": _tokens(rnd, 700)}, SamplingParams(max_tokens=5))
    eng_.step()
    eng_.abort_request(["abort-prefill"])
    step_until(lambda: not eng_.has_unfinished_requests())
    # aborted while generating; never scheduled; and a normal request under a user-chosen id
    eng_.add_request("user id/with spaces", {"prompt_token_ids": _tokens(rnd, 30)},
                     SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    eng_.add_request("abort-running", {"prompt_token_ids": _tokens(rnd, 30)},
                     SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
    eng_.add_request("abort-waiting", {"prompt_token_ids": _tokens(rnd, 10)}, SamplingParams(max_tokens=5))
    eng_.abort_request(["abort-waiting"])
    step_until(lambda: "abort-running" in seen and len(seen["abort-running"].outputs[0].token_ids) >= 6)
    eng_.abort_request(["abort-running"])
    step_until(lambda: not eng_.has_unfinished_requests())
    # the user's id is the record key
    recs = eng.records(["user id/with spaces", "abort-running", "abort-prefill"])
    r = recs["user id/with spaces"]
    assert r.complete and r.finish_reason == "length" and eng.oracle.check(r).ok
    # aborted after it produced tokens: a complete record of what was computed, finish_reason "abort"
    r = recs["abort-running"]
    n_front = len(seen["abort-running"].outputs[0].token_ids)
    assert r.complete and r.finish_reason == "abort" and r.routed_experts.shape[0] >= n_front >= 6
    assert r.output_token_ids[:n_front].tolist() == list(seen["abort-running"].outputs[0].token_ids)
    v = eng.oracle.check(r)
    assert v.ok and v.rows == (30 + r.routed_experts.shape[0] - 1) * 4
    # aborted mid-prefill: incomplete, with the uncomputed prompt positions declared missing
    r = recs["abort-prefill"]
    assert not r.complete and r.reason == "abort" and r.finish_reason == "abort"
    assert r.routed_experts.shape[0] == 0 and r.missing and r.missing[-1][1] == 700
    computed = r.missing[0][0]
    assert computed == CHUNK and r.missing == [(CHUNK, 700)]
    assert (r.prompt_routed_experts[:computed] >= 0).all() and (r.prompt_routed_experts[computed:] == -1).all()
    v = eng.oracle.check(r, output_token_ids=[])
    assert v.ok and v.rows == computed * 4
    # never scheduled: nothing was announced, no record (the records above finished after it was aborted)
    assert "abort-waiting" not in recs


def test_stop_string_finish(eng):
    """A stop string ends the request in the front end, which then aborts it in the engine: the record carries
    every token the engine produced (a prefix of it is what the user got) and is exact."""
    rnd = random.Random(8)
    for attempt in range(20):
        prompt = _tokens(rnd, 25)
        free = eng.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0].outputs[0]
        text = free.text
        cut = next((i for i in range(2, len(text)) if text[i].isalnum() and text[i] not in text[:i]), None)
        if cut is not None:
            break
    else:
        pytest.skip("no greedy output with a usable stop character")
    out = eng.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                stop=[text[cut]]))[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and len(c.token_ids) < len(free.token_ids)
    r = eng.records([out.request_id])[out.request_id]
    assert r.complete and r.finish_reason == "abort"
    G = r.routed_experts.shape[0]
    assert G >= len(c.token_ids) and r.output_token_ids.tolist() == list(free.token_ids[:G])
    assert eng.oracle.check(r).ok


def test_a_capturer_installed_after_ours_is_chained_not_lost(eng):
    """vLLM's own routed-experts capturer is installed after load_model with set_capture_fn, replacing our hook;
    the plugin re-binds after Worker.initialize_from_config: ours records, theirs still gets every call."""
    from routing_replay.engines.vllm_plugin.plugin import rebind_if_replaced

    seen = []

    def theirs(topk_ids):
        seen.append(int(topk_ids.shape[0]))

    for layer in eng.cap.binding.layers:
        layer.router.set_capture_fn(theirs)
    assert not eng.cap.binding.bound()
    rebinds = eng.cap.stats.rebinds
    rebind_if_replaced(worker_of(eng.llm))
    assert eng.cap.binding.bound() and eng.cap.stats.rebinds == rebinds + 1
    rebind_if_replaced(worker_of(eng.llm))                  # nothing replaced: nothing to do
    assert eng.cap.stats.rebinds == rebinds + 1
    try:
        outs = eng.generate([_tokens(random.Random(11), 50)], SamplingParams(max_tokens=5, temperature=0))
        eng.check(outs)
        assert len(seen) >= 4 * 5 and seen[:4] == [50] * 4           # every layer, every step, after ours
    finally:                                                   # ours alone again for the tests after this one
        for layer in eng.cap.binding.layers:
            layer.router.set_capture_fn(None)
        eng.cap.binding.bind()


def test_rebuilt_router_is_rebound_and_routing_stays_exact(eng):
    """A weight reload may rebuild layers: the hooks are found again and routing stays exact."""
    module = eng.cap.binding.layers[1].module
    rebuilt = copy.copy(module.router)
    rebuilt.capture_fn = None
    module.router = rebuilt
    assert not eng.cap.binding.bound()
    eng.cap.rebind("test")
    assert eng.cap.binding.bound() and eng.cap.binding.layers[1].router is rebuilt
    rnd = random.Random(9)
    eng.check(eng.generate([_tokens(rnd, 60)], SamplingParams(max_tokens=10, temperature=0)))


def test_reload_weights_rebinds(eng):
    """Worker.reload_weights re-binds. Not compared with the oracle: vLLM 0.32's in-place reload on CPU leaves
    the prepacked expert weights different from the checkpoint (greedy outputs change after a reload)."""
    rebinds = eng.cap.stats.rebinds
    worker_of(eng.llm).reload_weights()
    assert eng.cap.stats.rebinds == rebinds + 1 and eng.cap.binding.bound()
    out = eng.generate([_tokens(random.Random(10), 40)], SamplingParams(max_tokens=6, temperature=0))[0]
    r = eng.records([out.request_id])[out.request_id]
    assert r.complete and r.output_token_ids.tolist() == list(out.outputs[0].token_ids)
    assert (r.prompt_routed_experts >= 0).all() and (r.routed_experts[:-1] >= 0).all()


def test_lost_hook_fails_loudly(eng):
    """Last in the module: the engine does not survive it."""
    eng.cap.binding.layers[2].router.set_capture_fn(None)
    with pytest.raises(Exception, match="2 of|3 of 4 MoE layers recorded"):
        eng.generate([_tokens(random.Random(10), 20)], SamplingParams(max_tokens=3))
