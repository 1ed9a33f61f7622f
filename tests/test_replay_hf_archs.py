"""replay.hf on every supported HF transformers MoE architecture, as tiny random-weight models built here
(float32, CPU, 2-3 layers, hidden 32, 8 experts): the replayed ids reach every MoE block bit for bit; the
model's own ids (read from its routers' output in an unpatched run) replay to the unpatched model exactly,
logits and gradients, in training mode; rows that fall back select exactly what the model's router selects on
the same inputs (bias-corrected, group-masked, sampled); router gradients flow; unsupported routers are refused
by name; register_moe_block checks a spec against the router's code."""

from __future__ import annotations

import pytest
import torch

from routing_replay.replay import (MOE_BLOCKS, MoEBlockSpec, RouterFamily, find_moe_blocks, record_selection,
                                   register_moe_block, replay_routing)
from routing_replay.replay import routers as R

E, K, B, S, VOCAB = 8, 2, 2, 6, 128
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts_per_tok=K,
              max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_MLA = dict(head_dim=None, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=8, v_head_dim=8)
_LINEAR_ATTN = dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                    linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
# name: (model_type, config overrides). Grouped top-k configs have groups that matter (topk_group < n_group).
ARCHS = {
    "qwen3_moe": ("qwen3_moe", dict(num_experts=E, norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1])),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=E, shared_expert_intermediate_size=32, norm_topk_prob=False)),
    "qwen3_next": ("qwen3_next", dict(num_experts=E, shared_expert_intermediate_size=32, **_LINEAR_ATTN)),
    "qwen3_5_moe": ("qwen3_5_moe_text", dict(num_experts=E, shared_expert_intermediate_size=32, **_LINEAR_ATTN)),
    "olmoe": ("olmoe", dict(num_experts=E)),
    "mixtral": ("mixtral", dict(num_local_experts=E)),
    "phimoe": ("phimoe", dict(num_local_experts=E, router_jitter_noise=0.5, input_jitter_noise=0.01)),
    "gpt_oss": ("gpt_oss", dict(num_local_experts=E, layer_types=["sliding_attention", "full_attention"])),
    "deepseek_v2": ("deepseek_v2", dict(n_routed_experts=E, n_shared_experts=1, first_k_dense_replace=0,
                                        topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                        routed_scaling_factor=1.5, **{**_MLA, "q_lora_rank": None})),
    "deepseek_v3": ("deepseek_v3", dict(n_routed_experts=E, n_shared_experts=1, first_k_dense_replace=1,
                                        num_hidden_layers=3, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                        **_MLA)),
    "glm4_moe": ("glm4_moe", dict(n_routed_experts=E, n_shared_experts=1, first_k_dense_replace=0, n_group=2,
                                  topk_group=1)),
    "dots1": ("dots1", dict(n_routed_experts=E, n_shared_experts=1, first_k_dense_replace=0, n_group=2,
                            topk_group=1)),
    "minimax_m2": ("minimax_m2", dict(num_local_experts=E)),
    "llama4": ("llama4_text", dict(num_local_experts=E, num_experts_per_tok=1, interleave_moe_layer_step=1,
                                   intermediate_size_mlp=64)),
    "granitemoe": ("granitemoe", dict(num_local_experts=E)),
    "granitemoeshared": ("granitemoeshared", dict(num_local_experts=E, shared_intermediate_size=32)),
}
FAMILY = {"qwen3_moe": "softmax_topk", "qwen2_moe": "softmax_topk", "qwen3_next": "softmax_topk",
          "qwen3_5_moe": "softmax_topk", "olmoe": "softmax_topk", "mixtral": "mixtral", "phimoe": "phimoe",
          "gpt_oss": "gpt_oss", "deepseek_v2": "deepseek_v2", "deepseek_v3": "deepseek_v3",
          "glm4_moe": "deepseek_v3", "dots1": "deepseek_v3", "minimax_m2": "minimax_m2", "llama4": "llama4",
          "granitemoe": "granite", "granitemoeshared": "granite"}


# More architectures, one test each running the same checks: (model_type, family, config overrides). Those of
# the families above run router code identical (by fingerprint) to the architecture tested there.
_DS = dict(n_routed_experts=E, n_shared_experts=1, first_k_dense_replace=0, n_group=2, topk_group=1)
MORE = {
    "flex_olmo": ("flex_olmo", "softmax_topk", dict(num_experts=E)),
    "mellum": ("mellum", "softmax_topk", dict(num_experts=E)),
    "minimax": ("minimax", "mixtral", dict(num_local_experts=E, layer_types=["linear_attention", "full_attention"])),
    "granitemoehybrid": ("granitemoehybrid", "granite", dict(
        num_local_experts=E, layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
        mamba_n_groups=1)),
    "glm4_moe_lite": ("glm4_moe_lite", "deepseek_v3", dict(**_DS, **_MLA)),
    "deepseek_v32": ("deepseek_v32", "deepseek_v3", dict(**_DS, **_MLA)),
    "glm_moe_dsa": ("glm_moe_dsa", "deepseek_v3", dict(**_DS, **_MLA)),
    "axk1": ("axk1", "deepseek_v3", dict(**_DS, **_MLA)),
    "exaone_moe": ("exaone_moe", "deepseek_v3", dict(num_experts=E, n_group=2, topk_group=1, first_k_dense_replace=0)),
    "solar_open": ("solar_open", "deepseek_v3", dict(_DS)),
    "mimo_v2_flash": ("mimo_v2_flash", "deepseek_v3", dict(n_routed_experts=E, n_group=2, topk_group=1)),
    "hy_v4": ("hy_v4", "deepseek_v3", dict(num_experts=E, n_group=2, topk_group=1)),
    "nemotron_h": ("nemotron_h", "deepseek_v3", dict(n_routed_experts=E, n_group=2, topk_group=1,
                                                     hybrid_override_pattern="*E")),
    "hy_v3": ("hy_v3", "hy_v3", dict(num_experts=E, first_k_dense_replace=0)),
    "afmoe": ("afmoe", "afmoe", dict(num_experts=E, num_dense_layers=0, num_shared_experts=1)),
    "laguna": ("laguna", "laguna", dict(num_experts=E, router_logit_softcapping=5.0)),
    "lfm2_moe": ("lfm2_moe", "lfm2_moe", dict(num_experts=E, num_dense_layers=0,
                                              layer_types=["full_attention", "conv"])),
    "mistral4": ("mistral4", "mistral4", dict(model_class="Mistral4ForCausalLM", n_routed_experts=E, n_group=2,
                                              topk_group=1, first_k_dense_replace=0, **_MLA)),
    "hunyuan_v1_moe": ("hunyuan_v1_moe", "hunyuan", dict(num_experts=E, moe_topk=K)),
    "ernie4_5_moe": ("ernie4_5_moe", "ernie", dict(moe_num_experts=E, moe_k=K, moe_layer_start_index=0,
                                                   moe_num_shared_experts=1)),
    "granitemoe_swa": ("granitemoe_swa", "granite_swa", dict(num_local_experts=E)),
    "aria": ("aria_text", "aria", dict(moe_num_experts=E, moe_topk=K, moe_num_shared_experts=1)),
    "cohere2_moe": ("cohere2_moe", "cohere2", dict(num_experts=E)),
}


def build(model_type: str, seed: int = 0, **over):
    """A tiny random model: router weights N(0, 0.5) (logits of a few units: decisive top-k, sigmoids far from
    saturation), score-correction biases N(0, 0.3) (they change the selection), other weights N(0, 0.05)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    kw = {**COMMON, **over}
    kw = {k: v for k, v in kw.items() if v is not None}
    model_class = kw.pop("model_class", None)           # for a causal LM the Auto classes do not map
    cfg = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    if model_class is None:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    else:
        import transformers
        model = getattr(transformers, model_class)(cfg).float()
    try:
        blocks = find_moe_blocks(model)
    except ValueError:                                   # an unsupported architecture
        blocks = []
    routers = {id(p) for _, blk, spec in blocks for p in getattr(blk, spec.router_attr).parameters()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.5 if id(p) in routers else 0.05)
        for name, buf in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                buf.normal_(0.0, 0.3)
    return model


_MODELS: dict[str, torch.nn.Module] = {}


@pytest.fixture(params=sorted(ARCHS))
def arch(request):
    if request.param not in _MODELS:
        model_type, over = ARCHS[request.param]
        _MODELS[request.param] = build(model_type, **over)
    return request.param


def tokens(seed=1):
    return torch.randint(3, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed))


def k_of(model):
    return int(getattr(find_moe_blocks(model)[0][1], find_moe_blocks(model)[0][2].router_attr).top_k)


def random_sets(n, L, k, seed=2):
    """(n, L, k) distinct expert ids per row, uniformly chosen."""
    return torch.rand(n, L, E, generator=torch.Generator().manual_seed(seed)).argsort(-1)[..., :k]


def run(model, x, seed=7, **replay):
    """Seeded forward + backward; (logits, grads, stats, ids the routers selected {m: (N, K)})."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with record_selection(model) as sel:
        if replay:
            with replay_routing(model, **replay) as stats:
                out = model(input_ids=x, labels=x)
                out.loss.backward()
        else:
            stats = None
            out = model(input_ids=x, labels=x)
            out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads, stats, {m: v[0] for m, v in sel.items()}


@pytest.mark.archs
def test_routers_are_found_by_their_code(arch):
    model = _MODELS[arch]
    blocks = find_moe_blocks(model)
    assert {spec.family.name for _, _, spec in blocks} == {FAMILY[arch]}
    want = [i for i in range(model.config.num_hidden_layers)
            if not (arch == "qwen3_moe" and i == 1) and not (arch == "deepseek_v3" and i == 0)]
    assert [layer for layer, _, _ in blocks] == want


@pytest.mark.archs
def test_replayed_ids_reach_every_moe_block_bit_for_bit(arch):
    check_replayed_ids(_MODELS[arch], arch)


def check_replayed_ids(model, arch):
    model.eval()
    blocks = find_moe_blocks(model)
    L, k = len(blocks), k_of(model)
    ids = random_sets(B * S, L, k).reshape(B, S, L, k)
    handed = {}

    def keep(m):
        def hook(mod, args, kwargs):
            ints = [a for a in (*args, *kwargs.values()) if torch.is_tensor(a) and not a.is_floating_point()]
            handed.setdefault(m, ints[0].clone() if ints else None)
        return hook
    hooks = [blk.experts.register_forward_pre_hook(keep(m), with_kwargs=True) for m, (_, blk, _) in enumerate(blocks)]
    try:
        with torch.no_grad(), record_selection(model) as sel, replay_routing(model, ids) as stats:
            model(input_ids=tokens())
    finally:
        for h in hooks:
            h.remove()
    for m in range(L):
        want = ids[:, :, m].reshape(-1, k)
        assert torch.equal(sel[m][0], want), m
        if handed[m] is not None:                        # experts called with (hidden, ids, weights)
            assert torch.equal(handed[m], want), m
    if arch == "llama4":                                 # dense scores: nonzero exactly at the replayed experts
        with torch.no_grad(), replay_routing(model, ids):
            router = blocks[0][1].router
            scores, _ = router(torch.randn(B * S, model.config.hidden_size))
        assert torch.equal((scores > 0).nonzero()[:, 1].reshape(-1, k).sort(-1).values,
                           ids[:, :, 0].reshape(-1, k).sort(-1).values)
    assert stats.calls == [1] * L and stats.replayed_rows == [B * S] * L and stats.fallback_rows == [0] * L
    assert all("forward" not in vars(getattr(blk, spec.router_attr)) for _, blk, spec in blocks)   # restored


@pytest.mark.archs
def test_own_ids_replay_to_the_unpatched_model_exactly(arch):
    check_own_ids_exact(_MODELS[arch])


def check_own_ids_exact(model):
    model.train()
    x = tokens()
    lo0, g0, _, own = run(model, x)
    L = len(own)
    ids = torch.stack([own[m] for m in range(L)], 1).reshape(B, S, L, -1)
    lo1, g1, stats, got = run(model, x, expert_ids=ids)
    assert all(torch.equal(got[m], own[m]) for m in range(L))
    assert torch.equal(lo0, lo1)
    assert sorted(g0) == sorted(g1)
    assert [n for n in g0 if not torch.equal(g0[n], g1[n])] == []
    assert stats.fallback_rows == [0] * L and stats.replayed_rows == [B * S] * L
    model.eval()


@pytest.mark.archs
def test_fallback_rows_select_what_the_model_selects(arch):
    check_fallback(_MODELS[arch])


def check_fallback(model):
    """Masked rows and -1 rows: the router's own choice on the inputs it is given under replay (deeper layers
    see other hidden states than unpatched), computed by its unpatched forward."""
    model.eval()
    blocks = find_moe_blocks(model)
    L, k = len(blocks), k_of(model)
    ids = random_sets(B * S, L, k, seed=3)
    fell = torch.rand(B * S, L, generator=torch.Generator().manual_seed(4)) < 0.5
    ids[5, 0, 0] = -1
    fell[5, 0] = True
    mask = fell.clone()
    mask[5, 0] = False                                   # the -1 row falls back without being masked
    inputs = {}

    def keep(m):
        def hook(mod, args, kwargs):
            inputs.setdefault(m, ([a.clone() if torch.is_tensor(a) else a for a in args], dict(kwargs)))
        return hook
    routers = [getattr(blk, spec.router_attr) for _, blk, spec in blocks]
    hooks = [r.register_forward_pre_hook(keep(m), with_kwargs=True) for m, r in enumerate(routers)]
    try:
        with torch.no_grad(), record_selection(model) as sel, \
                replay_routing(model, ids.reshape(B, S, L, k), mask.reshape(B, S, L)) as stats:
            model(input_ids=tokens())
    finally:
        for h in hooks:
            h.remove()
    for m, (router, (_, _, spec)) in enumerate(zip(routers, blocks)):
        args, kwargs = inputs[m]
        with torch.no_grad():
            own = spec.family.ids_of(router, type(router).forward(router, *args, **kwargs))
        assert torch.equal(sel[m][0], torch.where(fell[:, m, None], own, ids[:, m])), m
        assert fell[:, m].any() and (~fell[:, m]).any()
    assert stats.fallback_rows == fell.sum(0).tolist()
    assert stats.replayed_rows == (B * S - fell.sum(0)).tolist()


@pytest.mark.archs
def test_router_gradients_flow(arch):
    check_router_grads(_MODELS[arch])


def check_router_grads(model):
    model.train()
    blocks = find_moe_blocks(model)
    L, k = len(blocks), k_of(model)
    ids = random_sets(B * S, L, k, seed=5)
    run(model, tokens(), expert_ids=ids.reshape(B, S, L, k))
    for m, (_, blk, spec) in enumerate(blocks):
        w = next(p for p in getattr(blk, spec.router_attr).parameters() if p.dim() == 2)     # the router's matrix
        used = ids.reshape(B, S, L, k)[:, :S - 1, m].unique()         # the last position has no label
        assert w.grad is not None and (w.grad[used].abs().sum(1) > 0).all(), m
    model.eval()


@pytest.mark.archs
@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3", "gpt_oss", "granitemoe", "llama4", "minimax_m2",
                                  "mixtral", "phimoe", "qwen3_moe"])
def test_own_ids_replay_exactly_in_bfloat16(name):
    """bf16 router logits tie often; the ids read from the routers' output (not a recomputed top-k) replay to
    the unpatched model exactly."""
    model_type, over = ARCHS[name]
    check_own_ids_exact(build(model_type, **over).to(torch.bfloat16))


@pytest.mark.archs
@pytest.mark.parametrize("name", ["deepseek_v3", "gpt_oss", "granitemoe", "llama4", "minimax_m2", "phimoe"])
def test_gradient_checkpointing_gives_the_same_grads(name):
    """The recompute in backward runs each router again (calls counted twice) on the same replay columns and, for
    Phi-MoE's sampled fallback rows, the same random draws (checkpointing restores the RNG state)."""
    model_type, over = ARCHS[name]
    model = build(model_type, **over).train()
    x = tokens()
    L, k = len(find_moe_blocks(model)), k_of(model)
    ids = random_sets(B * S, L, k, seed=7).reshape(B, S, L, k)
    mask = torch.zeros(B, S, L, dtype=torch.bool)
    mask[1, 2:] = True
    lo0, g0, s0, _ = run(model, x, expert_ids=ids, no_routing=mask)
    model.gradient_checkpointing_enable()
    try:
        lo1, g1, s1, _ = run(model, x, expert_ids=ids, no_routing=mask)
    finally:
        model.gradient_checkpointing_disable()
    assert s0.calls == [1] * L and s1.calls == [2] * L
    assert s1.fallback_rows == [2 * (S - 2)] * L
    assert torch.equal(lo0, lo1)
    assert sorted(g0) == sorted(g1) and [n for n in g0 if not torch.equal(g0[n], g1[n])] == []


@pytest.mark.archs
@pytest.mark.parametrize("name", sorted(MORE))
def test_more_architectures_replay_exactly(name):
    model_type, family, over = MORE[name]
    model = build(model_type, **over)
    assert {spec.family.name for _, _, spec in find_moe_blocks(model)} == {family}
    check_replayed_ids(model, name)
    check_own_ids_exact(model)
    check_fallback(model)
    check_router_grads(model)


@pytest.mark.parametrize("n_group,topk_group,bias", [(1, 1, 0.0), (4, 2, 0.0), (1, 1, 0.3), (4, 2, 0.3)],
                         ids=["plain", "groups", "bias", "groups+bias"])
def test_deepseek_v3_fallback_is_the_models_own_routing(n_group, topk_group, bias):
    """Every row falling back (all masked) is the unpatched model, logits and gradients: selection on sigmoid +
    e_score_correction_bias with groups masked, weights from the plain sigmoid."""
    model = build("deepseek_v3", n_routed_experts=E, n_shared_experts=1, first_k_dense_replace=0, n_group=n_group,
                  topk_group=topk_group, **_MLA).train()
    with torch.no_grad():
        for _, blk, _ in find_moe_blocks(model):
            blk.gate.e_score_correction_bias.normal_(0.0, 1.0).mul_(bias)
    x = tokens(seed=11)
    lo0, g0, _, own = run(model, x)
    L = len(own)
    lo1, g1, stats, got = run(model, x, expert_ids=random_sets(B * S, L, K).reshape(B, S, L, K),
                              no_routing=torch.ones(B, S, dtype=torch.bool))
    assert all(torch.equal(got[m], own[m]) for m in range(L))
    assert torch.equal(lo0, lo1) and [n for n in g0 if not torch.equal(g0[n], g1[n])] == []
    assert stats.fallback_rows == [B * S] * L and stats.replayed_rows == [0] * L


def test_aux_loss_counts_the_routers_own_topk():
    """Under replay the load-balancing loss is computed from the router logits: it counts the routers' own
    top-k of them, not the replayed experts."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    model = build("qwen3_moe", **ARCHS["qwen3_moe"][1]).eval()
    model.config.router_aux_loss_coef = 0.01
    L = len(find_moe_blocks(model))
    ids = random_sets(B * S, L, K, seed=9).reshape(B, S, L, K)
    with torch.no_grad(), replay_routing(model, ids):
        out = model(input_ids=tokens(), output_router_logits=True)
    assert len(out.router_logits) == L
    assert torch.equal(out.aux_loss, load_balancing_loss_func(out.router_logits, E, K))
    # the replayed experts' counts would give another number
    probs = torch.cat([torch.softmax(g, -1) for g in out.router_logits])
    counts = torch.nn.functional.one_hot(ids.permute(2, 0, 1, 3).reshape(-1, K), E).float().mean(0)
    assert not torch.allclose(out.aux_loss, (counts * probs.mean(0)).sum() * E)


# ---- refusals -----------------------------------------------------------------------------------------------

UNSUPPORTED = {
    "jamba": ("jamba", dict(num_experts=E, num_hidden_layers=2, attn_layer_period=1, attn_layer_offset=0,
                            expert_layer_period=1, expert_layer_offset=0, use_mamba_kernels=False),
              r"JambaSparseMoeBlock"),
    "jetmoe": ("jetmoe", dict(num_local_experts=E, kv_channels=8), r"JetMoeTopKGating"),
    "deepseek_v4": ("deepseek_v4", dict(n_routed_experts=E, num_hash_layers=1), r"DeepseekV4HashRouter"),
    "doge": ("doge", dict(num_experts=16, is_moe=True), r"DogeCDMoE"),
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_unsupported_routers_are_refused_by_name(name):
    model_type, over, pattern = UNSUPPORTED[name]
    model = build(model_type, **over)
    refusal = rf"replay_routing does not support \w+ForCausalLM: its .*{pattern} \(model\.layers\.\d+\.\w+"
    with pytest.raises(ValueError, match=refusal):
        with replay_routing(model, torch.zeros(B, S, 2, K, dtype=torch.long)):
            pass
    assert not any("forward" in vars(m) for m in model.modules())


def test_register_moe_block_checks_the_spec_against_the_router_code():
    from transformers.models.granitemoe import modeling_granitemoe  # noqa: F401  (imports the router class)
    softmax = next(f for f in R.FAMILIES if f.name == "softmax_topk")
    with pytest.raises(ValueError, match=r"GraniteMoeMoE: GraniteMoeTopKRouter.forward \(code [0-9a-f]{16}\) is not "
                                         r"a router family 'softmax_topk' reproduces .*family 'granite' reproduces it"):
        register_moe_block("GraniteMoeMoE", MoEBlockSpec("router", "GraniteMoeTopKRouter", softmax))
    with pytest.raises(TypeError, match=r"spec.family must be a routers.RouterFamily"):
        register_moe_block("GraniteMoeMoE", MoEBlockSpec("router", "GraniteMoeTopKRouter", lambda r, h: h))
    with pytest.raises(ValueError, match=r"router_attr 'a.b' is not an attribute name"):
        register_moe_block("GraniteMoeMoE", MoEBlockSpec("a.b", "GraniteMoeTopKRouter", softmax))
    assert "GraniteMoeMoE" not in MOE_BLOCKS


@pytest.fixture
def registry():
    saved = dict(MOE_BLOCKS)
    yield MOE_BLOCKS
    MOE_BLOCKS.clear()
    MOE_BLOCKS.update(saved)
    for key in [key for key in _conforming() if key[1].startswith("mine")]:
        _conforming().discard(key)


def _conforming():
    from routing_replay.replay import hf
    return hf._CONFORMING


def test_a_registered_block_is_checked_when_its_router_is_found(registry):
    """Jamba's router is a plain nn.Linear (the block routes inline): registered with a built-in family, the
    model is refused before anything runs, naming the router's code."""
    model_type, over, _ = UNSUPPORTED["jamba"]
    model = build(model_type, **over)
    softmax = next(f for f in R.FAMILIES if f.name == "softmax_topk")
    register_moe_block("JambaSparseMoeBlock", MoEBlockSpec("router", "Linear", softmax))
    with pytest.raises(ValueError, match=r"JambaSparseMoeBlock: Linear.forward \(code [0-9a-f]{16}\) is not a router "
                                         r"family 'softmax_topk' reproduces .* no built-in family reproduces it"):
        with replay_routing(model, torch.zeros(B, S, 2, K, dtype=torch.long)):
            pass
    assert not any("forward" in vars(m) for m in model.modules())


def test_a_family_of_ones_own_is_checked_on_the_first_call(registry):
    """A family without fingerprints that reproduces the router runs; one that does not is refused on the
    router's first call, naming both, with the model restored."""
    model = build("qwen2_moe", **ARCHS["qwen2_moe"][1]).eval()
    L = len(find_moe_blocks(model))
    ids = random_sets(B * S, L, K).reshape(B, S, L, K)
    good = RouterFamily("mine", R._softmax_topk, R._third)
    register_moe_block("Qwen2MoeSparseMoeBlock", MoEBlockSpec("gate", "Qwen2MoeTopKRouter", good))
    with torch.no_grad(), record_selection(model) as sel, replay_routing(model, ids):
        model(input_ids=tokens())
    assert torch.equal(sel[0][0], ids[:, :, 0].reshape(-1, K))
    bad = RouterFamily("mine_wrong", R._mixtral, R._third)           # no cast, always normalised: not Qwen2's
    register_moe_block("Qwen2MoeSparseMoeBlock", MoEBlockSpec("gate", "Qwen2MoeTopKRouter", bad))
    with pytest.raises(ValueError, match=r"router family 'mine_wrong' does not reproduce Qwen2MoeTopKRouter.forward"):
        with torch.no_grad(), replay_routing(model, ids):
            model(input_ids=tokens())
    assert not any("forward" in vars(m) for m in model.modules())
