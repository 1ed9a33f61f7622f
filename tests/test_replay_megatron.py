"""replay.megatron: the set_replay_data list in Megatron's token order, fed to Megatron-Core's own RouterReplay
and TopKRouter (skipped when megatron-core is not installed); -1 never reaches it; every router configuration
that routes around RouterReplay refused, and a router that did not take its ids noticed.

Run against megatron-core 0.16.1 (.venv) and 0.19.2 (`make test-megatron-latest`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from routing_replay.replay import packed, padded
from routing_replay.replay.megatron import (MicroBatchReplay, check_megatron_config, megatron_replay_data,
                                            megatron_routers)
from tests.test_replay_tensors import K, L, record


def test_sequence_major_order_and_filled_rows():
    a, b = record("a", 3, 2), record("b", 2, 2)           # lengths 5 and 4; last rows -1
    t = padded([a, b])                                    # (2, 5, L, K), b padded at position 4
    data = megatron_replay_data(t)
    assert len(data) == L and all(d.shape == (10, K) and d.dtype == torch.int64 for d in data)
    for m in range(L):
        for s in range(5):
            for bi in range(2):
                want = t.expert_ids[bi, s, m]
                if (bi, s) in ((0, 4), (1, 3), (1, 4)):  # last tokens and padding: distinct filler ids
                    want = torch.arange(K)
                assert torch.equal(data[m][s * 2 + bi], want), (m, s, bi)
    assert all((d >= 0).all() for d in data)
    left = megatron_replay_data(padded([a, b], padding_side="left"), padding_side="left")
    assert torch.equal(left[1][1::2][1:], data[1][1::2][:4])   # b's four tokens, shifted by its padding
    p = megatron_replay_data(packed([a, b]), layers=(1, 3))
    assert len(p) == 2 and torch.equal(p[0][:4], packed([a]).expert_ids[:4, 1])
    assert torch.equal(p[0][4], torch.arange(K)) and torch.equal(p[0][8], torch.arange(K))


def test_context_rows_without_routing_are_refused_or_taken_from_fallback():
    rec = record("c", 4, 2, cached=2)
    t = packed([rec])
    with pytest.raises(ValueError, match=r"2 context tokens have no routing \(prefix-cache hits or missing rows; "
                                         r"first at Megatron token 0; per layer \[2, 2, 2\]\)"):
        megatron_replay_data(t)
    fb = [torch.stack([torch.tensor([5, 6])] * 6) for _ in range(L)]
    data = megatron_replay_data(t, fallback=fb)
    assert torch.equal(data[0][:2], torch.tensor([[5, 6], [5, 6]]))
    assert torch.equal(data[0][2:5], t.expert_ids[2:5, 0]) and torch.equal(data[0][5], torch.arange(K))


def test_megatron_router_replay_takes_the_list():
    rr = pytest.importorskip("megatron.core.transformer.moe.router_replay")
    RouterReplay, Action = rr.RouterReplay, rr.RouterReplayAction
    RouterReplay.clear_global_router_replay_instances()
    try:
        routers = [RouterReplay() for _ in range(L)]
        t = padded([record("a", 3, 2), record("b", 2, 2)])
        data = megatron_replay_data(t)
        RouterReplay.set_replay_data(data)
        RouterReplay.set_global_router_replay_action(Action.REPLAY_FORWARD)
        scores = torch.rand(10, 1000, generator=torch.Generator().manual_seed(0))
        for m, r in enumerate(routers):
            probs, idx = r.get_replay_topk(scores, K)
            assert torch.equal(idx, data[m]) and torch.equal(probs, scores.gather(1, data[m]))
    finally:
        RouterReplay.clear_global_router_replay_instances()


def test_filled_rows_are_distinct_and_repeated_ids_refused():
    t = padded([record("a", 3, 2), record("b", 2, 2)])
    data = megatron_replay_data(t)
    E = int(max(d.max() for d in data)) + 1
    for d in data:                                        # the dispatcher's routing map: exactly K per token
        routing_map = torch.zeros(d.shape[0], E, dtype=torch.int32).scatter(1, d, 1).bool()
        assert routing_map.sum(1).tolist() == [K] * d.shape[0]
    bad = record("d", 3, 2)
    bad.prompt_routed_experts[1, 2] = 7                   # token 1, MoE layer 2: [7, 7]
    with pytest.raises(ValueError, match=r"1 \(token, layer\) rows repeat an expert id, first Megatron token 1 "
                                         r"layer 2: \[7, 7\]"):
        megatron_replay_data(packed([bad]))


def test_check_megatron_config_refuses_each_silent_skip():
    tc = pytest.importorskip("megatron.core.transformer.transformer_config")
    base = dict(num_layers=2, hidden_size=8, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2)
    check_megatron_config(tc.TransformerConfig(**base, moe_enable_routing_replay=True))
    with pytest.raises(ValueError, match=r"^routing replay cannot run on this TransformerConfig: "
                                         r"moe_enable_routing_replay=False: the routers own no RouterReplay$"):
        check_megatron_config(tc.TransformerConfig(**base))
    cfg = tc.TransformerConfig(**base, moe_enable_routing_replay=True)
    cfg.moe_router_fusion, cfg.moe_router_load_balancing_type, cfg.moe_expert_capacity_factor = True, "sinkhorn", 1.5
    with pytest.raises(ValueError, match=r"moe_router_fusion=True: the fused top-k never calls RouterReplay \(replay "
                                         r"silently skipped\); moe_router_load_balancing_type='sinkhorn': sinkhorn "
                                         r"routing never calls RouterReplay; moe_expert_capacity_factor=1.5: token "
                                         r"dropping discards replayed routes$"):
        check_megatron_config(cfg)
    cfg = tc.TransformerConfig(**base, moe_enable_routing_replay=True)
    cfg.moe_router_load_balancing_type, cfg.moe_router_force_load_balancing = "quantile_balancing", True
    cfg.moe_router_force_biased, cfg.cuda_graph_impl = 0.5, "full_iteration"
    with pytest.raises(ValueError, match=r"^routing replay cannot run on this TransformerConfig: "
                                         r"moe_router_load_balancing_type='quantile_balancing': its own top-k is "
                                         r"passed as precomputed_indices without RouterReplay \(replay silently skipped\); "
                                         r"moe_router_force_load_balancing=True: random logits replace the router's "
                                         r"\(benchmark only\); moe_router_force_biased=0.5: random biases change the "
                                         r"router's logits; cuda_graph_impl='full_iteration': the captured router "
                                         r"replays the ids it was captured with$"):
        check_megatron_config(cfg)
    field = "cuda_graph_modules" if hasattr(cfg, "cuda_graph_modules") else "cuda_graph_scope"
    for scope, refused in (([], True), (["attn"], False), (["attn", "moe_router"], True), ("full", True)):
        cfg = tc.TransformerConfig(**base, moe_enable_routing_replay=True)
        cfg.cuda_graph_impl = "transformer_engine"
        setattr(cfg, field, scope)
        if refused:
            with pytest.raises(ValueError, match=rf"cuda_graph_impl='transformer_engine' with {field}="):
                check_megatron_config(cfg)
        else:
            check_megatron_config(cfg)


def _one_f_one_b(replay, routers, scores, recomputed, naive=None):
    """Megatron's 1F1B order for 3 micro-batches (F0 F1 B0 F2 B1 B2); each router call is get_replay_topk, a
    backward recomputes the routers in `recomputed`. Returns {(phase, mb, router): ids}."""
    seen = {}

    def fwd(i):
        if naive is not None:                             # set_replay_data + REPLAY_FORWARD, never switched
            naive(i)
            for m, r in enumerate(routers):
                seen["F", i, m] = r.get_replay_topk(scores, K)[1]
            return
        with replay.forward():
            for m, r in enumerate(routers):
                seen["F", i, m] = r.get_replay_topk(scores, K)[1]

    def bwd(i):
        for m in recomputed:
            seen["B", i, m] = routers[m].get_replay_topk(scores, K)[1]

    for step in (lambda: fwd(0), lambda: fwd(1), lambda: bwd(0), lambda: fwd(2), lambda: bwd(1), lambda: bwd(2)):
        step()
    return seen


def test_micro_batch_replay_keeps_forward_and_recompute_aligned_under_1f1b():
    rr = pytest.importorskip("megatron.core.transformer.moe.router_replay")
    RouterReplay, Action = rr.RouterReplay, rr.RouterReplayAction
    RouterReplay.clear_global_router_replay_instances()
    try:
        routers = [RouterReplay() for _ in range(L)]
        mbs = [megatron_replay_data(packed([record(f"m{i}", 2 + i, 2)])) for i in range(3)]
        scores = torch.rand(6, 1000, generator=torch.Generator().manual_seed(0))
        mbs = [[d[:4] for d in mb] for mb in mbs]        # 4 tokens each, so one score tensor serves all
        assert not torch.equal(mbs[0][0], mbs[1][0])

        replay = MicroBatchReplay(routers, Action, mbs)
        seen = _one_f_one_b(replay, routers, scores[:4], recomputed=[0, 2])   # router 1 not recomputed
        for (phase, i, m), ids in seen.items():
            assert torch.equal(ids, mbs[i][m]), (phase, i, m)
        assert len(seen) == 9 + 6
        assert replay.finish() == [0, 3, 0]
        assert all(r.replay_backward_list == [] and r.router_replay_action is None for r in routers)

        def naive(i):
            RouterReplay.set_replay_data(mbs[i])
            RouterReplay.set_global_router_replay_action(Action.REPLAY_FORWARD)
        seen = _one_f_one_b(None, routers, scores[:4], recomputed=[0], naive=naive)
        assert torch.equal(seen["B", 0, 0], mbs[1][0])   # the trap: micro-batch 0 recomputed with 1's ids
        RouterReplay.clear_global_indices()

        for r in routers:                                 # a forward-only pass left its entries
            r.set_target_indices(mbs[0][0])
        with pytest.raises(ValueError, match=r"routers hold \[1, 1, 1\] replay_backward_list entries from an "
                                             r"earlier pass"):
            MicroBatchReplay(routers, Action, mbs)
        RouterReplay.clear_global_indices()

        replay = MicroBatchReplay(routers, Action, mbs)
        with pytest.raises(ValueError, match=r"forward of micro-batch 1, expected 0 of 3"):
            with replay.forward(1):
                pass
        for i in range(3):
            with replay.forward():
                for r in routers:
                    r.get_replay_topk(scores[:4], K)
        routers[0].replay_backward_list.pop(0)            # recomputed for one micro-batch only
        with pytest.raises(ValueError, match=r"routers \[0\] have \[2\] of 3 backward entries left"):
            replay.finish()
        with pytest.raises(ValueError, match=r"micro-batch 0 has 2 layers of replay data, 3 routers"):
            MicroBatchReplay(routers, Action, [mbs[0][:2]])
        RouterReplay.clear_global_indices()

        replay = MicroBatchReplay(routers, Action, mbs[:1])
        with pytest.raises(ValueError, match=r"router 1 routes 6 tokens, its replay ids have 4 rows \(the rest would "
                                             r"reach no expert\)"):
            with replay.forward():
                routers[0].get_replay_topk(scores[:4], K)
                routers[1].get_replay_topk(scores, K)
        RouterReplay.clear_global_indices()
        replay = MicroBatchReplay(routers, Action, mbs[:1])
        with replay.forward():                            # router 2 never asked for its ids
            routers[0].get_replay_topk(scores[:4], K)
            routers[1].get_replay_topk(scores[:4], K)
        with pytest.raises(ValueError, match=r"^4 router rows did not follow the replayed ids \(router 2 forward 0: "
                                             r"0 of 4 rows follow\)"):
            replay.finish()
        assert all(r.get_replay_topk.__func__ is RouterReplay.get_replay_topk for r in routers)   # unwrapped
    finally:
        RouterReplay.clear_global_router_replay_instances()


@pytest.fixture
def topk_router(tmp_path, monkeypatch):
    """Real Megatron-Core TopKRouters on the CPU: a one-process gloo group (file store) for the router's process
    groups; `torch.cuda.current_device` answers "cpu" because the router allocates its buffers there (the only
    stand-in: no CUDA here)."""
    pytest.importorskip("megatron.core.transformer.moe.router")
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from megatron.core.transformer.transformer_config import TransformerConfig
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    g = dist.group.WORLD
    names = ("tp", "cp", "ep", "tp_cp", "tp_dp_cp", "dp", "dp_cp", "tp_ep", "expt_tp", "expt_dp")
    pg = ProcessGroupCollection(**{n: g for n in names})
    RouterReplay.clear_global_router_replay_instances()

    def make(layer_number=1, **cfg):
        config = TransformerConfig(num_layers=4, hidden_size=16, num_attention_heads=2, num_moe_experts=8,
                                   moe_router_topk=K, moe_enable_routing_replay=True, moe_aux_loss_coeff=0.0, **cfg)
        torch.manual_seed(layer_number)
        r = TopKRouter(config, pg_collection=pg)
        r.set_layer_number(layer_number)
        return r
    try:
        yield make
    finally:
        RouterReplay.clear_global_router_replay_instances()
        dist.destroy_process_group()


def _needs_gate():
    """Skip where the router's forward cannot run here: 0.16.1's gate names `te_general_gemm`, unbound without
    TransformerEngine."""
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        pytest.skip("this megatron-core's router gate needs TransformerEngine")


def _ids(n, seed):
    """(n, K) distinct expert ids out of 8."""
    return torch.rand(n, 8, generator=torch.Generator().manual_seed(seed)).argsort(1)[:, :K].contiguous()


def test_topk_router_takes_the_ids_and_quantile_balancing_is_refused_and_noticed(topk_router):
    from megatron.core.transformer.moe.router_replay import RouterReplayAction as Action
    _needs_gate()
    x = torch.randn(8, 2, 16, generator=torch.Generator().manual_seed(3))    # [s, b, h]: 16 tokens
    ids = _ids(16, 4)
    router = topk_router()
    replay = MicroBatchReplay([router], Action, [[ids]])
    with replay.forward():
        probs, routing_map = router(x)
    assert torch.equal(routing_map, torch.zeros(16, 8, dtype=torch.bool).scatter(1, ids, True))
    assert replay.finish() == [1]                         # not recomputed: its one entry left, cleared
    if not hasattr(router, "quantile_balancing"):
        pytest.skip("quantile balancing came after this megatron-core")
    qb = topk_router(moe_router_load_balancing_type="quantile_balancing")
    with pytest.raises(ValueError, match=r"moe_router_load_balancing_type='quantile_balancing': its own top-k"):
        check_megatron_config(qb.config)
    for given in (qb, qb.router_replay):                  # the module (rows compared) or its RouterReplay alone
        replay = MicroBatchReplay([given], Action, [[ids]])
        with replay.forward():
            _, routing_map = qb(x)
        assert not bool((routing_map == torch.zeros(16, 8, dtype=torch.bool).scatter(1, ids, True)).all(1).any())
        with pytest.raises(ValueError, match=r"^16 router rows did not follow the replayed ids \(router 0 forward 0: "
                                             r"0 of 16 rows follow\): the router chose its experts around "
                                             r"RouterReplay \(quantile balancing"):
            replay.finish()


def test_mtp_routers_are_mapped_apart_and_route_on_their_own(topk_router):
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction as Action

    def layer(router):
        m = torch.nn.Module()
        m.mlp = torch.nn.Module()
        m.mlp.router = router
        return m
    model = torch.nn.Module()                             # GPTModel's names: decoder.layers.N, mtp.layers.N
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList([layer(topk_router(1)), layer(topk_router(3))])
    model.mtp = torch.nn.Module()
    model.mtp.layers = torch.nn.ModuleList([layer(topk_router(1))])   # MTP layers number their own from 1
    routers = megatron_routers(model)
    assert routers.layers == [0, 2] and len(routers.mtp) == 1
    assert routers.decoder + routers.mtp == RouterReplay.global_router_replay_instances
    assert megatron_routers([model]) == routers                                       # a list of model chunks
    t = packed([record("a", 3, 2)])                       # record layer_ids [0, 2, 3]: the routers take 0 and 2
    mapped = megatron_replay_data(t, model_layers=routers.layers)
    assert [torch.equal(a, b) for a, b in zip(mapped, megatron_replay_data(t, layers=(0, 2)))] == [True, True]
    x = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(5))
    data = [_ids(8, 6), _ids(8, 7)]

    RouterReplay.set_replay_data(data + [_ids(8, 8)])     # the global call sets the MTP router's ids too
    with pytest.raises(ValueError, match=r"^MTP routers \[0\] hold replay ids or an action before the step "
                                         r"\(entries \[1\], actions \['None'\]\)"):
        MicroBatchReplay(routers.decoder, Action, [data], mtp_routers=routers.mtp)
    RouterReplay.clear_global_indices()

    _needs_gate()
    mtp_router = model.mtp.layers[0].mlp.router
    own = mtp_router(x)[1]
    decoder_modules = [model.decoder.layers[0].mlp.router, model.decoder.layers[1].mlp.router]
    replay = MicroBatchReplay(decoder_modules, Action, [data], mtp_routers=routers.mtp)
    with replay.forward():
        maps = [r(x)[1] for r in decoder_modules]
        assert torch.equal(mtp_router(x)[1], own)         # the MTP router's own top-k
    for got, ids in zip(maps, data):
        assert torch.equal(got, torch.zeros(8, 8, dtype=torch.bool).scatter(1, ids, True))
    assert replay.finish() == [1, 1]
    replay = MicroBatchReplay(routers.decoder, Action, [data], mtp_routers=routers.mtp)
    with replay.forward():
        for r in decoder_modules:
            r(x)
        RouterReplay.set_global_router_replay_action(Action.REPLAY_FORWARD)   # reaches the MTP router too
    with pytest.raises(ValueError, match=r"^MTP routers \[0\] hold replay ids or an action after the step"):
        replay.finish()


def test_an_all_layout_tensor_is_refused_for_its_dense_columns():
    t = packed([record("a", 3, 2)], layout="all")         # layers 0..3, layer 1 dense
    with pytest.raises(ValueError, match=r"^columns \[1\] \(model layers \[1\]\) have no routing in any token: dense "
                                         r"layers of an 'all'-layout tensor\? megatron_replay_data takes the 'moe' "
                                         r"layout"):
        megatron_replay_data(t)
    assert len(megatron_replay_data(packed([record("a", 3, 2)], layout="all"), layers=(2, 4))) == 2


def test_model_layers_pick_each_routers_column_by_layer_id():
    t = packed([record("a", 3, 2), record("b", 2, 2)])   # layer_ids [0, 2, 3]
    full = megatron_replay_data(t)
    picked = megatron_replay_data(t, model_layers=[3, 0])  # e.g. a stage holding model layers 3, then 0
    assert len(picked) == 2 and torch.equal(picked[0], full[2]) and torch.equal(picked[1], full[0])
    with pytest.raises(ValueError, match=r"^routers of model layers \[1\] have no column in the replay data \(its "
                                         r"layer_ids are \[0, 2, 3\]\): a dense layer in the record, or another "
                                         r"model$"):
        megatron_replay_data(t, model_layers=[0, 1])
    with pytest.raises(ValueError, match=r"pass layers=\(lo, hi\) or model_layers=, not both"):
        megatron_replay_data(t, layers=(0, 1), model_layers=[0])


@pytest.fixture
def gpt_with_mtp(tmp_path, monkeypatch):
    """A real Megatron-Core GPTModel on the CPU (local layer specs, no TransformerEngine): 3 decoder layers, layer 0
    dense, 1 and 2 MoE, and one MTP layer, with routing replay on; model parallel state of one gloo process (file
    store); `torch.cuda.current_device` answers "cpu" as in `topk_router`."""
    pytest.importorskip("megatron.core.models.gpt.gpt_model")
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec, get_gpt_layer_local_spec,
                                                          get_gpt_mtp_block_spec)
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from megatron.core.transformer.transformer_config import TransformerConfig
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    RouterReplay.clear_global_router_replay_instances()
    try:
        parallel_state.initialize_model_parallel()
        cfg = TransformerConfig(num_layers=3, hidden_size=16, num_attention_heads=2, num_moe_experts=8,
                                moe_router_topk=K, moe_enable_routing_replay=True, moe_aux_loss_coeff=0.0,
                                mtp_num_layers=1, moe_layer_freq=[0, 1, 1], use_cpu_initialization=True,
                                moe_token_dispatcher_type="allgather")
        layer = get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False)
        yield GPTModel(cfg, get_gpt_decoder_block_spec(cfg, use_transformer_engine=False), vocab_size=64,
                       max_sequence_length=32,
                       mtp_block_spec=get_gpt_mtp_block_spec(cfg, layer, use_transformer_engine=False))
    finally:
        RouterReplay.clear_global_router_replay_instances()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_megatron_routers_split_a_gpt_models_decoder_and_mtp_routers(gpt_with_mtp):
    from megatron.core.transformer.moe.router_replay import RouterReplay
    routers = megatron_routers(gpt_with_mtp)
    named = {n: m for n, m in gpt_with_mtp.named_modules() if getattr(m, "router_replay", None) is not None}
    assert sorted(named) == ["decoder.layers.1.mlp.router", "decoder.layers.2.mlp.router",
                             next(n for n in named if n.startswith("mtp.layers.0."))]
    assert routers.layers == [1, 2] and len(routers.mtp) == 1    # 0.16.1 numbers its MTP router's layer 4
    assert routers.decoder == [named["decoder.layers.1.mlp.router"].router_replay,
                               named["decoder.layers.2.mlp.router"].router_replay]
    assert routers.decoder + routers.mtp == RouterReplay.global_router_replay_instances
    t = packed([record("a", 3, 2, layer_ids=np.array([1, 2], np.int32))])
    assert [d.shape for d in megatron_replay_data(t, model_layers=routers.layers)] == [(5, K), (5, K)]
