"""Generate tiny random-weight MoE checkpoints (Qwen3-MoE, Mixtral and the other MoE families in ARCHS) on local disk.

Nothing is downloaded: the config, the weights (seeded) and a byte-level tokenizer are made here and saved in
HF format, loadable by transformers and by vLLM. `python -m routing_replay.apps.models DIR --arch qwen3_moe`.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

ARCHS = ("qwen3_moe", "qwen3_moe_mixed", "mixtral", "qwen2_moe", "olmoe", "phimoe", "gpt_oss", "deepseek_v2",
         "deepseek_v3", "glm4_moe", "dots1", "minimax_m2", "granitemoe", "llama4", "qwen3_next", "qwen3_5_moe")
# Routers that select on sigmoid scores plus `e_score_correction_bias` (DeepSeek-V3 style): a router std that keeps
# the logits around +-2, so that the sigmoid does not saturate to 1.0 (exact float32 ties) and the bias, drawn with
# std SIGMOID_BIAS_STD, changes choices
SIGMOID_ROUTER_STD = 0.15
SIGMOID_BIAS_STD = 0.1
SIGMOID_ARCHS = ("deepseek_v3", "glm4_moe", "dots1", "minimax_m2")
CONFIG_VERSION = 5          # of _other_config; part of those architectures' marker
PEAKED_LM_HEAD_STD = 0.4        # make_tiny_model(peaked=True): see its docstring
PEAKED_EXPERT_STD = 0.1


def _tokenizer(out: Path) -> int:
    """Write a byte-level BPE tokenizer with no merges (256 byte tokens + specials). Returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|pad|>"]
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")
    fast.save_pretrained(out)
    return len(vocab) + len(specials)


def make_config(arch: str, *, num_layers: int = 4, num_experts: int = 8, top_k: int = 2, hidden_size: int = 128,
                vocab_size: int = 512, dtype: str = "float32", moe_intermediate_size: int | None = None,
                num_attention_heads: int | None = None, num_key_value_heads: int | None = None,
                head_dim: int | None = None):
    """The config of make_tiny_model. The shape arguments left None keep the tiny defaults: expert (MoE)
    intermediate size = hidden_size, hidden_size // 64 query heads, 1 KV head, head_dim 64."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                  num_attention_heads=num_attention_heads or hidden_size // 64,
                  num_key_value_heads=num_key_value_heads or 1, head_dim=head_dim or 64,
                  max_position_embeddings=8192, tie_word_embeddings=False, bos_token_id=256, eos_token_id=256,
                  pad_token_id=257)
    moe_inter = moe_intermediate_size or hidden_size
    if arch in ("qwen3_moe", "qwen3_moe_mixed"):
        mlp_only = [1] if arch == "qwen3_moe_mixed" else []
        if arch == "qwen3_moe_mixed" and num_layers >= 5:
            mlp_only = [1, num_layers - 2]
        cfg = Qwen3MoeConfig(intermediate_size=4 * hidden_size, moe_intermediate_size=moe_inter,
                             num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=True,
                             decoder_sparse_step=1, mlp_only_layers=mlp_only, **common)
        cfg.architectures = ["Qwen3MoeForCausalLM"]
    elif arch == "mixtral":
        cfg = MixtralConfig(intermediate_size=moe_inter, num_local_experts=num_experts,
                            num_experts_per_tok=top_k, sliding_window=None, **common)
        cfg.architectures = ["MixtralForCausalLM"]
    elif arch in ARCHS:
        cfg = _other_config(arch, common, num_experts, top_k, moe_inter, hidden_size)
    else:
        raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS}")
    cfg.torch_dtype = dtype
    return cfg


def _other_config(arch: str, common: dict, num_experts: int, top_k: int, moe_inter: int, hidden_size: int):
    """Tiny configs of the MoE families beyond Qwen3-MoE and Mixtral, as vLLM's CPU build needs them: the
    `architectures` name is vLLM's (PhiMoE), MLA has the head dims vLLM's MLA accepts (128 nope + 64 rope, v 128;
    latent 512 + 64 rope = 576), DeepSeek-V3 style routers get `topk_method="noaux_tc"` (vLLM applies the
    correction bias only then), 4 groups of which 2 are kept, and the first layer dense (first_k_dense_replace=1,
    as the real models have)."""
    from transformers import AutoConfig

    c = dict(common)
    head = c.pop("head_dim")
    if arch in ("deepseek_v2", "deepseek_v3"):     # MLA: one latent KV per query head
        c["num_key_value_heads"] = c["num_attention_heads"]
    mla = dict(kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    ds = dict(n_routed_experts=num_experts, n_shared_experts=1, num_experts_per_tok=top_k,
              moe_intermediate_size=moe_inter, intermediate_size=4 * hidden_size, first_k_dense_replace=1)
    groups = dict(n_group=4, topk_group=2) if num_experts % 4 == 0 else dict(n_group=1, topk_group=1)
    if arch == "qwen2_moe":
        kw = dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_inter,
                  shared_expert_intermediate_size=2 * hidden_size, intermediate_size=4 * hidden_size,
                  norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[])
        model_type, name = "qwen2_moe", "Qwen2MoeForCausalLM"
    elif arch == "olmoe":
        kw = dict(num_experts=num_experts, num_experts_per_tok=top_k, intermediate_size=moe_inter)
        model_type, name = "olmoe", "OlmoeForCausalLM"
    elif arch == "phimoe":
        if top_k != 2:
            raise ValueError(f"phimoe routes with sparsemixer, which picks exactly 2 experts; top_k={top_k}")
        kw = dict(num_local_experts=num_experts, num_experts_per_tok=2, intermediate_size=moe_inter)
        model_type, name = "phimoe", "PhiMoEForCausalLM"
    elif arch == "gpt_oss":
        kw = dict(num_local_experts=num_experts, num_experts_per_tok=top_k, intermediate_size=moe_inter,
                  head_dim=head, sliding_window=128)
        model_type, name = "gpt_oss", "GptOssForCausalLM"
    elif arch == "deepseek_v2":
        # group_limited_greedy scores a group by its best expert: with topk_group >= top_k the top-k always lie in
        # the kept groups, so one group is kept (its experts are the choice) and the limit changes choices
        kw = dict(**ds, **mla, n_group=groups["n_group"], topk_group=1,
                  topk_method="group_limited_greedy" if groups["n_group"] > 1 else "greedy")
        model_type, name = "deepseek_v2", "DeepseekV2ForCausalLM"
    elif arch == "deepseek_v3":
        # scoring_func: vLLM's DeepSeek reads it (default softmax); transformers' DeepSeek-V3 always scores with
        # sigmoid, as the released checkpoints say in their config
        kw = dict(**ds, **mla, **groups, norm_topk_prob=True, routed_scaling_factor=2.5, topk_method="noaux_tc",
                  scoring_func="sigmoid")
        model_type, name = "deepseek_v3", "DeepseekV3ForCausalLM"
    elif arch == "glm4_moe":
        kw = dict(**ds, **groups, head_dim=head, norm_topk_prob=True, routed_scaling_factor=2.5,
                  topk_method="noaux_tc")
        model_type, name = "glm4_moe", "Glm4MoeForCausalLM"
    elif arch == "dots1":
        kw = dict(**ds, **groups, norm_topk_prob=True, routed_scaling_factor=2.5, topk_method="noaux_tc")
        model_type, name = "dots1", "Dots1ForCausalLM"
    elif arch == "minimax_m2":
        kw = dict(num_local_experts=num_experts, num_experts_per_tok=top_k, intermediate_size=moe_inter,
                  head_dim=head, rotary_dim=head // 2, scoring_func="sigmoid", use_routing_bias=True)
        model_type, name = "minimax_m2", "MiniMaxM2ForCausalLM"
    elif arch == "granitemoe":
        kw = dict(num_local_experts=num_experts, num_experts_per_tok=top_k, intermediate_size=moe_inter)
        model_type, name = "granitemoe", "GraniteMoeForCausalLM"
    elif arch == "llama4":
        kw = dict(num_local_experts=num_experts, num_experts_per_tok=1, intermediate_size=moe_inter,
                  intermediate_size_mlp=4 * hidden_size, head_dim=head, interleave_moe_layer_step=1)
        model_type, name = "llama4_text", "Llama4ForCausalLM"
    elif arch in ("qwen3_next", "qwen3_5_moe"):
        n = c["num_hidden_layers"]
        kw = dict(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_inter,
                  shared_expert_intermediate_size=moe_inter, head_dim=head, linear_key_head_dim=128,
                  linear_value_head_dim=128, linear_num_key_heads=1, linear_num_value_heads=2,   # vLLM CPU's GDN: 128
                  layer_types=["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(n)])
        if arch == "qwen3_next":
            kw.update(intermediate_size=4 * hidden_size, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[])
            model_type, name = "qwen3_next", "Qwen3NextForCausalLM"
        else:
            model_type, name = "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"
    else:
        raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS}")
    cfg = AutoConfig.for_model(model_type, **c, **kw)
    cfg.architectures = [name]
    return cfg


def moe_layer_ids(cfg) -> list[int]:
    """The model's layer index of each MoE layer, in order (dense layers from mlp_only_layers are skipped)."""
    only = set(getattr(cfg, "mlp_only_layers", None) or [])
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    first = getattr(cfg, "first_k_dense_replace", 0) or 0
    n_exp = (getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
             or getattr(cfg, "n_routed_experts", None) or 0)
    return [i for i in range(cfg.num_hidden_layers)
            if i not in only and i >= first and n_exp > 0 and (i + 1) % step == 0]


def make_tiny_model(out_dir: str | os.PathLike, arch: str = "qwen3_moe", *, seed: int = 0, num_layers: int = 4,
                    num_experts: int = 8, top_k: int = 2, hidden_size: int = 128, router_std: float | None = None,
                    dtype: str = "float32", peaked: bool = False, vocab_size: int | None = None,
                    moe_intermediate_size: int | None = None, num_attention_heads: int | None = None,
                    num_key_value_heads: int | None = None, head_dim: int | None = None,
                    fan_in_ref: int | None = None, device: str | None = None, timings: dict | None = None) -> Path:
    """Write a random-weight checkpoint to out_dir (idempotent for the same arguments) and return the path.

    Router weights get a larger std than the rest so that top-k choices are rarely near-tied: the oracle
    comparison against vLLM is then exact in float32. router_std None: 1.0, or SIGMOID_ROUTER_STD for the
    sigmoid-scored routers (SIGMOID_ARCHS), whose `e_score_correction_bias` gets std SIGMOID_BIAS_STD.

    peaked=True (the R3 measurement's model, routing_replay.apps.r3): with every weight at std 0.05 the
    next-token logits are nearly uniform (std about 0.6 over 512 tokens), so a flipped expert hardly moves a
    token's log-probability. Here the lm_head gets std PEAKED_LM_HEAD_STD (logits std about 4.5: peaked
    next-token distributions) and the expert weights std PEAKED_EXPERT_STD (each expert's output dominates the
    residual stream, so experts are distinct and a different expert set gives a different distribution).
    The same seed draws the same numbers; only those two scales differ. peaked=False leaves the model exactly
    as before (same weights, same marker file).

    Larger shapes (bench/r3_gpu.py: Qwen3-30B-A3B's layer): vocab_size (None: 512, at least the tokenizer's),
    moe_intermediate_size, num_attention_heads, num_key_value_heads, head_dim (None: make_config's tiny values).
    fan_in_ref=F scales the std of every weight that multiplies an activation (all but the token embedding and
    the norms; the router too, router_std included) by sqrt(F / fan_in), fan_in = the weight's last dimension
    (nn.Linear's in_features; the fused expert tensors (E, out, in) alike). With F = 128, the tiny width, a
    wider model keeps the tiny model's activation statistics: the same router logit std (router_std *
    sqrt(128)), the same peaked lm_head logits (std about 4.5), expert outputs of the same size against the
    residual stream. device: generate the weights there, directly in `dtype` (fast on a GPU; the numbers differ
    from a CPU float32 generation of the same seed). All of these left None keep the model exactly as before;
    each one given is part of the marker. timings: a dict to receive generate_s and save_s (seconds; both 0.0
    when the marker matched and nothing was written).
    """
    import math
    import time

    import torch
    from transformers import AutoModelForCausalLM

    if router_std is None:
        router_std = SIGMOID_ROUTER_STD if arch in SIGMOID_ARCHS else 1.0
    out = Path(out_dir)
    stamp = dict(arch=arch, seed=seed, num_layers=num_layers, num_experts=num_experts, top_k=top_k,
                 hidden_size=hidden_size, router_std=router_std, dtype=dtype)
    if peaked:
        stamp["peaked"] = True
    if arch not in ("qwen3_moe", "qwen3_moe_mixed", "mixtral"):
        stamp["config"] = CONFIG_VERSION      # a changed _other_config must not reuse an older checkpoint
    shape = dict(moe_intermediate_size=moe_intermediate_size, num_attention_heads=num_attention_heads,
                 num_key_value_heads=num_key_value_heads, head_dim=head_dim)
    extra = dict(vocab_size=vocab_size, fan_in_ref=fan_in_ref, device=device, **shape)
    stamp.update({k: v for k, v in extra.items() if v is not None})
    marker = out / "routing_replay_model.json"
    if timings is not None:
        timings.update(generate_s=0.0, save_s=0.0)
    if marker.exists() and json.loads(marker.read_text()) == stamp:
        return out
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    vocab = _tokenizer(out)
    cfg = make_config(arch, num_layers=num_layers, num_experts=num_experts, top_k=top_k, hidden_size=hidden_size,
                      vocab_size=max(vocab_size or 512, vocab), dtype=dtype, **shape)
    names = list(cfg.architectures)             # (save_pretrained overwrites the config's with transformers' class)
    torch.manual_seed(seed)
    if device is None:
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    else:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))

    def std(name: str, p, base: float) -> float:
        if fan_in_ref is None or name.endswith("embed_tokens.weight"):
            return base
        return base * math.sqrt(fan_in_ref / p.shape[-1])

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                continue
            if name.endswith(("gate.weight", "router.weight")) and p.shape[0] == num_experts:
                p.normal_(0.0, std(name, p, router_std))
            elif peaked and name == "lm_head.weight":
                p.normal_(0.0, std(name, p, PEAKED_LM_HEAD_STD))
            elif peaked and ".experts." in name:
                p.normal_(0.0, std(name, p, PEAKED_EXPERT_STD))
            else:
                p.normal_(0.0, std(name, p, 0.05))
        for name, b in model.named_buffers():     # after every parameter: the parameters' draws stay the same
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, SIGMOID_BIAS_STD)
    model = model.to(getattr(torch, dtype))
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    t1 = time.perf_counter()
    model.save_pretrained(out, safe_serialization=True)
    saved = json.loads((out / "config.json").read_text())
    if saved.get("architectures") != names:     # vLLM resolves PhiMoE only by its own name (PhiMoEForCausalLM)
        saved["architectures"] = names
        (out / "config.json").write_text(json.dumps(saved, indent=2))
    marker.write_text(json.dumps(stamp))
    if timings is not None:
        timings.update(generate_s=t1 - t0, save_s=time.perf_counter() - t1)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m routing_replay.apps.models", description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--arch", choices=ARCHS, default="qwen3_moe")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--num-experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--peaked", action="store_true", help="peaked next-token logits and distinct experts (R3)")
    a = ap.parse_args(argv)
    p = make_tiny_model(a.out_dir, a.arch, seed=a.seed, num_layers=a.num_layers, num_experts=a.num_experts,
                        top_k=a.top_k, hidden_size=a.hidden_size, dtype=a.dtype, peaked=a.peaked)
    print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
