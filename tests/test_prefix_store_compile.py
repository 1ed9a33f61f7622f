"""The prefix store under torch.compile (CPU, real Inductor): a RoutingCache flush traced into a compiled function
with its guards dropped (as vLLM compiles) keeps the branches it took at trace time, so a store attached after the
trace is never written by it (what vLLM's CPU build did to ROUTING_REPLAY_PREFIX_ROWS=fill without enforce_eager:
it compiles the MoE block, hooks included, before the KV cache and so the store exist). `store_step` after the
forward writes it; the cache says whether its flush was traced and with which store, and a graph engine whose
flush was traced without one refuses to start."""

from __future__ import annotations

import types

import pytest
import torch

from routing_replay.capture import PrefixStore, RoutingCache

L, K, N, SLOTS = 3, 2, 5, 16


def _model(cache):
    def forward(x):
        for layer in range(L):
            ids = torch.topk(x * (layer + 1) + torch.arange(8, dtype=x.dtype), K, dim=-1).indices
            cache.record(layer, ids)                # the last layer's record flushes
        return x + 1
    # as vLLM compiles a model: every guard dropped (compilation/wrapper.py), so nothing ever recompiles it
    return torch.compile(forward, fullgraph=True, backend="inductor",
                         options={"guard_filter_fn": lambda guards: [False for _ in guards]})


def _ids(x):
    return torch.stack([torch.topk(x * (layer + 1) + torch.arange(8, dtype=x.dtype), K, dim=-1).indices
                        for layer in range(L)], 1).to(torch.int16)


def test_flush_traced_before_the_store_never_writes_it_and_store_step_does():
    torch._dynamo.reset()
    cache = RoutingCache(N, L, K)
    fwd = _model(cache)
    x = torch.randn(N, 8)
    fwd(x)                                          # traced and compiled here, no store attached
    assert cache.traced and not cache.traced_store
    store = PrefixStore(SLOTS, L, K)
    slots = torch.tensor([3, 4, 5, 9, -1] + [-1] * 11, dtype=torch.int64)
    cache.attach_store(store, slots)                # in_flush=True: what the worker did before
    y = torch.randn(N, 8)
    fwd(y)
    assert cache.store_writes == 0 and (store.rows == -1).all()     # the compiled flush never writes the store
    assert torch.equal(cache.step_rows(N).transpose(0, 1), _ids(y))  # (its rows into the cache, yes)
    cache.attach_store(store, slots, in_flush=False)
    fwd(y)
    cache.store_step(N)                             # after the forward, in Python: what post_step does now
    assert cache.store_writes == 1
    assert torch.equal(store.rows[[3, 4, 5, 9]], _ids(y)[:4])
    assert (store.rows[[0, 1, 2, 6, 7, 8, 10, 11, 12, 13, 14, 15]] == -1).all()
    assert torch.equal(store.table[-1], _ids(y)[4])  # the padded token's row lands in the spare row
    cache.store_step(N, complete=False)             # a step whose hooks did not all record: its slots forgotten
    assert (store.rows == -1).all()


def test_flush_traced_with_the_store_writes_it():
    torch._dynamo.reset()
    cache = RoutingCache(N, L, K)
    store = PrefixStore(SLOTS, L, K)
    slots = torch.tensor([1, 2, 3, 4, 5] + [-1] * 11, dtype=torch.int64)
    cache.attach_store(store, slots)
    fwd = _model(cache)
    x = torch.randn(N, 8)
    fwd(x)
    assert cache.traced and cache.traced_store
    assert torch.equal(store.rows[1:6], _ids(x))


def test_graph_engine_with_a_flush_traced_without_the_store_refuses_naming_the_mode():
    """PrefixRows.check_captured (WorkerCapture.check_captured_store), after vLLM's warm-up (CUDA graph modes cannot run here: the worker's
    state is set as a graph engine's would be)."""
    from routing_replay.engines.vllm_plugin.prefix_rows import PrefixRows

    cache = types.SimpleNamespace(traced=True, traced_store=False, store_writes=0, incomplete_flushes=0,
                                  device=torch.device("cpu"))
    cc = types.SimpleNamespace(mode="CompilationMode.VLLM_COMPILE", cudagraph_mode="CUDAGraphMode.FULL_AND_PIECEWISE")
    runner = types.SimpleNamespace(vllm_config=types.SimpleNamespace(compilation_config=cc))
    prefix = PrefixRows(runner, "v1", cache, None, None, None, fill=True, max_batch_steps=16, max_batch_rows=1,
                        flush=lambda: None)
    prefix.store = PrefixStore(SLOTS, L, K)
    binding = types.SimpleNamespace(gate=False, bound=lambda: True)
    with pytest.raises(NotImplementedError, match=r"ROUTING_REPLAY_PREFIX_ROWS=fill cannot run under this execution "
                                                  r"mode \(compilation mode CompilationMode.VLLM_COMPILE, "
                                                  r"cudagraph_mode CUDAGraphMode.FULL_AND_PIECEWISE\)"):
        prefix.check_captured(binding)
    cache.traced_store = True                       # traced with the store: the graphs write it
    prefix.check_captured(binding)
    cache.traced = False                            # the hooks ran in Python (vLLM's opaque MoE op on CUDA)
    prefix.check_captured(binding)
