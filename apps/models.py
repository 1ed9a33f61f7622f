"""Generate tiny random-weight MoE checkpoints (Qwen3-MoE, Qwen3-MoE with dense layers, Mixtral) on local disk.

Nothing is downloaded: the config, the weights (seeded) and a byte-level tokenizer are made here and saved in
HF format, loadable by transformers and by vLLM. `python -m routing_replay.apps.models DIR --arch qwen3_moe`.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

ARCHS = ("qwen3_moe", "qwen3_moe_mixed", "mixtral")
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
    else:
        raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS}")
    cfg.torch_dtype = dtype
    return cfg


def moe_layer_ids(cfg) -> list[int]:
    """The model's layer index of each MoE layer, in order (dense layers from mlp_only_layers are skipped)."""
    only = set(getattr(cfg, "mlp_only_layers", None) or [])
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    n_exp = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", 0)
    return [i for i in range(cfg.num_hidden_layers) if i not in only and n_exp > 0 and (i + 1) % step == 0]


def make_tiny_model(out_dir: str | os.PathLike, arch: str = "qwen3_moe", *, seed: int = 0, num_layers: int = 4,
                    num_experts: int = 8, top_k: int = 2, hidden_size: int = 128, router_std: float = 1.0,
                    dtype: str = "float32", peaked: bool = False, vocab_size: int | None = None,
                    moe_intermediate_size: int | None = None, num_attention_heads: int | None = None,
                    num_key_value_heads: int | None = None, head_dim: int | None = None,
                    fan_in_ref: int | None = None, device: str | None = None, timings: dict | None = None) -> Path:
    """Write a random-weight checkpoint to out_dir (idempotent for the same arguments) and return the path.

    Router weights get a larger std than the rest so that top-k choices are rarely near-tied: the oracle
    comparison against vLLM is then exact in float32.

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

    out = Path(out_dir)
    stamp = dict(arch=arch, seed=seed, num_layers=num_layers, num_experts=num_experts, top_k=top_k,
                 hidden_size=hidden_size, router_std=router_std, dtype=dtype)
    if peaked:
        stamp["peaked"] = True
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
            if name.endswith("gate.weight") and p.shape[0] == num_experts:
                p.normal_(0.0, std(name, p, router_std))
            elif peaked and name == "lm_head.weight":
                p.normal_(0.0, std(name, p, PEAKED_LM_HEAD_STD))
            elif peaked and ".experts." in name:
                p.normal_(0.0, std(name, p, PEAKED_EXPERT_STD))
            else:
                p.normal_(0.0, std(name, p, 0.05))
    model = model.to(getattr(torch, dtype))
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    t1 = time.perf_counter()
    model.save_pretrained(out, safe_serialization=True)
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
