"""HF adapter tests on tiny random MoE checkpoints: captured rows equal the routers' own top-k, bit for bit,
through a fake sink and end to end through the real Producer and a ZeroMQ ROUTER socket."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from routing_replay.engines.hf_adapter import HFRoutingAdapter, find_moe_routers
from routing_replay.apps.models import make_tiny_model, moe_layer_ids

ARCHS = ("qwen3_moe", "qwen3_moe_mixed", "mixtral")
PROMPTS = [[3, 17, 250, 99, 4, 61], [200, 5, 5, 18, 77, 140], [1, 2, 3, 4, 5, 6]]


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    out = {}
    for arch in ARCHS:
        path = make_tiny_model(tmp_path_factory.mktemp(arch), arch)
        out[arch] = AutoModelForCausalLM.from_pretrained(path).eval()
    return out


class CollectSink:
    """Record what a Producer would be given; consume deferred rows the way its thread does."""

    def __init__(self, hold: bool = False):
        self.opens: dict = {}
        self.deltas: list = []
        self.finishes: dict = {}
        self.hold = hold
        self.held: list = []

    def open(self, rid, *, prompt_len, num_cached_tokens=0, prompt_token_ids=None):
        self.opens[rid] = (prompt_len, num_cached_tokens, list(prompt_token_ids))

    def publish_rows(self, ids, starts, counts, rows):
        if self.hold:
            self.held.append((list(ids), list(starts), list(counts), rows))
            return True
        arr = rows.result().copy()
        rows.release()
        self.deltas.append((list(ids), list(starts), list(counts), arr))
        return True

    def finish(self, rid, *, num_output_tokens, finish_reason, prompt_len, num_cached_tokens, output_token_ids):
        self.finishes[rid] = (num_output_tokens, finish_reason, list(output_token_ids))

    def rows_by_request(self) -> dict:
        return assemble(self.deltas)


def assemble(deltas) -> dict:
    """request id -> {position: (L, K) row}, checking that no position arrives twice."""
    got: dict = {}
    for ids, starts, counts, arr in deltas:
        off = 0
        for rid, s, c in zip(ids, starts, counts):
            for j in range(c):
                assert s + j not in got.setdefault(rid, {}), (rid, s + j)
                got[rid][s + j] = arr[off + j]
            off += c
    return got


def reference(model, prompts, max_new_tokens, eos_token_id=None):
    """Hook-free greedy replay of the same forward calls with output_router_logits=True; the reference top-k
    is recomputed from each router's logits. Returns (outputs, {request index: {position: (L, K) row}})."""
    B = len(prompts)
    feed = torch.tensor(prompts, device=next(model.parameters()).device)
    past, pos = None, 0
    outputs = [[] for _ in range(B)]
    running = list(range(B))
    rows: dict = {b: {} for b in range(B)}
    with torch.inference_mode():
        while running:
            out = model(input_ids=feed, past_key_values=past, use_cache=True, logits_to_keep=1,
                        output_router_logits=True)
            past = out.past_key_values
            S = feed.shape[1]
            K = model.config.num_experts_per_tok
            topk = [torch.topk(torch.softmax(lg.float(), dim=-1), K, dim=-1).indices for lg in out.router_logits]
            step = torch.stack(topk, dim=1).to(torch.int16).cpu().numpy()     # (B*S, L, K)
            nxt = out.logits[:, -1].argmax(-1)
            tokens = nxt.tolist()
            still = []
            for b in running:
                for j in range(S):
                    rows[b][pos + j] = step[b * S + j]
                outputs[b].append(tokens[b])
                if outputs[b][-1] != eos_token_id and len(outputs[b]) < max_new_tokens:
                    still.append(b)
            running = still
            pos += S
            feed = nxt[:, None]
    return outputs, rows


def _check_rows(got: dict, rids, ref_rows: dict, P: int, outputs):
    for b, rid in enumerate(rids):
        G = len(outputs[b])
        assert sorted(got[rid]) == list(range(P + G - 1))          # the last output token has no row
        for p in range(P + G - 1):
            assert np.array_equal(got[rid][p], ref_rows[b][p]), (rid, p)


@pytest.mark.parametrize("arch", ARCHS)
def test_routers_found_at_the_moe_layer_ids(models, arch):
    model = models[arch]
    assert [i for i, _, _ in find_moe_routers(model)] == moe_layer_ids(model.config)
    with HFRoutingAdapter(model, max_tokens=64) as ad:
        assert ad.moe_layer_ids == moe_layer_ids(model.config)
        assert (ad.num_layers, ad.top_k) == (len(moe_layer_ids(model.config)), 2)
    if arch == "qwen3_moe_mixed":
        assert moe_layer_ids(model.config) == [0, 2, 3]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("fused", [True, False])
def test_generate_rows_equal_router_topk(models, arch, batch, fused):
    model = models[arch]
    prompts = PROMPTS[:batch]
    rids = [f"{arch}-{i}" for i in range(batch)]
    sink = CollectSink()
    with HFRoutingAdapter(model, sink, max_tokens=32, fused=fused) as ad:
        outputs = ad.generate(prompts, request_ids=rids, max_new_tokens=5)
    ref_out, ref_rows = reference(model, prompts, 5)
    assert outputs == ref_out
    _check_rows(sink.rows_by_request(), rids, ref_rows, len(prompts[0]), outputs)
    # one delta per step: prefill then 4 decode steps, requests in order
    assert [d[2] for d in sink.deltas] == [[6] * batch] + [[1] * batch] * 4
    assert [d[1] for d in sink.deltas] == [[0] * batch] + [[6 + j] * batch for j in range(4)]
    for b, rid in enumerate(rids):
        assert sink.opens[rid] == (6, 0, prompts[b])
        assert sink.finishes[rid] == (5, "length", outputs[b])


# Routers not called `mlp.gate`, or whose output does not hold the ids at position 2: Granite-MoE returns
# (ids, weights, logits) from `block_sparse_moe.router`, Llama-4 (top-1) dense (N, E) scores and the logits from
# `feed_forward.router`, Phi-MoE and GPT-OSS (logits, weights, ids) from `mlp.router`. Each selects the top-k of its
# logits in eval mode (Phi-MoE's sparsemixer: the argmax, then the argmax of the rest), so the reference's top-k of
# softmax(router_logits) is each router's own selection, in its order.
OTHER_ARCHS = ("granitemoe", "llama4", "phimoe", "gpt_oss")


@pytest.fixture(scope="module")
def other_models(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    return {arch: AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path_factory.mktemp(arch), arch)).eval()
            for arch in OTHER_ARCHS}


@pytest.mark.parametrize("arch", OTHER_ARCHS)
def test_other_router_layouts_capture_the_routers_own_selection(other_models, arch):
    model = other_models[arch]
    K = model.config.num_experts_per_tok
    routers = find_moe_routers(model)
    assert [i for i, _, _ in routers] == moe_layer_ids(model.config) == [0, 1, 2, 3]
    # the router's own output, read without the adapter: the ids it returns, or (Llama-4) its nonzero scores
    own: dict = {}

    def hook(i):
        def read(_m, _a, out):
            ids = out[0] if arch == "granitemoe" else out[2] if arch != "llama4" else out[0].ne(0).nonzero()[:, 1:]
            own.setdefault(i, []).append(ids.reshape(-1, K).to(torch.int16).clone())
        return read
    handles = [router.register_forward_hook(hook(i)) for i, (_, router, _) in enumerate(routers)]
    prompts = PROMPTS[:2]
    sink = CollectSink()
    try:
        with HFRoutingAdapter(model, sink, max_tokens=32) as ad:
            assert (ad.num_layers, ad.top_k) == (4, K)
            outputs = ad.generate(prompts, request_ids=["a", "b"], max_new_tokens=5)
    finally:
        for h in handles:
            h.remove()
    got = sink.rows_by_request()
    # the router's own ids, per forward call (prefill, then 4 decode steps), reassembled per request and position
    calls = [torch.stack([own[i][c] for i in range(4)], dim=1).numpy() for c in range(5)]
    for b, rid in enumerate(["a", "b"]):
        assert sorted(got[rid]) == list(range(6 + 4))
        for p in range(6 + 4):
            c, j, S = (0, p, 6) if p < 6 else (p - 5, 0, 1)
            assert np.array_equal(got[rid][p], calls[c][b * S + j]), (rid, p)
    ref_out, ref_rows = reference(model, prompts, 5)
    assert outputs == ref_out
    _check_rows(got, ["a", "b"], ref_rows, 6, outputs)


def test_generate_stops_requests_at_eos_and_publishes_only_running_ones(models):
    model = models["qwen3_moe"]
    free_run, _ = reference(model, PROMPTS, 6)
    eos = free_run[1][1]                     # request 1 stops after its 2nd token; others when they emit it
    ref_out, ref_rows = reference(model, PROMPTS, 6, eos_token_id=eos)
    lengths = [len(o) for o in ref_out]
    assert lengths[1] == 2 and max(lengths) > 2      # the batch runs on after request 1 stopped
    sink = CollectSink()
    rids = ["a", "b", "c"]
    with HFRoutingAdapter(model, sink, max_tokens=32) as ad:
        outputs = ad.generate(PROMPTS, request_ids=rids, max_new_tokens=6, eos_token_id=eos)
    assert outputs == ref_out
    _check_rows(sink.rows_by_request(), rids, ref_rows, 6, outputs)
    assert sink.finishes["b"] == (2, "stop", outputs[1])
    for step, (ids, _, _, _) in enumerate(sink.deltas):
        assert ids == [rid for b, rid in enumerate(rids) if lengths[b] > step]


def test_full_ring_drops_steps_instead_of_blocking(models):
    """A sink that never consumes: once the host ring is full, steps come back dropped, counted, not waited for."""
    model = models["mixtral"]
    sink = CollectSink(hold=True)
    with HFRoutingAdapter(model, sink, max_tokens=12, num_slots=1) as ad:      # ring of 24 rows
        ad.generate(PROMPTS[:2], request_ids=["x", "y"], max_new_tokens=8)
        stats = ad.copier.stats
    # 8 forwards: prefill (12 rows), then 2 rows per decode step; 12 + 6*2 = 24 fill the ring, the 7th decode
    # step finds it full
    assert [h[3].dropped for h in sink.held] == [False] * 7 + [True]
    assert (stats.submitted_steps, stats.dropped_steps, stats.dropped_rows) == (7, 1, 2)
    _, ref_rows = reference(model, PROMPTS[:2], 8)
    for ids, starts, counts, pending in sink.held[:7]:
        want = [ref_rows[b][starts[b] + j] for b in range(2) for j in range(counts[b])]
        assert np.array_equal(pending.result(), np.stack(want))
        pending.release()
    assert ad.copier.in_flight_rows == 0


def test_close_removes_the_hooks(models):
    model = models["qwen3_moe"]
    ad = HFRoutingAdapter(model, CollectSink(), max_tokens=16)
    ad.close()
    ad.close()
    with torch.inference_mode():
        model(input_ids=torch.tensor([PROMPTS[0]]))
    assert (ad.cache.buffer == -1).all()
    with pytest.raises(RuntimeError, match="closed"):
        ad.generate([PROMPTS[0]], request_ids=["z"], max_new_tokens=1)


def test_generate_rejects_bad_batches(models):
    with HFRoutingAdapter(models["qwen3_moe"], CollectSink(), max_tokens=8) as ad:
        with pytest.raises(ValueError, match="equal length"):
            ad.generate([[1, 2], [3]], request_ids=["a", "b"], max_new_tokens=2)
        with pytest.raises(ValueError, match="max_tokens=8"):
            ad.generate([[1, 2, 3], [4, 5, 6], [7, 8, 9]], request_ids=["a", "b", "c"], max_new_tokens=2)
        with pytest.raises(ValueError, match="2 prompts, 1 request ids"):
            ad.generate([[1], [2]], request_ids=["a"], max_new_tokens=2)


# ---- end to end through the real Producer ----------------------------------------------------------------------


def _recv_all(sock, rids, deadline_s=20.0):
    """Receive until every request's finish arrived; return decoded opens, deltas and finishes."""
    import zmq

    from routing_replay.protocol import wire
    opens, deltas, finishes = {}, [], {}
    deadline = time.monotonic() + deadline_s
    while set(finishes) != set(rids):
        left_ms = int((deadline - time.monotonic()) * 1000)
        assert left_ms > 0, f"finishes for {sorted(finishes)} of {sorted(rids)} by the deadline"
        if not sock.poll(left_ms, zmq.POLLIN):
            continue
        frames = sock.recv_multipart()
        h = wire.decode_header(frames[1])
        if h.kind == "open":
            opens[h.key] = (wire.parse_open(h), frames[2:])
        elif h.kind == "delta":
            d = wire.parse_delta(h)
            wire.check_payload(d, frames[2:])
            arr = np.frombuffer(b"".join(frames[2:]), dtype=wire.ROW_DTYPE).reshape(-1, d.layer_hi - d.layer_lo,
                                                                                   d.top_k)
            deltas.append((d.request_ids, list(d.starts), list(d.counts), arr))
        elif h.kind == "finish":
            finishes[h.key] = (wire.parse_finish(h), frames[2:])
    return opens, deltas, finishes


@pytest.fixture
def router(tmp_path):
    zmq = pytest.importorskip("zmq")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    endpoint = f"ipc://{tmp_path}/broker.sock"
    sock.bind(endpoint)
    yield endpoint, sock, ctx
    sock.close(linger=0)
    ctx.term()


def test_end_to_end_through_producer_mixed_layers(models, router):
    from routing_replay.producer import Producer
    from routing_replay.protocol import wire
    endpoint, sock, ctx = router
    model = models["qwen3_moe_mixed"]
    rids = ["r0", "r1", "r2"]
    with HFRoutingAdapter(model, max_tokens=32) as ad:
        prod = Producer(endpoint, num_layers=ad.num_layers, top_k=ad.top_k, moe_layer_ids=ad.moe_layer_ids,
                        context=ctx, linger_ms=0)
        try:
            outputs = ad.generate(PROMPTS, request_ids=rids, max_new_tokens=4, sink=prod)
            opens, deltas, finishes = _recv_all(sock, rids)
            assert prod.flush(5.0) and prod.stats.dropped_msgs == 0
        finally:
            prod.close()
        assert ad.copier.in_flight_rows == 0                 # every ring range came back
    ref_out, ref_rows = reference(model, PROMPTS, 4)
    assert outputs == ref_out
    _check_rows(assemble(deltas), rids, ref_rows, 6, outputs)
    for b, rid in enumerate(rids):
        o, frames = opens[rid]
        assert (o.prompt_len, o.num_cached, o.num_layers, o.top_k, o.layer_ids) == (6, 0, 3, 2, [0, 2, 3])
        assert wire.tokens_from_frame(frames[0], 6, "prompt").tolist() == PROMPTS[b]
        f, frames = finishes[rid]
        assert (f.num_output, f.reason, f.lost) == (4, "length", [])
        assert wire.tokens_from_frame(frames[0], 4, "output").tolist() == outputs[b]


def test_dropped_step_is_reported_lost_in_finish(models, router):
    """A step the full host ring dropped reaches the consumer as lost positions, never as wrong rows."""
    from routing_replay.producer import Producer
    endpoint, sock, ctx = router
    model = models["qwen3_moe"]
    hold = CollectSink(hold=True)
    with HFRoutingAdapter(model, max_tokens=6, num_slots=1) as ad:            # ring of 12 rows
        prod = Producer(endpoint, num_layers=ad.num_layers, top_k=ad.top_k, context=ctx, linger_ms=0)
        try:
            ad.generate([PROMPTS[0]], request_ids=["held"], max_new_tokens=2, sink=hold)   # rows 0..6 held
            ad.generate([PROMPTS[1]], request_ids=["full"], max_new_tokens=3, sink=prod)   # prefill: dropped
            opens, deltas, finishes = _recv_all(sock, ["full"])
            assert prod.stats.dropped_msgs == 1 and prod.stats.dropped_rows == 6
        finally:
            prod.close()
    f, _ = finishes["full"]
    assert f.lost == [(0, 6)] and f.num_output == 3
    # the two decode steps, whether they left as two deltas or as one (the producer coalesces queued steps)
    assert [(r, int(s), int(c)) for d in deltas for r, s, c in zip(d[0], d[1], d[2])] == [("full", 6, 1),
                                                                                         ("full", 7, 1)]
    for h in hold.held:
        h[3].release()
