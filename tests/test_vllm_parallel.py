"""Tensor parallelism on the CPU build: two worker processes, only TP rank 0 binds and publishes, to an external
broker + consumer (`routing-replay` CLI over ipc://); `LLM(...)` in vLLM's default process layout, in a child
process so that no engine state of other tests leaks in. Records checked against the HF oracle. With
ROUTING_REPLAY_PREFIX_ROWS=fill the prompts share a 256-token head (two 128-token CPU blocks) and the first one
runs alone, so the others hit its blocks: rank 0's prefix store fills them, every row checked against the oracle.

(Pipeline parallelism is not tested: vLLM 0.32's CPU runner fails PP=2 with enforce_eager on its own,
`assert self.intermediate_tensors is not None` in sync_and_gather_intermediate_tensors.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("vllm")

SCRIPT = r"""
import json, random, sys
from vllm import LLM, SamplingParams
from routing_replay.apps.vllm_harness import tiny_model
m = tiny_model("qwen3_moe_mixed")
llm = LLM(model=str(m), dtype="float32", enforce_eager=True, max_model_len=512, kv_cache_memory_bytes=64 << 20,
          tensor_parallel_size=2, seed=0)
rnd = random.Random(3)
head = [rnd.randrange(256) for _ in range(256)] if sys.argv[1] == "fill" else []
ps = [{"prompt_token_ids": head + [rnd.randrange(256) for _ in range(rnd.randrange(20, 200))]} for _ in range(8)]
sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
outs = llm.generate(ps[:1], sp, use_tqdm=False) + llm.generate(ps[1:], sp, use_tqdm=False)
print("RESULT " + json.dumps({o.request_id: [list(o.prompt_token_ids), list(o.outputs[0].token_ids)] for o in outs}))
"""


@pytest.mark.parametrize("prefix_rows", ["sentinel", "fill"])
def test_tensor_parallel_rank0_publishes_exact_records(tmp_path, prefix_rows):
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs two CPU cores, one per TP worker")
    import json

    from routing_replay.apps.oracle import Oracle
    from routing_replay.apps.vllm_harness import tiny_model, wait_records

    fe, be, npz = f"ipc://{tmp_path}/fe", f"ipc://{tmp_path}/be", tmp_path / "npz"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ROUTING_REPLAY_") and k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    cli = [sys.executable, "-m", "routing_replay.apps.cli"]
    procs = [subprocess.Popen(cli + ["broker", "--frontend", fe, "--backend", be, "--log-level", "warning"], env=env),
             subprocess.Popen(cli + ["consume", "--connect", be, "--npz-dir", str(npz), "--no-progress",
                                     "--log-level", "warning"], env=env)]
    try:
        run = subprocess.run([sys.executable, "-c", SCRIPT, prefix_rows], capture_output=True, text=True, timeout=600,
                             env={**env, "ROUTING_REPLAY_BROKER": fe, "VLLM_CPU_OMP_THREADS_BIND": "0|1",
                                  "ROUTING_REPLAY_PREFIX_ROWS": prefix_rows})
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
        logs = run.stdout + run.stderr
        n_bound = logs.count("routing-replay: bound 3 MoE layers")
        assert n_bound == 1, f"{n_bound} workers bound; only TP rank 0 should"
        assert logs.count("routing-replay: prefix store ") == (1 if prefix_rows == "fill" else 0)
        line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))
        want = json.loads(line[len("RESULT "):])
        recs = wait_records(npz, want, timeout_s=60)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(30)
    assert len(recs) == 8                          # one producer (TP rank 0): no duplicates, no extra records
    oracle = Oracle(str(tiny_model("qwen3_moe_mixed")))
    cached = []
    for rid, (prompt, output) in want.items():
        r = recs[rid]
        assert r.complete and r.prompt_token_ids.tolist() == prompt and r.output_token_ids.tolist() == output
        cached.append(r.num_cached_tokens)
        if prefix_rows == "fill":
            assert r.num_prefix_filled == r.num_cached_tokens
        else:
            assert r.num_prefix_filled == 0
        v = oracle.check(r)
        assert v.ok and v.rows == (len(prompt) + 20 - 1 - r.num_cached_tokens + r.num_prefix_filled) * 3
    if prefix_rows == "fill":
        assert sorted(cached) == [0] + [256] * 7         # the first prompt computed the head, the others hit it
