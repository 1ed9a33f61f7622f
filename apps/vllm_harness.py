"""Helpers shared by the vLLM tests, the demo and the benchmark: tiny models, in-process engines, records."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path


def tiny_model(arch: str = "qwen3_moe", dtype: str = "float32") -> Path:
    """A generated random-weight model, cached under the temp dir across runs (generation takes seconds)."""
    from routing_replay.apps.models import make_tiny_model

    d = Path(tempfile.gettempdir()) / "routing-replay-models" / f"{arch}-{dtype}"
    return make_tiny_model(d, arch, dtype=dtype)


def inprocess_llm(model: str | os.PathLike, **kw):
    """vLLM's LLM with engine core and worker in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so that
    the worker's WorkerCapture can be inspected. Routing-replay settings are read from the environment when
    the worker loads the model, i.e. inside this call."""
    import routing_replay.engines.vllm_plugin as plugin
    from vllm import LLM

    plugin.register()        # vLLM loads it too, once per process; this covers a process that loaded it earlier
    kw.setdefault("dtype", "float32")
    kw.setdefault("enforce_eager", True)
    kw.setdefault("max_model_len", 1024)
    kw.setdefault("kv_cache_memory_bytes", 256 << 20)
    kw.setdefault("seed", 0)
    try:        # a CUDA-graph engine turns graph capture off process-wide once it has captured (vLLM's "capture
        # at an inappropriate time" guard); Model Runner V1 turns it on again when it captures, V2 does not, so a V2
        # engine made after another engine in this process would refuse to capture: a new engine may capture
        from vllm.compilation.monitor import set_cudagraph_capturing_enabled
        set_cudagraph_capturing_enabled(True)
    except ImportError:
        pass
    try:        # and into a graph memory pool of its own: vLLM keeps one pool handle per process, and after a Model
        # Runner V2 engine shut down the next engine's capture into it fails (PyTorch's "use_count > 0" assert;
        # vLLM 0.25.1 on a GPU, with or without the plugin: docs/VLLM.md, "Bugs and quirks")
        from vllm.platforms import current_platform
        type(current_platform)._global_graph_pool = None
    except (ImportError, AttributeError):
        pass
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"       # read while the engine client is made
    try:
        return LLM(model=str(model), distributed_executor_backend="uni", **kw)
    finally:
        if old is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old


def worker_of(llm):
    """The vLLM worker object of an in-process LLM."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker


def shutdown(llm) -> None:
    """Shut an in-process LLM down now (worker shutdown flushes and closes routing-replay's producer)."""
    llm.llm_engine.engine_core.shutdown()


def wait_records(npz_dir: str | os.PathLike, ids, timeout_s: float = 60.0) -> dict:
    """Poll an npz directory until records for all `ids` exist; returns every record found. Raises
    TimeoutError naming the missing ids."""
    from routing_replay.consumer import load_records

    want = set(ids)
    deadline = time.monotonic() + timeout_s
    while True:
        recs = load_records(npz_dir) if Path(npz_dir).exists() else {}
        missing = want - recs.keys()
        if not missing:
            return recs
        if time.monotonic() > deadline:
            raise TimeoutError(f"no record after {timeout_s}s for {len(missing)} of {len(want)} requests, "
                               f"e.g. {sorted(missing)[:5]}")
        time.sleep(0.05)


def run_requests(llm, prompts: dict, params, max_steps: int = 100_000) -> dict:
    """Run {request_id: prompt} through `llm.llm_engine` with user-chosen request ids; returns the final
    RequestOutput per request id."""
    eng = llm.llm_engine
    for rid, prompt in prompts.items():
        eng.add_request(rid, prompt, params[rid] if isinstance(params, dict) else params)
    done = {}
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return done
