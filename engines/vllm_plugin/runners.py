"""Which vLLM model runner a worker has (Model Runner V1 or V2) and how a step's batch layout is read from it.

V1 keeps a persistent batch on the runner (`input_batch`, `query_start_loc`); V2 builds one per step and keeps it
in `execute_model_state` until `sample_tokens`. Nothing here imports vLLM.
"""

from __future__ import annotations


V1_RUNNER = "vllm.v1.worker.gpu_model_runner"      # GPUModelRunner of Model Runner V1 (persistent batch)
V2_RUNNER = "vllm.v1.worker.gpu.model_runner"      # GPUModelRunner of Model Runner V2 (CPUModelRunner subclasses it)


def runner_kind(runner) -> str:
    """"v1" or "v2": which of vLLM's model runners `runner` is (by the module of a class in its MRO, so nothing
    is imported: V2's module needs Triton). NotImplementedError for any other runner."""
    modules = {c.__module__ for c in type(runner).__mro__ if c.__name__ == "GPUModelRunner"}
    if V2_RUNNER in modules:
        return "v2"
    if V1_RUNNER in modules:
        return "v1"
    raise NotImplementedError(f"routing-replay hooks vLLM's GPUModelRunner (Model Runner V1 or V2); this worker "
                              f"runs {type(runner).__module__}.{type(runner).__name__}")


def step_layout(runner, kind: str, views: list | None = None):
    """After `Worker.execute_model` (before `sample_tokens`): (request ids in batch order, query_start_loc of
    n + 1 entries, absolute position of each request's first token in the step), or None if the step ran no
    forward. V1 keeps a persistent batch on the runner; V2 builds one per step and keeps it in
    `execute_model_state` until `sample_tokens`. `views` (V1, the caller's list of five): the views of the last
    step whose batch had as many requests are reused while the runner keeps its arrays (two numpy slices per step
    fewer, each cold after the forward)."""
    if kind == "v1":
        ib = runner.input_batch
        n = ib.num_reqs
        ids = ib.req_ids                            # the runner's own list: read, never kept or modified
        ids = ids if len(ids) == n else ids[:n]
        q, c = runner.query_start_loc.np, ib.num_computed_tokens_cpu
        if views is None:
            return ids, q[:n + 1], c[:n]
        if views[0] != n or views[1] is not q or views[2] is not c:
            views[:] = (n, q, c, q[:n + 1], c[:n])
        return ids, views[3], views[4]
    st = runner.execute_model_state
    if st is None:
        return None
    ib = st.input_batch
    n = ib.num_reqs
    ids = ib.req_ids
    return (ids if len(ids) == n else ids[:n]), ib.query_start_loc_np[:n + 1], ib.num_computed_tokens_np[:n]


def batch_refs(ib) -> tuple:
    """(V1's InputBatch, direct): direct when its `req_ids` property hands out its `_req_ids` list (changed in place,
    never replaced) and its `num_reqs` counts its `req_id_to_index` (vLLM 0.25 to 0.33). The engine thread then reads
    those two attributes itself each step: the properties are three Python frames of vLLM's module (`cast`
    included), cold after every forward, like the frames V1Runner.read_batch saves. Checked again for each new
    InputBatch."""
    try:
        direct = ib.req_ids is ib._req_ids and type(ib._req_ids) is list and ib.num_reqs == len(ib.req_id_to_index)
    except (AttributeError, TypeError):
        direct = False
    return ib, direct


def check_runner_supported(runner, kind: str, vc) -> None:
    """Refuse engine features whose batch layout the capture does not follow (never a wrong row)."""
    pc = vc.parallel_config
    if getattr(pc, "enable_dbo", False) or int(getattr(pc, "ubatch_size", 1) or 1) > 1:
        raise NotImplementedError("routing-replay: micro-batching (enable_dbo / ubatch_size > 1) runs the routers "
                                  "once per micro-batch, each from row 0 of the step; not supported")
    if kind == "v2" and getattr(vc, "speculative_config", None) is not None:
        raise NotImplementedError(
            "routing-replay: speculative decoding on Model Runner V2: the host's num_computed_tokens is only an "
            "upper bound there (rejected drafts), so row positions would be wrong. Use Model Runner V1 "
            "(VLLM_USE_V2_MODEL_RUNNER=0) for speculative decoding.")
