"""Capture the routing of Hugging Face transformers MoE models through router hooks and publish it per generation step.

Second engine beside vLLM, for trainers and tests that run HF models directly. The MoE blocks and their routers
are the trainer side's (`replay.hf.find_moe_blocks`: routers found by their code, whatever the module is called:
`mlp.gate`, `block_sparse_moe.router`, `feed_forward.router`, ...), and a forward hook on each router hands the
ids it selected, read from its output by its router family (`replay.routers.RouterFamily.ids_of`: position 2 of
Qwen3-MoE's and DeepSeek-V3's output, position 0 of Granite's and Aria's, the nonzero scores of Llama-4's dense
ones), (n, K), to `RoutingCache.record(moe_index, ...)`. MoE index i is the i-th MoE layer in model order;
`moe_layer_ids[i]` is its decoder layer index (they differ when `mlp_only_layers` or `first_k_dense_replace` make
some layers dense). A model with a router no family reproduces is refused by `find_moe_blocks`, by name.

`HFRoutingAdapter.generate` runs a greedy generation loop (prefill, then one token per step with the KV cache)
over a batch of equal-length prompts and publishes, per step, the rows of the requests still running:
`sink.open(...)` once per request, `sink.publish_rows(ids, starts, counts, pending)` per step, and
`sink.finish(...)` when a request stops. Positions are absolute: the prefill publishes rows 0..P-1, decode step
j publishes row P+j-1 (output token j-1 being fed); the last output token is never fed and has no row.

`sink` is anything with the Producer's open/publish_rows/finish methods (producer.Producer in production).
This module imports neither zmq nor the producer, so it runs on machines without them.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch

from routing_replay.capture import AsyncCopier, RoutingCache
from routing_replay.protocol.ids import record_key_for
from routing_replay.replay.hf import find_moe_blocks

def find_moe_routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module, Callable]]:
    """(decoder layer index, router module, ids_of) of every MoE layer, in layer order: `ids_of(output)` is the
    (n, K) ids the router selected, read from its forward's output (`replay.hf.find_moe_blocks` and the router's
    family). Raises ValueError naming a router no family reproduces."""
    found = []
    for layer, block, spec in find_moe_blocks(model):
        router = getattr(block, spec.router_attr)
        found.append((layer, router, functools.partial(spec.family.ids_of, router)))
    return found


class HFRoutingAdapter:
    """Own the router hooks on one HF MoE model, the RoutingCache and AsyncCopier they feed, and the
    generation loop that publishes each step's rows to a sink."""

    def __init__(self, model: torch.nn.Module, sink: Any = None, *, max_tokens: int = 4096, num_slots: int = 2,
                 fused: bool = True):
        routers = find_moe_routers(model)
        if not routers:
            raise ValueError(f"{type(model).__name__} has no MoE router modules (replay.hf.find_moe_blocks)")
        top_ks = {int(r.top_k) for _, r, _ in routers}
        if len(top_ks) != 1:
            raise ValueError(f"MoE layers disagree on top_k: {sorted(top_ks)}")
        self.model = model
        self.sink = sink
        self.moe_layer_ids = [i for i, _, _ in routers]
        self.num_layers = len(routers)
        self.top_k = top_ks.pop()
        self.device = next(model.parameters()).device
        self.cache = RoutingCache(max_tokens, self.num_layers, self.top_k, device=self.device, fused=fused)
        self.copier = AsyncCopier(self.cache, num_slots=num_slots)
        self._hooks = [router.register_forward_hook(self._hook(i, ids_of))
                       for i, (_, router, ids_of) in enumerate(routers)]

    def _hook(self, moe_index: int, ids_of: Callable):
        record = self.cache.record

        def hook(module, args, output):
            record(moe_index, ids_of(output))
        return hook

    def close(self) -> None:
        """Remove the router hooks (idempotent); the model then runs exactly as without the adapter."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def generate(self, prompts: Sequence[Sequence[int]], *, request_ids: Sequence[str], max_new_tokens: int,
                 eos_token_id: int | None = None, sink: Any = None) -> list[list[int]]:
        """Greedy-generate up to max_new_tokens tokens for each of a batch of equal-length prompts, publishing
        the routing of every step to `sink` (default: the adapter's). Returns each request's output tokens.

        A request stops after emitting eos_token_id (included in its output) or max_new_tokens tokens; it keeps
        being fed as padding while others run, but publishes nothing more. Its record key is
        `protocol.ids.record_key_for(request_id)`: the id itself unless it cannot travel (docs/VLLM.md).
        """
        sink = sink if sink is not None else self.sink
        if sink is None:
            raise ValueError("generate() needs a sink (a Producer or anything with open/publish_rows/finish)")
        if not self._hooks:
            raise RuntimeError("adapter is closed")
        B = len(prompts)
        if B == 0 or len(request_ids) != B:
            raise ValueError(f"{B} prompts, {len(request_ids)} request ids")
        P = len(prompts[0])
        if P == 0 or any(len(p) != P for p in prompts):
            raise ValueError(f"prompts must be non-empty and of equal length, got lengths {[len(p) for p in prompts]}")
        if B * P > self.cache.max_tokens:
            raise ValueError(f"prefill of {B}x{P} tokens exceeds the cache's max_tokens={self.cache.max_tokens}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        rids = [record_key_for(str(r)) for r in request_ids]       # an id that cannot travel: derived key
        for rid, p in zip(rids, prompts):
            sink.open(rid, prompt_len=P, num_cached_tokens=0, prompt_token_ids=list(p))
        outputs: list[list[int]] = [[] for _ in range(B)]
        running = list(range(B))
        feed = torch.tensor([list(p) for p in prompts], dtype=torch.long, device=self.device)
        past = None
        pos = 0
        with torch.inference_mode():
            while running:
                out = self.model(input_ids=feed, past_key_values=past, use_cache=True, logits_to_keep=1)
                past = out.past_key_values
                S = feed.shape[1]
                # the forward's rows leave the device before the host reads the logits (which syncs)
                pending = self.copier.submit([(b * S, S) for b in running])
                sink.publish_rows([rids[b] for b in running], [pos] * len(running), [S] * len(running), pending)
                nxt = out.logits[:, -1].argmax(-1)
                tokens = nxt.tolist()
                still = []
                for b in running:
                    outputs[b].append(tokens[b])
                    if tokens[b] == eos_token_id or len(outputs[b]) >= max_new_tokens:
                        sink.finish(rids[b], num_output_tokens=len(outputs[b]),
                                    finish_reason="stop" if tokens[b] == eos_token_id else "length",
                                    prompt_len=P, num_cached_tokens=0, output_token_ids=outputs[b])
                    else:
                        still.append(b)
                running = still
                pos += S
                feed = nxt[:, None]
        return outputs
