"""Find the MoE layers of a loaded vLLM model and point their routers' capture hooks at one RoutingCache.

How the hook is reached (vLLM 0.25.1, 0.30 to 0.32 alike): every MoE block is a `MoERunner` module holding a
`BaseRouter`. For modular MoE kernels (every CPU backend for unquantized weights, the Triton GPU path)
`MoERunner._apply_quant_method` calls `router.select_experts()` -> `BaseRouter._select_experts()`, which
computes the top-k and calls `router.capture_fn(topk_ids)` with the *logical* expert ids, before any EPLB
mapping to physical replicas. `BaseRouter.set_capture_fn` is the public setter vLLM's own capturer uses.
The same hook runs inside `torch.compile`d models (the MoE block is the opaque custom op `vllm.moe_forward`,
so the Python hook runs eagerly) and is recorded into CUDA graphs when it is bound before capture.

What breaks it, and what happens then:
- Monolithic MoE kernels (`quant_method.is_monolithic`: FlashInfer/TRT-LLM fused routing on GPU, the zentorch
  int4 and ARM W4A8 kernels on CPU, which route through `cpu_router.select_experts()` and never call the
  hook): refused at bind time with the kernel's name. Exception: vLLM 0.27-0.29's CPU kernels for unquantized
  weights, monolithic too, are hooked by a shim (see "vLLM 0.27 to 0.29 on CPU" below).
- A router object replaced after binding (a weight reload that rebuilds layers) or another capturer calling
  `set_capture_fn` over ours: the plugin re-binds after `reload_weights`, `wake_up` and weight updates; any
  other loss is caught per step (`CaptureBinding.calls` where hooks run in Python every step, the -1
  sentinel where they are replayed from CUDA graphs; see worker.py) and fails loudly.
- Sequence parallelism or an unexpected data-parallel dispatch layout: the hook sees a token count it cannot
  map to this rank's batch and raises.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import operator
from dataclasses import dataclass, field
from time import thread_time_ns
from typing import Callable

import torch

MAX_EXPERT_ID = (1 << 15) - 1       # the capture holds ids as int16 (the wire narrows them: wire.id_dtype)


@dataclass
class MoELayer:
    """One MoE block of the model: its module and the model layer index it sits in."""

    layer_id: int
    name: str
    module: torch.nn.Module
    top_k: int
    num_experts: int

    @property
    def router(self):
        """The module's router as it is now (a rebuild may have replaced the one seen at bind time)."""
        return self.module.router


def _moe_runner_cls():
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
    return MoERunner


# ---- vLLM 0.27 to 0.29 on CPU: the unquantized MoE is monolithic ------------------------------------------------
# Before 0.30 the CPU kernels for unquantized weights route inside the kernel, with vLLM's CPU `select_experts`,
# and never call the router's capture hook (from 0.30 on they are modular and go through BaseRouter):
#   0.27        UnquantizedFusedMoEMethod keeps CPU on "the old monolithic path": `apply_monolithic` calls the
#               layer's `quant_method.cpu_fused_moe` (CPUFusedMOE or SGLFusedMOE), whose `__call__` routes with
#               the module function `fused_moe.cpu_fused_moe.select_experts`.
#   0.28, 0.29  the layer's `quant_method.moe_kernel.fused_experts` is a CPUUnquantizedExperts
#               (FusedMoEExpertsMonolithic, fused_moe.experts.cpu_moe) whose `apply` routes with its own
#               `_select_experts` method.
# The shims hand the logical top-k ids that routing returns to the layer's `router.capture_fn`: the same hook and
# the same ids vLLM routes with, no second top-k. 0.27: each layer's `cpu_fused_moe` is wrapped in a _RouterScope
# that names the layer's MoERunner while it runs, and `select_experts` is wrapped (module-level, once) to call that
# runner's hook. 0.28/0.29: each layer's experts object gets an instance-level `_select_experts` that calls it.
# Other monolithic kernels (quantized CPU experts, FlashInfer/TRT-LLM on GPU) stay refused.

_scope: list = []                   # 0.27: the MoERunner whose cpu_fused_moe is running (innermost last)


def _vllm_module(name: str):
    try:
        return importlib.import_module(f"vllm.model_executor.layers.fused_moe.{name}")
    except ImportError:
        return None


def _classes(mod, *names) -> tuple:
    return tuple(getattr(mod, n) for n in names if inspect.isclass(getattr(mod, n, None)))


def _legacy_cpu_hook(module):
    """The shim that hooks `module` (a monolithic MoERunner) if it runs vLLM 0.27-0.29's CPU MoE for unquantized
    weights, else None."""
    qm = getattr(getattr(module, "routed_experts", None), "quant_method", None)
    fn = getattr(qm, "cpu_fused_moe", None)
    if fn is not None:
        mod = _vllm_module("cpu_fused_moe")
        if isinstance(fn, _RouterScope) or (isinstance(fn, _classes(mod, "CPUFusedMOE", "SGLFusedMOE"))
                                            and callable(getattr(mod, "select_experts", None))):
            return _install_scope_hook
    experts = getattr(getattr(qm, "moe_kernel", None), "fused_experts", None)
    if experts is not None and isinstance(experts, _classes(_vllm_module("experts.cpu_moe"), "CPUUnquantizedExperts")) \
            and callable(getattr(experts, "_select_experts", None)):
        return _install_select_hook
    return None


class _RouterScope:
    """Stands in for one layer's `quant_method.cpu_fused_moe` (0.27): runs it with the layer's MoERunner in scope."""

    def __init__(self, fn, module):
        self.fn, self.module = fn, module

    def __call__(self, *args, **kwargs):
        _scope.append(self.module)
        try:
            return self.fn(*args, **kwargs)
        finally:
            _scope.pop()

    def __getattr__(self, name):            # forward_method, isa, ... as the wrapped object has them
        return getattr(self.fn, name)


def _shared(module, what) -> NotImplementedError:
    return NotImplementedError(f"routing-replay: MoE layers share one {what}; their routing cannot be told apart")


def _install_scope_hook(module) -> None:
    """0.27: route `module`'s CPU fused-MoE top-k through its router's capture hook (idempotent)."""
    mod = _vllm_module("cpu_fused_moe")
    orig = mod.select_experts
    if not getattr(orig, "_routing_replay", False):
        def select_experts(*args, **kwargs):
            out = orig(*args, **kwargs)
            if _scope:
                fn = _scope[-1].router.capture_fn
                if fn is not None:
                    fn(out[1])
            return out

        select_experts._routing_replay = True
        mod.select_experts = select_experts
    qm = module.routed_experts.quant_method
    if not isinstance(qm.cpu_fused_moe, _RouterScope):
        qm.cpu_fused_moe = _RouterScope(qm.cpu_fused_moe, module)
    elif qm.cpu_fused_moe.module is not module:
        raise _shared(module, type(qm.cpu_fused_moe.fn).__name__)


def _install_select_hook(module) -> None:
    """0.28, 0.29: route `module`'s CPU experts' `_select_experts` through its router's capture hook (idempotent)."""
    experts = module.routed_experts.quant_method.moe_kernel.fused_experts
    cur = experts.__dict__.get("_select_experts")
    owner = getattr(cur, "_routing_replay_module", None)
    if owner is module:
        return
    if owner is not None:
        raise _shared(module, type(experts).__name__)
    orig = experts._select_experts

    def _select_experts(*args, **kwargs):
        out = orig(*args, **kwargs)
        fn = module.router.capture_fn
        if fn is not None:
            fn(out[1])
        return out

    _select_experts._routing_replay_module = module
    experts._select_experts = _select_experts


def _capture_source_cls():
    """vLLM's protocol for MoE modules that are no MoERunner, route inside their own kernel and hand the ids only to
    vLLM's routed-experts capturer through their own `capture_fn` (DeepGEMM MegaMoE experts: DeepSeek V4, MiniMax M3
    and Kimi K3 on NVIDIA), or None where vLLM has no such protocol."""
    try:
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCaptureSource
    except Exception:                   # noqa: BLE001 -- an older vLLM: no such modules either
        return None
    return RoutedExpertsCaptureSource


def find_moe_layers(model: torch.nn.Module) -> list[MoELayer]:
    """The MoE blocks of `model` in layer order (only this pipeline stage's layers exist in `model`). A module vLLM
    captures through its own `capture_fn` (no router hook) is refused by name: its layer would be missing from every
    row."""
    runner_cls = _moe_runner_cls()
    source_cls = _capture_source_cls()
    layers: list[MoELayer] = []
    for name, module in model.named_modules():
        if not isinstance(module, runner_cls):
            if source_cls is not None and isinstance(module, source_cls):
                raise NotImplementedError(
                    f"routing-replay: MoE layer {name} is a {type(module).__name__}, which routes inside its own "
                    "kernel and reports expert ids only through its own capture_fn, not through a router's hook; "
                    "not supported. Unset ROUTING_REPLAY_BROKER to run vLLM with routing capture off.")
            continue
        router = module.router
        shim = _legacy_cpu_hook(module) if module.is_monolithic else None
        if module.is_monolithic and shim is None:
            kernel = type(getattr(module.routed_experts, "quant_method", None)).__name__
            raise NotImplementedError(
                f"routing-replay: MoE layer {name} uses the monolithic kernel {kernel}, which computes its "
                "routing inside the kernel and never calls the router's capture hook. Use a modular MoE "
                "backend (e.g. unquantized weights) or unset ROUTING_REPLAY_BROKER.")
        if not callable(getattr(router, "set_capture_fn", None)):
            raise NotImplementedError(f"routing-replay: router {type(router).__name__} of MoE layer {name} "
                                      "has no set_capture_fn")
        if shim is not None:
            shim(module)
        top_k = int(router.top_k)
        num_experts = int(getattr(router, "global_num_experts", 0) or 0)
        if num_experts - 1 > MAX_EXPERT_ID:
            raise ValueError(f"MoE layer {name} has {num_experts} experts; the int16 capture holds ids up to "
                             f"{MAX_EXPERT_ID}")
        layers.append(MoELayer(int(module.layer_id), name, module, top_k, num_experts))
    layers.sort(key=lambda m: m.layer_id)
    ids = [m.layer_id for m in layers]
    if len(set(ids)) != len(ids):
        raise NotImplementedError(f"routing-replay: several MoE blocks share a layer index: {ids}")
    ks = {m.top_k for m in layers}
    if len(ks) > 1:
        raise NotImplementedError(f"routing-replay: MoE layers use different top_k values {sorted(ks)}")
    return layers


def local_rows(topk_ids: torch.Tensor, dp_rank: int) -> torch.Tensor:
    """The rows of `topk_ids` that belong to this data-parallel rank's batch (vLLM's own capturer does the
    same): all of them without DP, or this rank's span when naive dispatch gathered every rank's tokens."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return topk_ids
    dp = get_forward_context().dp_metadata
    if dp is None:
        return topk_ids
    sizes = dp.num_tokens_across_dp_cpu
    n = topk_ids.shape[0]
    local = int(sizes[dp_rank])
    total = int(sizes.sum())
    if n == local:
        return topk_ids
    if n == total:
        end = int(sizes[:dp_rank + 1].sum())
        return topk_ids[end - local:end]
    raise NotImplementedError(f"routing-replay: router saw {n} tokens; this DP rank has {local} of {total}. "
                              "Sequence-parallel or other MoE dispatch layouts are not supported.")


# each held tensor's (shape, dtype), at C speed (map); AttributeError where a layer holds None
_SIG = operator.attrgetter("shape", "dtype")
# True for each layer that holds a tensor, at C speed (map): no tensor's __eq__ is called, as list.count(None) would
HOLDS = functools.partial(operator.is_not, None)


def record_held(held: list, record: Callable[[int, torch.Tensor], None]) -> None:
    """Empty `held` (per MoE layer, its top-k tensor or None), then record(layer, tensor) for each, in layer order:
    a tensor that record refuses is not held again."""
    items = [(idx, rows) for idx, rows in enumerate(held) if rows is not None]
    held[:] = [None] * len(held)
    for idx, rows in items:
        record(idx, rows)


@dataclass
class CaptureBinding:
    """Own the capture hooks bound to one model's routers: which cache row each MoE layer writes, whether
    recording is on for the current step, and how many layers recorded since the last reset.

    With gate=True (eager execution: the hooks run on every step) a hook only keeps its layer's top-k tensor as the
    router made it. Python hooks: the last layer's hands them all over in layer order (`drain`: to `take_step` if
    given, else to `record` per layer). With c_hooks every hook is a C call and whoever ends the step (the worker's
    post_step) takes the list or drains it; so does it for a step whose last hook did not run. `calls` is read
    after that."""

    layers: list[MoELayer]
    record: Callable[[int, torch.Tensor], None]
    dp_rank: int = 0
    dp_size: int = 1
    gate: bool = False                 # True: hooks record only while `active` (eager execution only)
    active: bool = True
    calls: int = 0                     # hooks since the last reset that recorded at least min_rows rows
    min_rows: int = 0
    timing: bool = False               # benchmarks: add the hooks' engine-thread CPU time to hook_ns
    hook_ns: int = 0
    hooks: list = field(default_factory=list)
    held: list = field(default_factory=list)    # gate=True: per layer, its top-k tensor since the last drain
    # gate=True: takes the whole step's list (and empties it) instead of `record` per layer (the worker on CPU),
    # with the (shape, dtype) all its tensors share where the binding checked that (every layer holds a 2-D tensor
    # covering the step), else None
    take_step: Callable[[list, tuple | None], None] | None = None
    # gate=True: the hooks of all MoE layers are C calls (_make_hook; but a layer chaining a foreign hook or slicing a
    # data-parallel batch); only where nothing traces the model's Python (enforce_eager): torch.compile's dynamo
    # cannot trace list.__setitem__
    c_hooks: bool = False

    def bind(self) -> None:
        """(Re)install one hook per MoE layer; an existing foreign hook is kept and called after ours."""
        self.hooks = []
        self.held = [None] * len(self.layers)
        for idx, layer in enumerate(self.layers):
            prev = getattr(layer.router, "capture_fn", None)
            if getattr(prev, "_routing_replay", None) is self:
                prev = getattr(prev, "_routing_replay_prev", None)
            hook = self._make_hook(idx, prev)
            layer.router.set_capture_fn(hook)
            self.hooks.append(hook)

    def drain(self) -> None:
        """gate=True: hand the held top-k tensors over in layer order, counting in `calls` those that cover
        min_rows rows; the list is emptied first, so a tensor that is refused is not held again. A no-op when
        nothing is held (post_step's drain after a step whose Python last hook drained, or that post_step took)."""
        if any(map(HOLDS, self.held)):
            self._drain()

    def _drain(self) -> None:
        held = self.held
        take = self.take_step
        if take is not None:
            # the common step: every layer holds one 2-D tensor of one shape and dtype covering the step, checked
            # without a Python loop over the layers (48 of them in Qwen3-30B-A3B)
            try:
                sigs = set(map(_SIG, held))
            except AttributeError:          # a layer holds none
                sigs = ()
            if len(sigs) == 1:
                sig = sigs.pop()
                if len(sig[0]) == 2 and sig[0][0] >= self.min_rows:
                    take(held, sig)         # (empties it)
                    self.calls += len(held)
                    return
        m = self.min_rows
        n = 0
        for rows in held:                   # (`is not None`: list.count(None) would call each tensor's __eq__)
            if rows is not None and rows.shape[0] >= m:
                n += 1
        if take is not None:
            take(held, None)                # (empties it)
        else:
            record_held(held, self.record)
        self.calls += n                     # counts only hooks that covered the whole step

    def _make_hook(self, idx: int, prev):
        record, binding = self.record, self
        dp_rank = self.dp_rank
        needs_dp = self.dp_size > 1

        if self.gate:
            held, last = self.held, len(self.layers) - 1
            if self.c_hooks and prev is None and not needs_dp:
                # every MoE layer, the last one too: its tensor goes into its slot in C, no Python frame per layer
                # and step (a Python hook pays a frame per layer and step on the engine thread).
                # It cannot look at `active`, so it also keeps the tensor of a step that is not captured: the
                # worker empties the list at the end of such a step (`clear`) and before a captured one, and
                # drains a captured step's list in post_step. Tensors are kept as the router made them (strided
                # too): HostRows and RoutingCache.record read strided tensors
                hook = functools.partial(list.__setitem__, held, idx)
                hook._routing_replay = self
                hook._routing_replay_prev = prev
                return hook

            def hook(topk_ids: torch.Tensor) -> None:
                if binding.active:
                    t0 = thread_time_ns() if binding.timing else 0
                    held[idx] = local_rows(topk_ids, dp_rank) if needs_dp else topk_ids
                    if idx == last:
                        binding._drain()
                    if t0:
                        binding.hook_ns += thread_time_ns() - t0
                if prev is not None:
                    prev(topk_ids)
        else:
            def hook(topk_ids: torch.Tensor) -> None:
                if binding.active:
                    t0 = thread_time_ns() if binding.timing else 0
                    rows = local_rows(topk_ids, dp_rank) if needs_dp else topk_ids
                    record(idx, rows)
                    if rows.shape[0] >= binding.min_rows:
                        binding.calls += 1              # counts only hooks that covered the whole step
                    if t0:
                        binding.hook_ns += thread_time_ns() - t0
                if prev is not None:
                    prev(topk_ids)

        hook._routing_replay = self
        hook._routing_replay_prev = prev
        return hook

    def clear(self) -> None:
        """gate=True: let go of every held tensor (the end of a step that is not captured, whose tensors the C
        hooks kept, and the start of a captured one)."""
        held = self.held
        held[:] = [None] * len(held)

    def bound(self) -> bool:
        """True if every router still holds the hook installed by the last bind()."""
        return all(layer.router.capture_fn is hook for layer, hook in zip(self.layers, self.hooks))

    def unbind(self) -> None:
        self.held = [None] * len(self.layers)
        for layer, hook in zip(self.layers, self.hooks):
            if layer.router.capture_fn is hook:
                layer.router.set_capture_fn(hook._routing_replay_prev)
        self.hooks = []
