"""replay.hf on tiny random MoE models (Qwen3-MoE, Qwen3-MoE with a dense layer, Mixtral): the experts get the
replayed ids bit for bit, the weights are the router's own arithmetic at those ids, gradients reach the
routers, the model's own top-k replayed is the unpatched model exactly, masked rows fall back and are counted,
gradient checkpointing gives the same gradients, and generation records line up with the trainer's tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from routing_replay.apps.models import make_config, moe_layer_ids
from routing_replay.protocol import wire
from routing_replay.replay import find_moe_blocks, packed, padded, replay_routing

ARCHS = ("qwen3_moe", "qwen3_moe_mixed", "mixtral")
E, TOPK, B, S = 8, 2, 2, 6


def tiny(arch: str, seed: int = 0):
    from transformers import AutoModelForCausalLM
    cfg = make_config(arch, num_layers=3, num_experts=E, top_k=TOPK, hidden_size=64)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 1.0 if name.endswith("gate.weight") and p.shape[0] == E else 0.05)
    return model


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return tiny(request.param)


def tokens(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (B, S), generator=g)


def random_sets(n_tokens, n_layers, seed=2):
    """(n_tokens, n_layers, TOPK) distinct expert ids per row, uniformly chosen."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n_tokens, n_layers, E, generator=g).argsort(-1)[..., :TOPK]


class Seen:
    """What each MoE block handed its experts (ids, weights), and what its router was fed, per call."""

    def __init__(self, model):
        self.blocks = find_moe_blocks(model)
        self.ids, self.weights, self.hidden = [], [], []
        self.handles = []
        for m, (_, block, _) in enumerate(self.blocks):
            self.handles.append(block.experts.register_forward_pre_hook(self._experts(m)))
            self.handles.append(block.gate.register_forward_pre_hook(self._gate(m)))

    def _experts(self, m):
        def hook(mod, args):
            self.ids.append((m, args[1].detach().clone()))
            self.weights.append((m, args[2].detach().clone()))
        return hook

    def _gate(self, m):
        def hook(mod, args):
            self.hidden.append((m, args[0].detach().clone()))
        return hook

    def per_layer(self, what):
        """{MoE index: (N, K)} of the first call of each layer."""
        out = {}
        for m, t in what:
            out.setdefault(m, t)
        return out

    def close(self):
        for h in self.handles:
            h.remove()


def own_topk(model, input_ids):
    """(B, S, L, K) the model's own top-k from an unpatched forward."""
    got = {}

    def keep(m):
        def hook(mod, args, out):
            got.setdefault(m, out[2].clone())
        return hook
    handles = [blk.gate.register_forward_hook(keep(m)) for m, (_, blk, _) in enumerate(find_moe_blocks(model))]
    with torch.no_grad():
        model(input_ids=input_ids)
    for h in handles:
        h.remove()
    return torch.stack([got[m] for m in range(len(got))], 1).reshape(*input_ids.shape, len(got), TOPK)


def loss_and_grads(model, input_ids, **replay):
    model.zero_grad(set_to_none=True)
    if replay:
        with replay_routing(model, **replay) as stats:
            out = model(input_ids=input_ids, labels=input_ids)
            out.loss.backward()
    else:
        stats = None
        out = model(input_ids=input_ids, labels=input_ids)
        out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads, stats


def reference_weights(model, m, hidden, ids):
    """The router's own arithmetic, written out: softmax over all experts, gathered at ids, renormalised."""
    _, blk, _ = find_moe_blocks(model)[m]
    logits = hidden.reshape(-1, hidden.shape[-1]) @ blk.gate.weight.detach().T
    p = torch.softmax(logits.float(), -1).gather(1, ids)
    if type(blk).__name__ == "MixtralSparseMoeBlock" or blk.gate.norm_topk_prob:
        p = p / p.sum(-1, keepdim=True)
    return p


def test_moe_blocks_are_found_in_layer_order(model):
    assert [layer for layer, _, _ in find_moe_blocks(model)] == moe_layer_ids(model.config)


def test_replayed_ids_reach_the_experts_bit_for_bit(model):
    x = tokens()
    L = len(find_moe_blocks(model))
    ids = random_sets(B * S, L).reshape(B, S, L, TOPK)
    seen = Seen(model)
    try:
        with torch.no_grad(), replay_routing(model, ids) as stats:
            model(input_ids=x)
    finally:
        seen.close()
    got, w, hid = seen.per_layer(seen.ids), seen.per_layer(seen.weights), seen.per_layer(seen.hidden)
    assert sorted(got) == list(range(L))
    for m in range(L):
        assert torch.equal(got[m], ids[:, :, m].reshape(-1, TOPK)), m
        assert torch.allclose(w[m], reference_weights(model, m, hid[m], got[m]), rtol=1e-6, atol=0)
    assert stats.calls == [1] * L and stats.replayed_rows == [B * S] * L and stats.fallback_rows == [0] * L
    assert all("forward" not in vars(blk.gate) for _, blk, _ in find_moe_blocks(model))    # restored


def test_packed_layout_follows_the_flattened_tokens(model):
    x = tokens().reshape(1, -1)
    L = len(find_moe_blocks(model))
    ids = random_sets(B * S, L, seed=5)                      # (T, L, K) for input (1, T)
    seen = Seen(model)
    try:
        with torch.no_grad(), replay_routing(model, ids, torch.zeros(B * S, dtype=torch.bool)):
            model(input_ids=x)
    finally:
        seen.close()
    got = seen.per_layer(seen.ids)
    assert all(torch.equal(got[m], ids[:, m]) for m in range(L))


def test_gradients_reach_the_routers(model):
    model.train()
    x = tokens()
    L = len(find_moe_blocks(model))
    _, g_rep, _ = loss_and_grads(model, x, expert_ids=random_sets(B * S, L).reshape(B, S, L, TOPK))
    _, g_own, _ = loss_and_grads(model, x)
    gates = [n for n in g_own if n.endswith("gate.weight") and g_own[n].shape[0] == E]
    assert len(gates) == L
    for n in gates:
        assert (g_rep[n].abs().sum(1) > 0).all(), n          # every expert's router row gets gradient
        assert not torch.equal(g_rep[n], g_own[n]), n         # and it is the replayed routing's gradient


def test_own_topk_replayed_is_the_unpatched_model_exactly(model):
    model.train()
    x = tokens()
    ids = own_topk(model, x)
    lo0, g0, _ = loss_and_grads(model, x)
    lo1, g1, stats = loss_and_grads(model, x, expert_ids=ids)
    assert torch.equal(lo0, lo1)
    assert sorted(g0) == sorted(g1) == sorted(n for n, _ in model.named_parameters())
    assert [n for n in g0 if not torch.equal(g0[n], g1[n])] == []
    assert stats.fallback_rows == [0] * ids.shape[2]
    # int32 ids in the "all" layout (dense layers as -1 columns) replay the same routing
    all_ids = torch.full((B, S, model.config.num_hidden_layers, TOPK), -1, dtype=torch.int32)
    all_ids[:, :, moe_layer_ids(model.config)] = ids.to(torch.int32)
    lo2, g2, _ = loss_and_grads(model, x, expert_ids=all_ids,
                                layer_ids=list(range(model.config.num_hidden_layers)))
    assert torch.equal(lo0, lo2) and [n for n in g0 if not torch.equal(g0[n], g2[n])] == []


def test_masked_rows_fall_back_and_are_counted(model):
    x = tokens()
    L = len(find_moe_blocks(model))
    own = own_topk(model, x).reshape(B * S, L, TOPK)
    ids = random_sets(B * S, L, seed=3)
    g = torch.Generator().manual_seed(4)
    mask = torch.rand(B * S, L, generator=g) < 0.4
    ids[5, 0] = torch.tensor([-1, 3])                         # a -1 row falls back even when not masked
    mask[5, 0] = False
    seen = Seen(model)
    try:
        with torch.no_grad(), replay_routing(model, ids.reshape(B, S, L, TOPK), mask.reshape(B, S, L)) as stats:
            model(input_ids=x)
    finally:
        seen.close()
    got, hid = seen.per_layer(seen.ids), seen.per_layer(seen.hidden)
    fell = mask.clone()
    fell[5, 0] = True
    assert torch.equal(got[0], torch.where(fell[:, 0, None], own[:, 0], ids[:, 0]))
    for m in range(L):       # deeper layers see other hidden states than unpatched: their own top-k of those
        _, blk, _ = find_moe_blocks(model)[m]
        with torch.no_grad():
            logits = torch.nn.functional.linear(hid[m], blk.gate.weight)
            mine = torch.topk(torch.softmax(logits.float(), -1), TOPK, dim=-1).indices
        assert torch.equal(got[m], torch.where(fell[:, m, None], mine, ids[:, m])), m
    assert stats.fallback_rows == fell.sum(0).tolist()
    assert stats.replayed_rows == (B * S - fell.sum(0)).tolist()
    assert stats.calls == [1] * L


def test_fully_masked_replay_is_the_unpatched_model():
    model = tiny("qwen3_moe_mixed")
    x = tokens()
    L = len(find_moe_blocks(model))
    lo0, g0, _ = loss_and_grads(model, x)
    lo1, g1, stats = loss_and_grads(model, x, expert_ids=random_sets(B * S, L).reshape(B, S, L, TOPK),
                                    no_routing=torch.ones(B, S, dtype=torch.bool))
    assert torch.equal(lo0, lo1) and [n for n in g0 if not torch.equal(g0[n], g1[n])] == []
    assert stats.fallback_rows == [B * S] * L and stats.replayed_rows == [0] * L


@pytest.mark.parametrize("arch", ARCHS)
def test_gradient_checkpointing_gives_the_same_grads(arch):
    model = tiny(arch)
    model.train()
    x = tokens()
    L = len(find_moe_blocks(model))
    ids = random_sets(B * S, L, seed=7).reshape(B, S, L, TOPK)
    mask = torch.zeros(B, S, L, dtype=torch.bool)
    mask[1, 2:] = True
    lo0, g0, s0 = loss_and_grads(model, x, expert_ids=ids, no_routing=mask)
    model.gradient_checkpointing_enable()
    try:
        lo1, g1, s1 = loss_and_grads(model, x, expert_ids=ids, no_routing=mask)
    finally:
        model.gradient_checkpointing_disable()
    assert s0.calls == [1] * L and s1.calls == [2] * L                 # the recompute ran the routers again
    assert s1.fallback_rows == [2 * 4] * L
    assert torch.equal(lo0, lo1)
    assert sorted(g0) == sorted(g1) and [n for n in g0 if not torch.equal(g0[n], g1[n])] == []


def test_refusals_name_the_offending_values_and_restore_the_model():
    model = tiny("qwen3_moe")
    x = tokens()
    L = len(find_moe_blocks(model))
    ids = random_sets(B * S, L).reshape(B, S, L, TOPK)
    bad = ids.clone()
    bad[1, 3, 2, 1] = E
    with pytest.raises(ValueError, match=rf"layer 2: expert id {E} at token 9 slot 1 is outside \[0, {E}\)"):
        with replay_routing(model, bad):
            pass
    dup = ids.clone()
    dup[0, 4, 1] = torch.tensor([6, 6])
    with pytest.raises(ValueError, match=r"layer 1: token 4 replays the same expert twice: \[6, 6\]"):
        with replay_routing(model, dup):
            pass
    with pytest.raises(ValueError, match=r"expert_ids have K=3, the router of layer 0 picks top_k=2"):
        with replay_routing(model, torch.zeros(B, S, L, 3, dtype=torch.long)):
            pass
    with pytest.raises(ValueError, match=r"expert_ids have L=2 columns, the model has 3 MoE layers \[0, 1, 2\]"):
        with replay_routing(model, ids[:, :, :2]):
            pass
    with pytest.raises(ValueError, match=r"MoE layers \[2\] of the model are not in layer_ids \[0, 1, 5\]"):
        with replay_routing(model, ids, layer_ids=[0, 1, 5]):
            pass
    with pytest.raises(ValueError, match=r"no_routing has shape \(2, 5\), expected \(2, 6\) or \(2, 6, 3\)"):
        with replay_routing(model, ids, torch.zeros(2, 5, dtype=torch.bool)):
            pass
    with pytest.raises(ValueError, match=r"the router of layer 0 sees 6 tokens, the replay tensor has 12"):
        with torch.no_grad(), replay_routing(model, ids):
            model(input_ids=x[:1])
    with replay_routing(model, ids):
        with pytest.raises(RuntimeError, match=r"router of layer 0 already has its forward replaced"):
            with replay_routing(model, ids):
                pass
    assert all("forward" not in vars(blk.gate) for _, blk, _ in find_moe_blocks(model))


def test_generation_records_line_up_with_the_trainers_tokens():
    """Rows published by the HF adapter's generation loop, assembled as the consumer does, then laid out by
    replay.tensors: at every routed position they equal the top-k of a teacher-forced forward over prompt +
    output (what the trainer runs), and the only unrouted position is the last output token."""
    from routing_replay.engines.hf_adapter import HFRoutingAdapter
    model = tiny("qwen3_moe_mixed").eval()
    L = len(find_moe_blocks(model))
    prompts = [[3, 17, 250, 99, 4], [200, 5, 5, 18, 77]]
    G = 4

    class Sink:
        def __init__(self):
            self.rows, self.meta = {}, {}

        def open(self, rid, *, prompt_len, num_cached_tokens=0, prompt_token_ids=None):
            self.rows[rid] = np.full((prompt_len + G, L, TOPK), -1, np.int16)
            self.meta[rid] = (prompt_len, np.asarray(prompt_token_ids, np.int32))

        def publish_rows(self, ids, starts, counts, pending):
            arr = pending.result().copy()
            pending.release()
            off = 0
            for rid, s, c in zip(ids, starts, counts):
                self.rows[rid][s:s + c] = arr[off:off + c]
                off += c
            return True

        def finish(self, rid, *, num_output_tokens, output_token_ids, **kw):
            self.meta[rid] += (np.asarray(output_token_ids, np.int32),)

    sink = Sink()
    with HFRoutingAdapter(model, sink) as ad:
        ad.generate(prompts, request_ids=["a", "b"], max_new_tokens=G)
    recs = []
    for rid in ("a", "b"):
        P, ptok, otok = sink.meta[rid]
        r = sink.rows[rid]
        recs.append(wire.Record(request_id=rid, prompt_routed_experts=r[:P], routed_experts=r[P:P + len(otok)],
                                num_cached_tokens=0, moe_layer_ids=np.asarray(moe_layer_ids(model.config), np.int32),
                                complete=True, prompt_token_ids=ptok, output_token_ids=otok))
    trainer_tokens = [np.r_[r.prompt_token_ids, r.output_token_ids] for r in recs]
    t = padded(recs, token_ids=trainer_tokens)
    own = own_topk(model, torch.tensor(np.stack(trainer_tokens), dtype=torch.long))
    n = len(trainer_tokens[0])
    assert t.expert_ids.shape == own.shape == (2, n, L, TOPK)
    assert t.no_routing.tolist() == [[[p == n - 1] * L for p in range(n)]] * 2
    assert torch.equal(t.expert_ids[:, :n - 1], own[:, :n - 1])
    # and replaying them in the trainer's forward reproduces its own routing exactly
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(np.stack(trainer_tokens), dtype=torch.long)).logits
        with replay_routing(model, t.expert_ids, t.no_routing, layer_ids=t.layer_ids) as stats:
            got = model(input_ids=torch.tensor(np.stack(trainer_tokens), dtype=torch.long)).logits
    assert torch.equal(ref, got) and stats.fallback_rows == [2] * L
    pk = packed(recs)
    assert torch.equal(pk.expert_ids.reshape(2, n, L, TOPK), t.expert_ids)
