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


class BatchReader:
    """Read one runner's step layout after its forward, for the worker's step paths (step_paths.py); one per
    worker, chosen once by the runner's kind (batch_reader). Keeps what the last step's read can share with the
    next (views of the runner's arrays, the copy of an id list that decode steps repeat)."""

    kind = ""

    def __init__(self, runner):
        self.runner = runner
        self._raw_views = (None, None, None, None, None)    # raw_layout: the layout arrays, memoryviews, dtypes
        self._raw_ids = None            # the engine ids of the last step (a copy its steps share)

    def layout(self):
        """step_layout of this runner: (request ids, query_start_loc, computed positions), or None (no forward)."""
        return step_layout(self.runner, self.kind)

    def raw_layout(self, req_ids, qsl, computed) -> tuple:
        """A step's layout as it goes raw to the producer's thread: (engine ids, bytes of the computed positions,
        bytes of the query start locations, their dtypes). The ids are the last step's copy while the batch
        repeats them (one compare, C speed); the bytes are copied through memoryviews kept while the runner keeps
        its arrays (a numpy call right after the forward runs cold; `bytes` of a memoryview is a single C
        call)."""
        mv = self._raw_views
        if mv[0] is not qsl or mv[1] is not computed:
            mv = self._raw_views = (qsl, computed, memoryview(qsl), memoryview(computed), (qsl.dtype, computed.dtype))
        ids = self._raw_ids
        if ids != req_ids:
            ids = self._raw_ids = list(req_ids)
        return ids, bytes(mv[3]), bytes(mv[2]), mv[4]

    def raw_step(self):
        """The step as it goes raw (raw_layout's four values), or None if the step ran no forward."""
        layout = self.layout()
        return None if layout is None else self.raw_layout(*layout)


class V1BatchReader(BatchReader):
    """Model Runner V1: the persistent batch on the runner (`input_batch`, `query_start_loc`)."""

    kind = "v1"

    def __init__(self, runner):
        super().__init__(runner)
        self._views = [-1, None, None, None, None]   # step_layout's: num_reqs, the runner's two arrays, their views
        self._ring_views = (-1, None, None, None, None, None)   # read_batch: num_reqs, the runner's two arrays,
        #                                                         memoryviews of their step parts, dtypes
        self.ib_refs = (None, False)   # batch_refs of the runner's InputBatch (read_batch)

    def layout(self):
        return step_layout(self.runner, "v1", self._views)

    def read_batch(self) -> tuple:
        """The runner's batch as the ring and host paths hand it over: (its engine ids, the last step's copy while
        the batch repeats them; (num_reqs, the runner's two layout arrays, memoryviews of their step parts, their
        dtypes), kept while the runner keeps its arrays). `_req_ids` and `req_id_to_index` are read directly where
        `batch_refs` allows it (vLLM's properties are three cold frames a step). The runner's own list is read,
        never kept or modified."""
        runner = self.runner
        ib = runner.input_batch
        refs = self.ib_refs
        if refs[0] is not ib:
            refs = self.ib_refs = batch_refs(ib)
        if refs[1]:
            ids, n = ib._req_ids, len(ib.req_id_to_index)
        else:
            ids, n = ib.req_ids, ib.num_reqs
        if len(ids) != n:
            ids = ids[:n]
        q, c = runner.query_start_loc.np, ib.num_computed_tokens_cpu
        rv = self._ring_views
        if rv[0] != n or rv[1] is not q or rv[2] is not c:
            rv = self._ring_views = (n, q, c, memoryview(q[:n + 1]), memoryview(c[:n]), (q.dtype, c.dtype))
        last = self._raw_ids
        if last != ids:                             # (C speed: decode steps repeat the batch)
            last = self._raw_ids = list(ids)
        return last, rv

    def raw_step(self):
        ids, rv = self.read_batch()
        return ids, bytes(rv[4]), bytes(rv[3]), rv[5]


class V2BatchReader(BatchReader):
    """Model Runner V2: the batch built per step, kept in `execute_model_state` until `sample_tokens`."""

    kind = "v2"


def batch_reader(runner, kind: str) -> BatchReader:
    """The BatchReader for a runner of this kind ("v1" or "v2")."""
    return V1BatchReader(runner) if kind == "v1" else V2BatchReader(runner)
