"""Fetch bytes per trainer rank when each rank fetches only its slice, at the Qwen3-30B-A3B shape (48 MoE layers,
top-8, int16 rows: 768 bytes a token).

An embedded broker and consumer (`EmbeddedPipeline`, the trainer endpoint on real TCP sockets); a Producer
publishes N records of P prompt + G output tokens (with their token ids); then one TrainerClient per rank fetches
all of them, whole or sliced, and the bytes of every reply frame it received (`TrainerClient.reply_bytes`,
headers included) are reported per rank. Each sliced record is checked against the slice of the whole one.

    python bench/slice_fetch.py                          # 16 records x (1024 + 256) tokens
    python bench/slice_fetch.py --records 64 --json out.json

Splits: whole (every rank fetches everything, today's broadcast); pp4 (4 pipeline stages of 12 layers each,
`layers=`); pp4 x cp2 (each stage's 2 context-parallel ranks, `tokens=` halves); dp4 (4 data-parallel ranks, a
quarter of the samples each, whole records).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from routing_replay.apps.embedded import EmbeddedPipeline  # noqa: E402
from routing_replay.consumer import TrainerClient  # noqa: E402
from routing_replay.protocol import wire  # noqa: E402

L, K, E = 48, 8, 128


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    ids = [f"slice-{i}" for i in range(a.records)]
    P, G = a.prompt, a.output
    T = P + G
    with tempfile.TemporaryDirectory() as d, EmbeddedPipeline(os.path.join(d, "npz"), serve="tcp://127.0.0.1:*") \
            as pipe:
        with pipe.producer(num_layers=L, top_k=K) as p:
            for rid in ids:
                p.open(rid, prompt_len=P, prompt_token_ids=rng.integers(0, 150_000, P, dtype=np.int32))
                p.publish_rows([rid], [0], [T - 1], rng.integers(0, E, size=(T - 1, L, K), dtype=np.int16))
                p.finish(rid, num_output_tokens=G, output_token_ids=rng.integers(0, 150_000, G, dtype=np.int32))
            assert p.flush(60)
        assert pipe.wait_idle(120)

        headers: dict = {}

        def fetch(rids, layers=None, tokens=None) -> int:
            with TrainerClient(pipe.serve) as t:
                got = t.fetch(rids, timeout_s=120, layers=layers, tokens=tokens)
                sl = wire.make_slice(layers, tokens)
                for rid in rids:
                    assert got[rid].equals(wire.slice_record(whole[rid], sl)), rid
                headers[(layers, tokens, len(rids))] = sum(
                    len(wire.encode_record(got[r], pipe.consumer.consumer_id, 0)[0]) for r in rids)
                return t.reply_bytes

        with TrainerClient(pipe.serve) as t:
            whole = t.fetch(ids, timeout_s=120)
        stages = [(s * L // 4, (s + 1) * L // 4) for s in range(4)]
        halves = [(0, T // 2), (T // 2, T)]
        splits = {
            "whole": [fetch(ids)],
            "pp4": [fetch(ids, layers=st) for st in stages],
            "pp4 x cp2": [fetch(ids, layers=st, tokens=h) for st in stages for h in halves],
            "dp4": [fetch(ids[r::4]) for r in range(4)],
        }
    base = splits["whole"][0]
    print(f"{a.records} records x ({P} + {G}) tokens, {L} layers x top-{K} int16 ({L * K * 2} B a token): "
          f"whole fetch {base / 1e6:.2f} MB ({base / (a.records * T):.1f} B/token)")
    out = {"records": a.records, "prompt": P, "output": G, "layers": L, "top_k": K, "whole_bytes": base}
    for name, per_rank in splits.items():
        mean = sum(per_rank) / len(per_rank)
        print(f"{name:10s} ranks={len(per_rank):2d}  bytes/rank={mean / 1e6:8.3f} MB  ({mean / base:.3f} x whole)  "
              f"all ranks={sum(per_rank) / 1e6:8.2f} MB")
        out[name] = per_rank
    out["pp4_headers"] = [headers[(st, None, len(ids))] for st in stages]     # header frames of each stage's records
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
