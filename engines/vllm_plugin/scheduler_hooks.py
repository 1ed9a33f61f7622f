"""Carry each captured request's final output length and finish reason from the scheduler to the workers.

The worker learns that a request finished from `SchedulerOutput.finished_req_ids` one step later, but only the
scheduler knows how many output tokens the request really has (with async scheduling the worker may already
have run one more step for it) and why it ended. Two wrappers on `vllm.v1.core.sched.scheduler.Scheduler`
(engine-core process; AsyncScheduler inherits them):

- `_free_request(request)`: called once for every finished request (stop, length, abort); for captured
  requests it notes `Finished(num_output_tokens, reason, output_token_ids)` under the internal request id.
- `schedule()`: attaches the notes gathered since the previous step to the SchedulerOutput it returns, as the
  attribute `routing_replay_finished` (a dict keyed like `finished_req_ids`). SchedulerOutput is a plain
  dataclass, pickled whole to worker processes, so the attribute travels with it. It is attached on every
  step (an empty dict when nothing finished) so a worker can tell a missing hook from a quiet step.

A worker hears of a finish only with the next step. The engine-core busy loop (`LLM` by default, `vllm serve`)
runs that step at once, because the scheduler still `has_requests()`. The in-process client
(VLLM_ENABLE_V1_MULTIPROCESSING=0, external_launcher) steps only while `LLM.generate` waits for unfinished
requests, so the finishes of the last requests of a `generate()` call would wait for the next call; wrappers
on `InprocClient.get_output` and `InprocClient.abort_requests` run that one empty step when finish notes are
owed and nothing is left to run.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

from routing_replay.engines.vllm_plugin import settings as _settings

log = logging.getLogger("vllm.routing_replay")

ATTR = "routing_replay_finished"
_NOTES = "_routing_replay_finished"
_EMPTY: dict = {}


class Finished(NamedTuple):
    num_output_tokens: int
    reason: str                     # "stop", "length", "abort", "error", "repetition"
    output_token_ids: list


def _reason(request) -> str:
    r = request.get_finished_reason()
    if r is not None:
        return str(r)
    return getattr(request.status, "name", "finished").lower()


class SchedulerStats:
    """Counters of this process's scheduler hooks."""
    note_errors = 0                 # finished requests whose note failed (the worker falls back to its own count)


stats = SchedulerStats()


def note_finished(scheduler, request) -> None:
    """Remember a finished request's final numbers if it is captured (a few attribute reads otherwise). Never
    raises into vLLM's scheduler: a failure is one request's, logged and counted (stats.note_errors)."""
    try:
        _note(scheduler, request)
    except Exception as e:          # noqa: BLE001 -- one request's problem must not stop the engine core
        stats.note_errors += 1
        rid = getattr(request, "request_id", "?")
        log.warning("routing-replay: finish note of request %s failed: %s: %s (note_errors=%d)",
                    ascii(rid[:64]) if isinstance(rid, str) else "?", type(e).__name__, str(e)[:200],
                    stats.note_errors)


def _note(scheduler, request) -> None:
    try:
        captured = _settings.current().captures(request.sampling_params)
    except ValueError:
        captured = False            # reported by the worker, which refuses to start with bad settings
    if not captured:
        return
    notes = scheduler.__dict__.get(_NOTES)
    if notes is None:
        notes = scheduler.__dict__[_NOTES] = {}
    out = request.output_token_ids
    notes[request.request_id] = Finished(len(out), _reason(request), list(out))


def install(scheduler_cls) -> None:
    """Wrap `scheduler_cls._free_request` and `scheduler_cls.schedule` (idempotent)."""
    if getattr(scheduler_cls, "_routing_replay_hooked", False):
        return
    orig_free = scheduler_cls._free_request
    orig_schedule = scheduler_cls.schedule

    @functools.wraps(orig_free)
    def _free_request(self, request, *args, **kwargs):
        note_finished(self, request)
        return orig_free(self, request, *args, **kwargs)

    @functools.wraps(orig_schedule)
    def schedule(self, *args, **kwargs):
        out = orig_schedule(self, *args, **kwargs)
        notes = self.__dict__.pop(_NOTES, None)
        setattr(out, ATTR, notes if notes else _EMPTY)
        return out

    scheduler_cls._free_request = _free_request
    scheduler_cls.schedule = schedule
    scheduler_cls._routing_replay_hooked = True


def _deliver_owed(client) -> None:
    """Run one (empty) engine step if finish notes are owed to the workers and nothing else will step."""
    core = client.engine_core
    sched = core.scheduler
    if _NOTES in sched.__dict__ and not sched.has_unfinished_requests():
        extra, executed = core.step_fn()
        core.post_step(model_executed=executed)
        more = extra.get(0) if extra else None
        if more is not None and more.outputs:
            log.warning("routing-replay: dropped %d outputs of a flush step", len(more.outputs))


def install_inproc_flush(client_cls) -> None:
    """Wrap `client_cls.get_output` and `abort_requests` (vLLM's InprocClient) so that finish notes owed to the
    workers are delivered at once, also after the front end aborted the last request (stop strings)."""
    if getattr(client_cls, "_routing_replay_hooked", False):
        return
    orig_get, orig_abort = client_cls.get_output, client_cls.abort_requests

    @functools.wraps(orig_get)
    def get_output(self, *args, **kwargs):
        out = orig_get(self, *args, **kwargs)
        _deliver_owed(self)
        return out

    @functools.wraps(orig_abort)
    def abort_requests(self, *args, **kwargs):
        out = orig_abort(self, *args, **kwargs)
        _deliver_owed(self)
        return out

    client_cls.get_output = get_output
    client_cls.abort_requests = abort_requests
    client_cls._routing_replay_hooked = True
