"""The main job: vLLM with routing capture on a generated tiny MoE model, records to npz, checked by the oracle.

    routing-replay demo [--out ./out] [--requests 64] [--group-size 8] [--arch qwen3_moe] [--inprocess]
                        [--prefix-rows fill|sentinel]

--arch (ARCHS): qwen3_moe (the default; `make run`), qwen3_moe_mixed (dense layers mixed in), mixtral, two
DeepSeek-V3-style models (sigmoid scores, `e_score_correction_bias`, 4 expert groups of which 2 are kept, a dense
first layer): glm4_moe (GLM-4-MoE, grouped-query attention) and deepseek_v3 (DeepSeek-V3 itself, MLA attention),
and qwen2_moe, olmoe, gpt_oss, granitemoe, llama4. vLLM's CPU build turns prefix caching off for MLA models. Its
CPU rotary-embedding kernel (`_C.rotary_embedding`) rotates a 3-D (tokens, heads, dims) query wrongly when there
is more than one head, and MLA hands it one (`q[..., qk_nope_head_dim:]`), so on CPU the demo runs DeepSeek-V3
with vLLM's torch rotary embedding instead (`custom_ops: -rotary_embedding`, NATIVE_ROPE); with it vLLM's model
computes what transformers' does and the oracle applies as to the others. gpt_oss and llama4 have several KV
cache groups (sliding-window or chunked attention layers), for which the plugin cannot fill prefix-cached rows:
they stay -1 and the trainer's router chooses there.

1. Generates a random-weight MoE checkpoint (routing_replay.apps.models, peaked=True: peaked next-token
   distributions and distinct experts, so that a flipped expert shows in the log-probabilities; cached under
   the temp dir).
2. Starts vLLM (`LLM(...)`, vLLM's own process layout unless --inprocess) with ROUTING_REPLAY_BROKER=embedded
   and ROUTING_REPLAY_NPZ_DIR=OUT: broker and consumer run inside the engine, one npz file per request;
   ROUTING_REPLAY_PREFIX_ROWS=fill (--prefix-rows): prefix-cached prompt rows carry the routing that computed
   the cached KV (with `sentinel` they are -1).
3. Runs a GRPO-like workload: groups of --group-size samples of one prompt, prompts starting with one of a few
   long shared system prompts (so vLLM's prefix cache hits, in 128-token blocks on CPU), sampled outputs with
   the sampled token's log-probability (logprobs=0). Rounds with capture off (every request opted out) and on
   alternate; the prefix cache is reset before each round.
4. Waits for the records of the capture-on rounds, recomputes every routing decision with HF transformers
   (routing_replay.apps.oracle) and prints a summary. Exit status 1 if the oracle disagrees (near ties, within
   the oracle's stated tolerance, are reported apart and do not fail) or a record is missing or incomplete.
5. The trainer step (routing_replay.apps.r3), on the last capture-on round (one rollout batch): the same
   checkpoint in HF transformers in bfloat16 (the engine runs float32) computes the generated tokens'
   log-probabilities with its own routing and with the records replayed, and compares routing and
   log-probabilities with the engine's. Exit status 1 if replayed routing differs from the records on any
   recorded row.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

ARCHS = ("qwen3_moe", "qwen3_moe_mixed", "mixtral", "glm4_moe", "deepseek_v3", "qwen2_moe", "olmoe", "gpt_oss",
         "granitemoe", "llama4")
# architectures whose vLLM model passes a 3-D query view to the rotary embedding (MLA): on CPU they run vLLM's torch
# rotary embedding, because the CPU kernel rotates such a query wrongly when it has more than one head
NATIVE_ROPE = ("deepseek_v3",)


def _workload(n: int, prefixes: int, prefix_len: int, group_size: int, seed: int) -> list[list[int]]:
    """GRPO-like prompts: groups of `group_size` identical prompts (one question, n samples), each prompt a
    shared system prompt (one of `prefixes`, round robin over groups) followed by the group's question."""
    rnd = random.Random(seed)
    heads = [[rnd.randrange(256) for _ in range(prefix_len)] for _ in range(prefixes)]
    groups = -(-n // group_size)
    prompts = [heads[g % prefixes] + [rnd.randrange(256) for _ in range(rnd.randrange(16, 200))]
               for g in range(groups)]
    return [list(prompts[i // group_size]) for i in range(n)]


def _clear(out: Path) -> int:
    """Remove the npz files and shard index a previous demo left in OUT (nothing else)."""
    n = 0
    for p in list(out.glob("*.npz")) + list(out.glob("index.jsonl")):
        p.unlink()
        n += 1
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="routing-replay demo", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="./out", help="directory for the npz records (old *.npz there are removed)")
    ap.add_argument("--arch", default="qwen3_moe", choices=ARCHS,
                    help="model family (default qwen3_moe; glm4_moe and deepseek_v3 route DeepSeek-V3 style)")
    ap.add_argument("--requests", type=int, default=64, help="requests per round")
    ap.add_argument("--prefixes", type=int, default=4, help="distinct shared system prompts")
    ap.add_argument("--group-size", type=int, default=8, help="samples per prompt (GRPO group)")
    ap.add_argument("--prefix-len", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="capture off/on pairs")
    ap.add_argument("--inprocess", action="store_true", help="run vLLM's engine in this process")
    ap.add_argument("--prefix-rows", default="fill", choices=["fill", "sentinel"],
                    help="prefix-cached prompt rows: real routing from the prefix store (fill) or -1 (sentinel)")
    a = ap.parse_args(argv)
    if min(a.rounds, a.requests, a.prefixes, a.max_tokens, a.group_size) < 1:
        ap.error("--rounds, --requests, --prefixes, --group-size and --max-tokens must be at least 1")

    from routing_replay.apps.cli import directory_problem
    why = directory_problem(a.out)
    if why:
        print(f"routing-replay demo: --out: {why}", file=sys.stderr)
        return 2
    out = Path(a.out).resolve()
    removed = _clear(out)
    os.environ["ROUTING_REPLAY_BROKER"] = "embedded"
    os.environ["ROUTING_REPLAY_NPZ_DIR"] = str(out)
    os.environ["ROUTING_REPLAY_REQUESTS"] = "all"
    os.environ["ROUTING_REPLAY_PREFIX_ROWS"] = a.prefix_rows
    os.environ.pop("ROUTING_REPLAY_SERVE", None)

    import tempfile

    from routing_replay.apps.models import make_tiny_model

    t_start = time.monotonic()
    model = make_tiny_model(Path(tempfile.gettempdir()) / "routing-replay-models" / f"{a.arch}-float32-peaked",
                            a.arch, peaked=True)
    print(f"model: {model} ({a.arch}, float32, peaked){f'; removed {removed} old files from {out}' if removed else ''}",
          flush=True)

    import vllm
    from vllm import LLM, SamplingParams

    import routing_replay.engines.vllm_plugin as plugin

    plugin.register()
    engine_kw = dict(model=str(model), dtype="float32", enforce_eager=True, max_model_len=1024,
                     max_num_batched_tokens=1024, enable_prefix_caching=True, kv_cache_memory_bytes=512 << 20,
                     seed=0)
    from vllm.platforms import current_platform

    if a.arch in NATIVE_ROPE and current_platform.is_cpu():
        from routing_replay.engines.vllm_plugin.cpu_refusals import mla_settings, native_rope

        engine_kw.update(native_rope())
        # (MLA: on an AMX CPU vLLM's own choice, AMX_MLA, takes no float32 weights: cpu_refusals.amx_mla_refusal)
        engine_kw.update(mla_settings(engine_kw["dtype"]))
    if a.inprocess:
        from routing_replay.apps.vllm_harness import inprocess_llm
        llm = inprocess_llm(model, **{k: v for k, v in engine_kw.items() if k != "model"})
    else:
        llm = LLM(**engine_kw)
    block = llm.llm_engine.vllm_config.cache_config.block_size
    caching = llm.llm_engine.vllm_config.cache_config.enable_prefix_caching     # off for MLA on vLLM's CPU build
    prompts = [{"prompt_token_ids": p} for p in _workload(a.requests, a.prefixes, a.prefix_len, a.group_size, seed=0)]

    def round_(capture: bool):
        sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.8, ignore_eos=True, logprobs=0,
                            extra_args={"return_routed_experts": capture})
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        tokens = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
        return outs, tokens / dt, sum(len(o.outputs[0].token_ids) for o in outs) / dt

    round_(False)                                   # warm-up
    off, on, captured = [], [], []
    for i in range(a.rounds):
        for capture in ((False, True) if i % 2 == 0 else (True, False)):
            outs, tok_s, out_s = round_(capture)
            (on if capture else off).append((tok_s, out_s))
            if capture:
                captured += outs
            print(f"round {len(on) + len(off)}: capture {'on ' if capture else 'off'} {tok_s:8.0f} tok/s "
                  f"({out_s:.0f} output tok/s)", flush=True)

    from routing_replay.consumer import load_records
    from routing_replay.apps.oracle import NEAR_TIE_ULPS, verify
    from routing_replay.apps.vllm_harness import wait_records

    ids = [o.request_id for o in captured]
    missing_err = ""
    try:
        wait_records(out, ids, timeout_s=60)
    except TimeoutError as e:
        missing_err = str(e)
    if a.inprocess:
        from routing_replay.apps.vllm_harness import shutdown
        shutdown(llm)
    else:
        llm.llm_engine.engine_core.shutdown()
    recs = load_records(out)
    records = [recs[i] for i in ids if i in recs]
    verdict = verify(records, str(model))

    by_id = {o.request_id: o for o in captured}
    mismatched_tokens = [r.request_id for r in records
                         if r.output_token_ids is None
                         or r.output_token_ids.tolist() != list(by_id[r.request_id].outputs[0].token_ids)
                         or r.num_cached_tokens != by_id[r.request_id].num_cached_tokens]
    from routing_replay.apps.r3 import engine_logprobs, load_trainer, measure

    last_round = {o.request_id for o in captured[-a.requests:]}     # one rollout batch for one trainer step
    trainable = [r for r in records if r.complete and r.request_id not in mismatched_tokens
                 and r.request_id in last_round]
    r3 = measure(load_trainer(model, "bfloat16"), trainable,
                 {i: engine_logprobs(o) for i, o in by_id.items()}) if trainable else None
    complete = sum(r.complete for r in records)
    prompt_rows = sum(r.prompt_routed_experts.shape[0] for r in records)
    cached_rows = sum(r.num_cached_tokens for r in records)
    filled_rows = sum(r.num_prefix_filled for r in records)
    filled_missing = sum(min(hi, r.num_prefix_filled) - lo for r in records for lo, hi in r.missing
                         if lo < r.num_prefix_filled)
    output_rows = sum(r.routed_experts.shape[0] for r in records)
    off_tok = statistics.median(t for t, _ in off)
    on_tok = statistics.median(t for t, _ in on)
    r3_ok = r3 is not None and r3.replay_exact
    ok = verdict.ok and not missing_err and complete == len(ids) and not mismatched_tokens and r3_ok

    shape = f"{records[0].prompt_routed_experts.shape[1]} MoE layers, top-{records[0].prompt_routed_experts.shape[2]}" \
        if records else "no records"
    rows = [
        ("vLLM", f"{vllm.__version__}, {'in-process' if a.inprocess else 'multi-process'} engine, "
                 f"{a.arch} float32 ({shape})"),
        ("requests captured", f"{len(ids)} ({a.rounds} rounds x {a.requests}; groups of {a.group_size} samples "
                              f"per prompt; {a.prefixes} shared system prompts of {a.prefix_len} tokens)"),
        ("records", f"{len(records)} written, {complete} complete"),
        ("tokens", f"{prompt_rows:,} prompt + {output_rows:,} output"),
        ("prefix-cached rows", (f"{cached_rows:,} of {prompt_rows:,} prompt rows (block size {block}): "
                                + (f"{filled_rows - filled_missing:,} filled from the prefix store, "
                                   f"{filled_missing:,} not found"
                                   + (f", {cached_rows - filled_rows:,} are -1 (the plugin cannot fill them for "
                                      f"this model: its log says why)" if cached_rows > filled_rows else "")
                                   if a.prefix_rows == "fill" else
                                   f"{cached_rows:,} are -1 (--prefix-rows sentinel)")) if caching else
                               f"none: vLLM turned prefix caching off for this model ({prompt_rows:,} prompt rows "
                               f"computed)"),
        ("throughput, capture off", f"{off_tok:,.0f} tok/s (median of {len(off)})"),
        ("throughput, capture on", f"{on_tok:,.0f} tok/s ({100 * (on_tok / off_tok - 1):+.1f}%)"),
        ("oracle (HF transformers)", f"{'PASS' if verdict.ok else 'FAIL'}: {verdict.rows:,} (token, layer) rows, "
                                     f"{100 * verdict.agreement:.3f}% identical top-k sets, "
                                     f"{verdict.near_ties} near ties (within {NEAR_TIE_ULPS[verdict.dtype]} ulps of "
                                     f"the k-th selection score), {verdict.disagree} disagree, "
                                     f"{verdict.sentinel_errors} -1 misplacements"),
        *(r3.rows() if r3 is not None else []),
        ("npz", f"{out} ({len(recs)} files)"),
        ("wall time", f"{time.monotonic() - t_start:.0f} s"),
    ]
    w = max(len(k) for k, _ in rows)
    print()
    for k, v in rows:
        print(f"  {k:<{w}}  {v}")
    if missing_err:
        print(f"\nFAIL: {missing_err}")
    if mismatched_tokens:
        print(f"\nFAIL: records whose tokens or cached count differ from vLLM's outputs: {mismatched_tokens[:5]}")
    if not verdict.ok:
        print("\n" + verdict.summary())
    if not r3_ok:
        print("\nFAIL: replayed routing differs from the records on "
              f"{r3.replay.rows - r3.replay.same if r3 else 'all'} recorded rows")
    print(f"\n{'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
