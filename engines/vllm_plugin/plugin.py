"""vLLM general plugin entry point: self-check the vLLM it runs in and wrap the worker and scheduler methods we hook.

`register()` runs in every vLLM process (front end, engine core, workers) through the `vllm.general_plugins`
entry point. It does nothing unless ROUTING_REPLAY_BROKER is set. Otherwise it wraps, at class level and
without touching vLLM's files:

  vllm.v1.worker.gpu_worker.Worker (CPUWorker inherits it)
    load_model            before: refuse a model whose MoE dtype this vLLM CPU release refuses on this CPU, naming
                          release, CPU feature and dtype (cpu_refusals.py); after: bind the capture hooks, allocate
                          the cache, start the producer (before profiling and CUDA-graph capture, which come later)
    execute_model         before/after: WorkerCapture.pre_step / post_step (pre_step's work in post_step for a
                          step of the running batch after an eager CPU one: WorkerCapture._late_pre_step)
    compile_or_warm_up_model  around: the prefix store made (fill mode; before CUDA graphs are captured, so
                          they hold its write), capture paused (Model Runner V2 warms up with fake requests)
    reload_weights, wake_up, finish_weight_update
                          after: re-bind the hooks (a reload may rebuild layers)
    shutdown              before: flush and close the producer (and the embedded pipeline)
  vllm.v1.core.sched.scheduler.Scheduler
    _free_request, schedule   see scheduler_hooks.py
  vllm.v1.engine.core_client.InprocClient
    get_output, abort_requests   see scheduler_hooks.py (in-process engines only)
  vllm.v1.engine.input_processor.InputProcessor (front end)
    _validate_params      after: a request whose extra_args["return_routed_experts"] is not a boolean is
                          refused there (VLLMValidationError: the OpenAI server answers 400 naming the value,
                          `LLM.generate` raises), not left to be skipped by the worker. Where the class or method
                          is missing, an INFO line says so and the worker skips such a request (WARNING).

Supported: any vLLM whose start-up self-check passes (selfcheck.py: every class, method, signature and field the
plugin hooks or reads is there). Tested: selfcheck.TESTED_VLLM (0.25.1 on GPU; the CPU build 0.27.0 to 0.32.0, the
V1 model runner). Outside those a WARNING names them; a failed self-check raises at start-up naming the missing
hook (vLLM propagates exceptions from plugin functions, so the engine does not start).
"""

from __future__ import annotations

import functools
import logging

from routing_replay.engines.vllm_plugin import selfcheck
from routing_replay.engines.vllm_plugin import settings as _settings

log = logging.getLogger("vllm.routing_replay")

SUPPORTED_VLLM = selfcheck.TESTED_VLLM      # tested; any other vLLM runs if the self-check passes
_ATTR = "_routing_replay"
_installed = False


def check_version(version: str) -> None:
    """The start-up self-check for vLLM `version` (vllm.__version__): RuntimeError naming every missing hook;
    a WARNING naming the tested versions if `version` is not one of them (selfcheck.startup_check)."""
    selfcheck.startup_check(version)


def register() -> None:
    """The `vllm.general_plugins` entry point. Idempotent; inert unless ROUTING_REPLAY_BROKER is set."""
    global _installed
    s = _settings.current()
    if not s.enabled or _installed:
        return
    import vllm

    check_version(vllm.__version__)
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_worker import Worker

    from routing_replay.engines.vllm_plugin import scheduler_hooks

    from vllm.v1.engine.core_client import InprocClient

    scheduler_hooks.install(Scheduler)
    scheduler_hooks.install_inproc_flush(InprocClient)
    _install_request_check()
    _install_worker_hooks(Worker)
    _installed = True
    log.info("routing-replay: plugin active (vLLM %s, %s=%s, requests=%s)", vllm.__version__,
             _settings.ENV_BROKER, s.broker, s.requests)


def check_request(params) -> None:
    """Raise vLLM's validation error (a client error: HTTP 400) if a request's return_routed_experts flag is not
    a boolean; the message names the value and what is accepted."""
    try:
        _settings.current().captures(params)
    except ValueError as e:
        try:
            from vllm.exceptions import VLLMValidationError
        except ImportError:             # a vLLM without it maps ValueError to 400 as well
            raise ValueError(f"vllm_xargs: {e}; use true or false") from None
        extra = getattr(params, "extra_args", None) or {}
        raise VLLMValidationError(f"vllm_xargs: {e}; use true or false",
                                  parameter=f"vllm_xargs.{_settings.EXTRA_ARG}",
                                  value=extra.get(_settings.EXTRA_ARG)) from None


def _install_request_check() -> None:
    """Wrap InputProcessor._validate_params (front end: every request passes it before it reaches the engine)."""
    try:
        from vllm.v1.engine.input_processor import InputProcessor
    except ImportError:
        InputProcessor = None
    orig = getattr(InputProcessor, "_validate_params", None)
    if orig is None:
        log.info("routing-replay: this vLLM has no InputProcessor._validate_params: a malformed "
                 "return_routed_experts flag is not refused at the API; the worker skips its request (WARNING)")
        return
    if getattr(orig, "_routing_replay_wrapped", False):
        return

    @functools.wraps(orig)
    def _validate_params(self, params, *args, **kwargs):
        out = orig(self, params, *args, **kwargs)
        if getattr(params, "extra_args", None):         # (no flag, nothing to check: one attribute read)
            check_request(params)
        return out

    _validate_params._routing_replay_wrapped = True
    InputProcessor._validate_params = _validate_params


def rebind_if_replaced(worker) -> None:
    """Re-bind a worker's capture hooks if another capturer replaced them (vLLM's own, installed when the KV cache
    is initialised); chains the other hook after ours. No-op when ours are all still in place."""
    cap = getattr(worker, _ATTR, None)
    if cap is not None and cap.binding is not None and not cap.binding.bound():
        cap.rebind("another capture hook replaced ours (vLLM's return_routed_experts?)")


def capture_of(worker):
    """The WorkerCapture attached to a vLLM worker (None if the plugin is inert or this rank does not publish)."""
    return getattr(worker, _ATTR, None)


def _wrap_warm_up(cls) -> None:
    """Around `cls.compile_or_warm_up_model`: first make the prefix store (fill mode; the KV cache is sized by now
    and no CUDA graph is captured yet, so every graph holds the store write), then pause capture while it runs:
    Model Runner V2 warms its kernels by feeding fake requests (`_warmup_*`, fake block ids) through
    Worker.execute_model; they must open no record. Their forwards do write store rows, at the fake requests'
    slots, like their KV: harmless, as any later hit on a slot reads rows written by the real forward that
    wrote the slot's KV."""
    orig = cls.__dict__.get("compile_or_warm_up_model")
    if orig is None or getattr(orig, "_routing_replay_wrapped", False):
        return

    @functools.wraps(orig)
    def compile_or_warm_up_model(self, *args, **kwargs):
        cap = self.__dict__.get(_ATTR)
        if cap is None:
            return orig(self, *args, **kwargs)
        cap.prepare_store()             # fill mode: the store exists before any CUDA graph is captured
        outer = not cap.warming         # a subclass's warm-up calling the base class's: both wrapped
        cap.warming = True
        try:
            return orig(self, *args, **kwargs)
        finally:
            if outer:
                cap.warming = False
                cap.graphs_captured = True
                cap.check_captured_store()
                cap.stamp_baseline()

    compile_or_warm_up_model._routing_replay_wrapped = True
    cls.compile_or_warm_up_model = compile_or_warm_up_model


def _install_worker_hooks(cls) -> None:
    if getattr(cls, "_routing_replay_hooked", False):
        return
    from routing_replay.engines.vllm_plugin.worker import build

    def after(name, fn):
        orig = getattr(cls, name)

        @functools.wraps(orig)
        def wrapper(self, *args, **kwargs):
            out = orig(self, *args, **kwargs)
            fn(self)
            return out

        setattr(cls, name, wrapper)

    def on_load(worker) -> None:
        old = getattr(worker, _ATTR, None)
        if old is not None:
            old.close()
        s = _settings.current()
        # a worker subclass with a warm-up of its own (CPUWorker) gets the same pause; wrapped here, not at
        # register(): importing vllm.v1.worker.cpu_worker on a GPU host replaces torch.cuda.Event (vLLM's shm.py)
        for klass in type(worker).__mro__:
            if klass is cls:
                break
            _wrap_warm_up(klass)
        setattr(worker, _ATTR, build(worker, s) if s.enabled else None)     # (None on ranks that do not publish)

    def rebinder(reason):
        def fn(worker) -> None:
            cap = getattr(worker, _ATTR, None)
            if cap is not None:
                cap.rebind(reason)
        return fn

    orig_load = cls.load_model

    @functools.wraps(orig_load)
    def load_model(self, *args, **kwargs):
        import vllm

        from routing_replay.engines.vllm_plugin import cpu_refusals

        # a release that refuses this model's MoE dtype on this CPU says so once, before any layer loads
        cpu_refusals.check_engine(self.vllm_config, vllm.__version__)
        out = orig_load(self, *args, **kwargs)
        model = getattr(getattr(self, "model_runner", None), "model", None)
        if model is not None:
            warning = cpu_refusals.mla_rotary_kernel_warning(model, bool(getattr(self.model_config, "use_mla", False)),
                                                             self.vllm_config.device_config.device_type)
            if warning is not None:
                log.warning(warning)
        return out

    cls.load_model = load_model
    after("load_model", on_load)
    for name in ("reload_weights", "wake_up", "finish_weight_update"):
        if hasattr(cls, name):
            after(name, rebinder(name))
    if hasattr(cls, "initialize_from_config"):
        # vLLM's own routed-experts capturer (enable_return_routed_experts) is installed after load_model, with
        # set_capture_fn, which replaces our hook: bind again (ours first, chaining theirs) before graph capture
        after("initialize_from_config", rebind_if_replaced)

    orig_execute = cls.execute_model

    @functools.wraps(orig_execute)
    def execute_model(self, scheduler_output, *args, **kwargs):
        cap = self.__dict__.get(_ATTR)
        if cap is None:
            return orig_execute(self, scheduler_output, *args, **kwargs)
        so = scheduler_output
        # pre_step is left out after an eager CPU step of the running batch (host_next) for a step that opens,
        # ends, preempts and speculates nothing: post_step does its work (WorkerCapture._late_pre_step). Checked
        # here, not in a method: entering the plugin is what this saves
        if not cap.host_next or (so.scheduled_new_reqs or so.finished_req_ids or so.preempted_req_ids
                                  or so.scheduled_spec_decode_tokens):
            cap.pre_step(so)
        out = orig_execute(self, scheduler_output, *args, **kwargs)
        cap.post_step(scheduler_output)
        return out

    cls.execute_model = execute_model
    _wrap_warm_up(cls)

    orig_shutdown = cls.shutdown

    @functools.wraps(orig_shutdown)
    def shutdown(self, *args, **kwargs):
        cap = self.__dict__.pop(_ATTR, None)
        try:
            if cap is not None:
                cap.close()
        finally:
            out = orig_shutdown(self, *args, **kwargs)
        return out

    cls.shutdown = shutdown
    cls._routing_replay_hooked = True
