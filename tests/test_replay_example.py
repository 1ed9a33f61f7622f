"""README's "Replaying in a trainer" example, run as written on a tiny generated Qwen3-MoE model (one dense layer)
with npz records built to match: the experts the model runs are the records' ids on every routed row, and the
replayed / fallback counts are exact."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from routing_replay.apps.models import make_config, moe_layer_ids
from routing_replay.consumer.npz import write_record
from routing_replay.protocol import wire
from routing_replay.replay import find_moe_blocks

E, TOPK = 8, 2
README = Path(__file__).resolve().parent.parent / "README.md"


def readme_example() -> str:
    section = README.read_text().split("## Replaying in a trainer", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def make_record(rid, P, G, L, seed, cached=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(P + G, L, E, generator=g).argsort(-1)[..., :TOPK].numpy().astype(np.int16)
    ids[:cached] = -1
    ids[P + G - 1] = -1                                       # the last output token is never fed
    return wire.Record(request_id=rid, prompt_routed_experts=ids[:P].copy(), routed_experts=ids[P:].copy(),
                       num_cached_tokens=cached, moe_layer_ids=np.asarray(L_IDS, np.int32), complete=True,
                       prompt_token_ids=np.arange(10 + seed, 10 + seed + P, dtype=np.int32),
                       output_token_ids=np.arange(100 + seed, 100 + seed + G, dtype=np.int32))


L_IDS: list = []


def test_readme_example_runs_and_replays_the_records(tmp_path, capsys):
    from transformers import AutoModelForCausalLM
    cfg = make_config("qwen3_moe_mixed", num_layers=3, num_experts=E, top_k=TOPK, hidden_size=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    L_IDS[:] = moe_layer_ids(cfg)
    assert L_IDS == [0, 2]
    recs = [make_record("cmpl-a", 3, 2, 2, seed=1), make_record("cmpl-b", 2, 4, 2, seed=2, cached=1)]
    for r in recs:
        write_record(tmp_path, r)

    seen = {}                                                 # MoE index -> ids handed to the experts
    blocks = find_moe_blocks(model)

    def keep(m):
        def hook(mod, args):
            seen.setdefault(m, args[1].clone())         # returns None: the arguments stay as they are
        return hook
    hooks = [blk.experts.register_forward_pre_hook(keep(m)) for m, (_, blk, _) in enumerate(blocks)]
    code = readme_example()
    assert code.count('"./records"') == 1
    ns = {"model": model, "request_ids": ["cmpl-b", "cmpl-a"]}
    exec(code.replace('"./records"', repr(str(tmp_path))), ns)
    for h in hooks:
        h.remove()

    # batch order b, a; S = 6; routed rows: b positions 1..4 (0 cached, 5 last), a positions 0..3 (4 last, 5 pad)
    assert ns["stats"].replayed_rows == [8, 8] and ns["stats"].fallback_rows == [4, 4] and ns["stats"].calls == [1, 1]
    assert capsys.readouterr().out == "[8, 8] [4, 4]\n"
    for m in range(2):
        got = seen[m].reshape(2, 6, TOPK)
        for b, (rec, rows) in enumerate(((recs[1], range(1, 5)), (recs[0], range(0, 4)))):
            want = np.concatenate([rec.prompt_routed_experts, rec.routed_experts])[list(rows), m]
            assert torch.equal(got[b, list(rows)], torch.from_numpy(want.astype(np.int64))), (m, b)
    grads = [blk.gate.weight.grad for _, blk, _ in blocks]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    assert torch.isfinite(ns["loss"])
