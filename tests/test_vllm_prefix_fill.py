"""ROUTING_REPLAY_PREFIX_ROWS=fill on real vLLM (CPU build, float32): prefix-cached prompt rows carry the routing
that computed the cached KV, from the worker's PrefixStore, and every row of every record except the last output
token agrees with the HF transformers oracle (near ties aside, as everywhere).

One engine per model: Qwen3-MoE with dense layers mixed in (MoE layers 0, 2, 3) with a KV cache of 24 blocks of
128 tokens, so that workloads evict and refill blocks; Mixtral. Scenarios: a long shared prefix (hits spanning
several blocks), n > 1 samples of one prompt (siblings hit blocks computed in the same step), chunked prefill
of prompts longer than the budget with hits, eviction under the small cache, reset_prefix_cache between rounds,
a step whose routing was not recorded (its slots read as not found), a weight reload between rounds (stored
rows invalidated: hits on old blocks are flagged `prefix_not_found`, never stale).

And the engine as vLLM starts it by default on CPU (no enforce_eager: the model is compiled with torch.compile and
Inductor, which traces the routers' capture hooks into the compiled model; prefix caching is on by default).
"""

from __future__ import annotations

import os
import random

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
vllm = pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402

from routing_replay.apps.oracle import Oracle  # noqa: E402
from routing_replay.apps.vllm_harness import (inprocess_llm, shutdown, tiny_model, wait_records,  # noqa: E402
                                                worker_of)
from routing_replay.engines.vllm_plugin import capture_of, record_key  # noqa: E402

ENV = ("ROUTING_REPLAY_BROKER", "ROUTING_REPLAY_NPZ_DIR", "ROUTING_REPLAY_SERVE", "ROUTING_REPLAY_REQUESTS",
       "ROUTING_REPLAY_PREFIX_ROWS")
CHUNK = 256
BLOCK = 128
BLOCK_BYTES = BLOCK * 4 * 1 * 64 * 2 * 4      # tokens x attention layers x kv heads x head dim x (k, v) x fp32
NUM_BLOCKS = 24


def _env(npz, **more):
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ROUTING_REPLAY_BROKER="embedded", ROUTING_REPLAY_NPZ_DIR=str(npz), ROUTING_REPLAY_REQUESTS="all",
                      ROUTING_REPLAY_PREFIX_ROWS="fill", **more)
    os.environ.pop("ROUTING_REPLAY_SERVE", None)
    return saved


def _restore(saved):
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


class Engine:
    def __init__(self, arch, tmp, **kw):
        self.npz = tmp
        self.saved = _env(tmp)
        self.model = tiny_model(arch)
        kw.setdefault("enable_prefix_caching", True)
        self.llm = inprocess_llm(self.model, max_num_batched_tokens=CHUNK, max_num_seqs=32, max_model_len=1024,
                                 kv_cache_memory_bytes=NUM_BLOCKS * BLOCK_BYTES, **kw)
        self.cap = capture_of(worker_of(self.llm))
        self.oracle = Oracle(str(self.model))

    def close(self):
        shutdown(self.llm)
        _restore(self.saved)

    def generate(self, prompts, sp):
        return self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)

    def records(self, outputs):
        want = {}
        for o in outputs:
            for c in o.outputs:
                want[record_key(o.request_id, c.index, len(o.outputs))] = (o, c)
        recs = wait_records(self.npz, want)
        return {k: (recs[k], o, c) for k, (o, c) in want.items()}

    def check(self, outputs) -> dict:
        """Every record is complete, filled where vLLM reported hits, and exact on every row but the last."""
        out = self.records(outputs)
        L = len(self.oracle.layer_ids)
        for key, (r, o, c) in out.items():
            P, G = len(o.prompt_token_ids), len(c.token_ids)
            assert r.complete and r.reason == "" and r.missing == [], (key, r.reason, r.missing)
            if len(o.outputs) == 1:          # with n > 1 vLLM reports one sample's hits for the group
                assert r.num_cached_tokens == (o.num_cached_tokens or 0), (key, r.num_cached_tokens,
                                                                            o.num_cached_tokens)
            assert r.num_prefix_filled == r.num_cached_tokens
            assert r.output_token_ids.tolist() == list(c.token_ids)
            assert (r.prompt_routed_experts >= 0).all() and (r.routed_experts[:-1] >= 0).all()
            assert (r.routed_experts[-1] == -1).all()
            v = self.oracle.check(r)
            assert v.ok, (key, v.error, v.mismatches[:3], v.sentinel_errors[:3])
            assert v.rows == (P + G - 1) * L                 # prefix-cached rows compared too
        return out


def _tokens(rnd, n):
    return [rnd.randrange(256) for _ in range(n)]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    eng = Engine("qwen3_moe_mixed", tmp_path_factory.mktemp("npz"))
    assert eng.cap.layer_ids == [0, 2, 3]
    yield eng
    eng.close()


def test_store_is_sized_by_the_kv_cache(mixed):
    eng = mixed
    eng.check(eng.generate([_tokens(random.Random(0), 20)], SamplingParams(max_tokens=2, temperature=0)))
    st = eng.cap.store
    assert st is not None and st.num_slots == NUM_BLOCKS * BLOCK
    assert st.nbytes == (NUM_BLOCKS * BLOCK + 1) * 3 * 2 * 2     # (slots + spare) x MoE layers x top_k x int16
    # made when vLLM's warm-up started and written by the forward itself (the cache's flush)
    assert eng.cap.graphs_captured and eng.cap.cache._store[0] is st and eng.cap.cache.store_writes > 0
    assert eng.llm.llm_engine.vllm_config.cache_config.block_size == BLOCK


def test_long_shared_prefix_fills_every_hit(mixed):
    eng = mixed
    rnd = random.Random(1)
    prefix = _tokens(rnd, 520)                   # four full blocks
    eng.check(eng.generate([prefix + _tokens(rnd, 7)], SamplingParams(max_tokens=6, temperature=0)))
    before = eng.cap.stats.prefix_rows
    outs = eng.generate([prefix + _tokens(rnd, rnd.randrange(10, 60)) for _ in range(5)],
                        SamplingParams(max_tokens=12, temperature=0.8, ignore_eos=True))
    recs = eng.check(outs)
    assert sorted(r.num_prefix_filled for r, _, _ in recs.values()) == [512] * 5
    assert eng.cap.stats.prefix_rows - before == 5 * 512
    first = next(iter(recs.values()))[0].prompt_routed_experts[:512]
    for r, _, _ in recs.values():                # the same cached KV, the same rows
        assert (r.prompt_routed_experts[:512] == first).all()


def test_n_samples_of_one_prompt(mixed):
    eng = mixed
    rnd = random.Random(2)
    outs = eng.generate([_tokens(rnd, 300)], SamplingParams(n=4, max_tokens=10, temperature=1.0, ignore_eos=True))
    recs = eng.check(outs)
    assert len(recs) == 4
    filled = sorted(r.num_prefix_filled for r, _, _ in recs.values())
    assert filled[-1] == 256 and filled.count(256) >= 3, filled


def test_chunked_prefill_with_hits(mixed):
    eng = mixed
    rnd = random.Random(3)
    head = _tokens(rnd, 400)
    eng.check(eng.generate([head], SamplingParams(max_tokens=3, temperature=0)))
    outs = eng.generate([head + _tokens(rnd, 500), head + _tokens(rnd, 300)],
                        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    recs = eng.check(outs)
    assert sorted(r.num_prefix_filled for r, _, _ in recs.values()) == [384, 384]


def test_hits_after_evictions_are_exact(mixed):
    eng = mixed
    rnd = random.Random(4)
    prefix = _tokens(rnd, 260)
    for round_ in range(3):
        # 6 distinct 500-token prompts need 24 blocks: the cache evicts, blocks are refilled by other tokens
        eng.check(eng.generate([_tokens(rnd, 500) for _ in range(6)],
                               SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)))
        recs = eng.check(eng.generate([prefix + _tokens(rnd, 20) for _ in range(3)],
                                      SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)))
        assert all(r.num_prefix_filled in (0, 256) for r, _, _ in recs.values())
        assert any(r.num_prefix_filled == 256 for r, _, _ in recs.values()), round_


def test_reset_prefix_cache_between_rounds(mixed):
    eng = mixed
    rnd = random.Random(5)
    prompts = [_tokens(rnd, 300)] * 2
    eng.check(eng.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0)))
    assert eng.llm.reset_prefix_cache()
    recs = eng.check(eng.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0)))
    assert [r.num_cached_tokens for r, _, _ in recs.values()] == [0]
    recs = eng.check(eng.generate(prompts[1:], SamplingParams(max_tokens=4, temperature=0)))
    assert [r.num_prefix_filled for r, _, _ in recs.values()] == [256]


def test_step_without_recorded_routing_is_never_read_as_a_hit(mixed):
    """An opted-out request runs while one router's hook is gone: its KV slots get -1 in the store, and a
    captured request that hits its blocks is flagged instead of getting rows nobody recorded."""
    eng = mixed
    rnd = random.Random(6)
    prompt = _tokens(rnd, 270)
    router = eng.cap.binding.layers[1].router
    hook = router.capture_fn
    forgotten = eng.cap.stats.store_forgotten
    router.set_capture_fn(None)
    try:
        eng.generate([prompt], SamplingParams(max_tokens=1, temperature=0,
                                              extra_args={"return_routed_experts": False}))
    finally:
        router.set_capture_fn(hook)
    assert eng.cap.stats.store_forgotten - forgotten == 270
    outs = eng.generate([prompt + _tokens(rnd, 5)], SamplingParams(max_tokens=4, temperature=0))
    (r, o, c), = eng.records(outs).values()
    assert r.num_cached_tokens == 256 and r.num_prefix_filled == 256
    assert not r.complete and r.reason == "prefix_not_found" and r.missing == [(0, 256)]
    assert (r.prompt_routed_experts[:256] == -1).all() and (r.prompt_routed_experts[256:] >= 0).all()
    v = eng.oracle.check(r)
    assert v.ok and v.rows == (len(o.prompt_token_ids) - 256 + len(c.token_ids) - 1) * 3


def test_lost_last_layer_hook_does_not_spoil_later_steps(mixed):
    """The last MoE layer's hook is gone for one request (its slots are forgotten); once it is back, the next
    request's rows are stored and a third request that hits them gets every prefix row, exact."""
    eng = mixed
    rnd = random.Random(8)
    router = eng.cap.binding.layers[-1].router
    hook = router.capture_fn
    forgotten = eng.cap.stats.store_forgotten
    router.set_capture_fn(None)
    try:
        eng.generate([_tokens(rnd, 140)], SamplingParams(max_tokens=1, temperature=0,
                                                          extra_args={"return_routed_experts": False}))
    finally:
        router.set_capture_fn(hook)
    assert eng.cap.stats.store_forgotten - forgotten == 140
    prompt = _tokens(rnd, 260)
    eng.generate([prompt], SamplingParams(max_tokens=1, temperature=0, extra_args={"return_routed_experts": False}))
    assert eng.cap.stats.store_forgotten - forgotten == 140
    outs = eng.generate([prompt + _tokens(rnd, 5)], SamplingParams(max_tokens=4, temperature=0))
    (r, o, c), = eng.check(outs).values()
    assert r.num_cached_tokens == 256 and r.num_prefix_filled == 256 and r.complete


def test_weight_reload_invalidates_stored_rows(mixed):
    """Last in the module (vLLM 0.32's CPU reload changes the prepacked expert weights: no oracle after it)."""
    eng = mixed
    rnd = random.Random(7)
    prompt = _tokens(rnd, 280)
    eng.check(eng.generate([prompt], SamplingParams(max_tokens=3, temperature=0)))
    worker_of(eng.llm).reload_weights()
    assert eng.cap.store.invalidations == 1
    outs = eng.generate([prompt + _tokens(rnd, 4)], SamplingParams(max_tokens=3, temperature=0))
    (r, o, _), = eng.records(outs).values()
    assert r.num_cached_tokens == 256 and not r.complete and r.reason == "prefix_not_found"
    assert r.missing == [(0, 256)] and (r.prompt_routed_experts[:256] == -1).all()
    assert eng.llm.reset_prefix_cache()          # what an RL loop does after a weight update
    outs = eng.generate([prompt + _tokens(rnd, 4)] * 2, SamplingParams(max_tokens=3, temperature=0))
    recs = eng.records(outs)
    assert all(r.complete for r, _, _ in recs.values())
    assert sorted(r.num_prefix_filled for r, _, _ in recs.values()) in ([0, 256], [256, 256])


def test_mixtral_shared_prefix_and_n(tmp_path):
    eng = Engine("mixtral", tmp_path)
    try:
        rnd = random.Random(8)
        prefix = _tokens(rnd, 300)
        eng.check(eng.generate([prefix + _tokens(rnd, 3)], SamplingParams(max_tokens=4, temperature=0)))
        outs = eng.generate([prefix + _tokens(rnd, 30), prefix + _tokens(rnd, 200)],
                            SamplingParams(n=3, max_tokens=8, temperature=1.0, ignore_eos=True))
        recs = eng.check(outs)
        assert len(recs) == 6
        # every sample hits the 2 prefix blocks; siblings of the 503-token prompt also hit its third block
        assert {k: r.num_prefix_filled for k, (r, _, _) in recs.items()} == {
            "0_1": 256, "1_1": 256, "2_1": 256, "0_2": 256, "1_2": 384, "2_2": 384}
        # The runner's slot-mapping buffer is checked before a request opens with rows from the store and before
        # rows leave it, not every step: a request that hits after the buffer was replaced (here: the worker's
        # record of it no longer matches) drops the whole store first, and opens as in sentinel mode.
        store = eng.cap.store
        eng.cap.prefix._owner = object()
        outs = eng.generate([prefix + _tokens(rnd, 7)], SamplingParams(max_tokens=3, temperature=0))
        assert eng.cap.store is None and not eng.cap.fill and store.invalidations == 1
        (r, o, c), = eng.records(outs).values()
        assert (r.num_cached_tokens, r.num_prefix_filled, r.complete, r.reason, r.missing) == (256, 0, True, "", [])
        assert (r.prompt_routed_experts[:256] == -1).all() and (r.prompt_routed_experts[256:] >= 0).all()
        v = eng.oracle.check(r)
        assert v.ok and v.rows == (len(o.prompt_token_ids) - 256 + len(c.token_ids) - 1) * r.routed_experts.shape[1]
    finally:
        eng.close()


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """vLLM's default execution mode on CPU: no enforce_eager (torch.compile), prefix caching left at its default."""
    eng = Engine("qwen3_moe_mixed", tmp_path_factory.mktemp("npz"), enforce_eager=False, enable_prefix_caching=None)
    yield eng
    eng.close()


def test_compiled_engine_fills_every_hit(compiled):
    """Without enforce_eager vLLM's CPU build compiles the MoE block with the hooks in it; a flush traced before the
    store existed would never write it (every hit then read `prefix_not_found`). The worker writes the store after
    each forward instead: records complete and exact, prefix rows included."""
    eng = compiled
    vc = eng.llm.llm_engine.vllm_config
    assert not vc.model_config.enforce_eager and vc.cache_config.enable_prefix_caching
    assert int(vc.compilation_config.mode) != 0                    # CompilationMode.NONE: not compiled
    rnd = random.Random(11)
    prefix = _tokens(rnd, 520)
    eng.check(eng.generate([prefix + _tokens(rnd, 7)], SamplingParams(max_tokens=6, temperature=0)))
    # the hooks ran inside the compiled model, whose flush was traced without the store
    assert eng.cap.binding.gate and eng.cap.cache.traced and not eng.cap.cache.traced_store
    outs = eng.generate([prefix + _tokens(rnd, rnd.randrange(10, 60)) for _ in range(4)],
                        SamplingParams(max_tokens=10, temperature=0.8, ignore_eos=True))
    recs = eng.check(outs)
    assert sorted(r.num_prefix_filled for r, _, _ in recs.values()) == [512] * 4
    outs = eng.generate([_tokens(rnd, 300)], SamplingParams(n=3, max_tokens=8, temperature=1.0, ignore_eos=True))
    filled = sorted(r.num_prefix_filled for r, _, _ in eng.check(outs).values())
    assert filled[-1] == 256 and filled.count(256) >= 2, filled


def test_compiled_engine_reload_invalidates_then_fills(compiled):
    """A weight reload re-binds the hooks (the compiled model keeps the ones it traced) and invalidates the store;
    after reset_prefix_cache the next hits are filled again, from the new weights' forwards."""
    eng = compiled
    rnd = random.Random(12)
    prompt = _tokens(rnd, 280)
    eng.check(eng.generate([prompt], SamplingParams(max_tokens=3, temperature=0)))
    worker_of(eng.llm).reload_weights()
    assert eng.cap.store.invalidations == 1
    outs = eng.generate([prompt + _tokens(rnd, 4)], SamplingParams(max_tokens=3, temperature=0))
    (r, o, _), = eng.records(outs).values()
    assert r.num_cached_tokens == 256 and not r.complete and r.reason == "prefix_not_found"
    assert r.missing == [(0, 256)]
    assert eng.llm.reset_prefix_cache()
    outs = eng.generate([prompt + _tokens(rnd, 4)], SamplingParams(max_tokens=3, temperature=0))
    outs += eng.generate([prompt + _tokens(rnd, 5)], SamplingParams(max_tokens=3, temperature=0))
    recs = eng.records(outs)
    assert [(r.complete, r.num_prefix_filled) for r, _, _ in recs.values()] == [(True, 0), (True, 256)]
    first, second = (r.prompt_routed_experts for r, _, _ in recs.values())
    assert (second[:256] == first[:256]).all() and (second >= 0).all()
