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
                vocab_size: int = 512, dtype: str = "float32"):
    from transformers import MixtralConfig, Qwen3MoeConfig

    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                  num_attention_heads=hidden_size // 64, num_key_value_heads=1, head_dim=64,
                  max_position_embeddings=8192, tie_word_embeddings=False, bos_token_id=256, eos_token_id=256,
                  pad_token_id=257)
    if arch in ("qwen3_moe", "qwen3_moe_mixed"):
        mlp_only = [1] if arch == "qwen3_moe_mixed" else []
        if arch == "qwen3_moe_mixed" and num_layers >= 5:
            mlp_only = [1, num_layers - 2]
        cfg = Qwen3MoeConfig(intermediate_size=4 * hidden_size, moe_intermediate_size=hidden_size,
                             num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=True,
                             decoder_sparse_step=1, mlp_only_layers=mlp_only, **common)
        cfg.architectures = ["Qwen3MoeForCausalLM"]
    elif arch == "mixtral":
        cfg = MixtralConfig(intermediate_size=hidden_size, num_local_experts=num_experts,
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
                    dtype: str = "float32", peaked: bool = False) -> Path:
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
    """
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    stamp = dict(arch=arch, seed=seed, num_layers=num_layers, num_experts=num_experts, top_k=top_k,
                 hidden_size=hidden_size, router_std=router_std, dtype=dtype)
    if peaked:
        stamp["peaked"] = True
    marker = out / "routing_replay_model.json"
    if marker.exists() and json.loads(marker.read_text()) == stamp:
        return out
    out.mkdir(parents=True, exist_ok=True)
    vocab = _tokenizer(out)
    cfg = make_config(arch, num_layers=num_layers, num_experts=num_experts, top_k=top_k, hidden_size=hidden_size,
                      vocab_size=max(512, vocab), dtype=dtype)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                continue
            if name.endswith("gate.weight") and p.shape[0] == num_experts:
                p.normal_(0.0, router_std)
            elif peaked and name == "lm_head.weight":
                p.normal_(0.0, PEAKED_LM_HEAD_STD)
            elif peaked and ".experts." in name:
                p.normal_(0.0, PEAKED_EXPERT_STD)
            else:
                p.normal_(0.0, 0.05)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    marker.write_text(json.dumps(stamp))
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
