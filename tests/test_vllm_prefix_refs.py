"""Prefix references on real vLLM (CPU build, float32, ROUTING_REPLAY_PREFIX_ROWS=fill, embedded pipeline): a
GRPO-style batch (2 prompts sharing a 2-block system prompt, 4 samples of each) gives the same
records with references on (rows of blocks a captured request computed are named, not sent) and off (every hit's
rows gathered from the prefix store and sent), bit for bit, and both agree with the HF transformers oracle."""

from __future__ import annotations

import random

import numpy as np
import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
vllm = pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402

from tests.test_vllm_prefix_fill import BLOCK, Engine, _tokens  # noqa: E402


def test_grpo_batch_records_are_identical_with_references_on_and_off(tmp_path):
    eng = Engine("qwen3_moe_mixed", tmp_path)
    try:
        rnd = random.Random(11)
        system = _tokens(rnd, 2 * BLOCK)                     # the shared system prompt: two full blocks
        prompts = [system + _tokens(rnd, 150), system + _tokens(rnd, 170)]
        runs = {}
        for mode in ("on", "off"):
            assert eng.llm.reset_prefix_cache()
            if mode == "off":
                eng.cap.prefix.set_writers(None)
            assert (eng.cap.writers is not None) == (mode == "on")
            before = eng.cap.stats.prefix_ref_rows
            recs = {}
            for i, p in enumerate(prompts):     # one after the other: the second's samples hit the system blocks
                # a group of 4 samples as 4 greedy requests: the two runs must schedule and compute alike (vLLM's
                # CPU build has no per-request seed, and n > 1 needs sampling)
                out = eng.generate([p] * 4, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
                j = {o.request_id: j for j, o in enumerate(out)}
                for r, o, c in eng.check(out).values():     # complete, filled, exact against the oracle
                    recs[(i, j[o.request_id])] = r
            runs[mode] = (recs, eng.cap.stats.prefix_ref_rows - before)
        on, refs_on = runs["on"]
        off, refs_off = runs["off"]
        assert sorted(on) == sorted(off) == [(i, j) for i in range(2) for j in range(4)]
        for k in on:
            a, b = on[k], off[k]
            assert (a.num_cached_tokens, a.num_prefix_filled, a.complete) == \
                (b.num_cached_tokens, b.num_prefix_filled, b.complete), k
            np.testing.assert_array_equal(a.prompt_routed_experts, b.prompt_routed_experts)
            np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
            assert a.output_token_ids.tolist() == b.output_token_ids.tolist()
        # every hit was on a block a captured request of the batch computed: all of them went by reference
        cached = sum(r.num_cached_tokens for r in on.values())
        assert refs_off == 0 and refs_on == cached > 0
        assert cached >= 4 * 2 * BLOCK                      # at least the second prompt's samples' system blocks
    finally:
        eng.close()
