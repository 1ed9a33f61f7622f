"""Read the ROUTING_REPLAY_* environment variables and decide which requests are captured.

    ROUTING_REPLAY_BROKER     unset: the plugin is inert. `tcp://host:port` (any ZeroMQ endpoint): publish to an
                              external broker. `embedded`: run broker and consumer inside the engine.
    ROUTING_REPLAY_NPZ_DIR    embedded only: write one npz file per finished request into this directory.
    ROUTING_REPLAY_SERVE      embedded only: ZeroMQ endpoint where trainers subscribe and fetch records. It runs
                              without CURVE, so a tcp:// address other than loopback (e.g. tcp://0.0.0.0:5560) is
                              refused at start-up, as `routing-replay consume --serve` refuses it without keys,
                              unless ROUTING_REPLAY_SERVE_INSECURE=1.
    ROUTING_REPLAY_REQUESTS   `all` (default): every request, unless it sets
                              `extra_args={"return_routed_experts": False}`. `opt-in`: only requests that set
                              `extra_args={"return_routed_experts": True}` (OpenAI server: `vllm_xargs`).
    ROUTING_REPLAY_PREFIX_ROWS `sentinel` (default): a record's prompt rows below num_cached_tokens (prefix-cache
                              hits) are -1. `fill`: they carry the routing that computed the cached KV, from a
                              per-KV-slot store in the worker (docs/VLLM.md, "Prefix rows").
    ROUTING_REPLAY_PREFIX_REFS `1` (default; with `fill`): rows of prefix-cache hits on blocks another captured
                              request computed are not sent again: the open names that request (prefix_refs) and
                              the consumer stores them once. `0`: every hit's rows sent (engines/vllm_plugin/
                              prefix_refs.py).
    ROUTING_REPLAY_STEP_STAMP `auto` (default): `ring` where the step ring's Triton kernels run on the device (CUDA
                              and Triton, checked bit for bit at start-up), else `on`. `on`: under CUDA graphs every
                              step's rows carry a step stamp written inside the forward, checked against the
                              engine's count of forwards (even top_k; odd top_k uses the fill). `off`: a -1 fill of
                              the step's cache rows is launched on the engine thread before every step, so rows a
                              lost hook did not write read -1: one launch more per step (docs/VLLM.md, "Step
                              stamps"). `ring`: stamps, and the graphs' flush also copies the step's rows into a
                              device step ring that the producer's thread reads: no launch at all on the engine
                              thread for a captured step (one data-parallel rank, even top_k; else `on`; with the
                              torch kernels where Triton's cannot run; docs/VLLM.md, "Step ring").
    ROUTING_REPLAY_RING_KERNELS `1` (default): the step ring's stamp add and slot write run as two Triton kernels
                              where they can (capture/ring_kernels.py, read there; checked bit for bit at start-up);
                              `0`: the four torch kernels (then `auto` means `on`).
    ROUTING_REPLAY_CURVE_SECRET  external broker only: this engine's CURVE secret key file (NAME.key_secret, from
                              `routing-replay keys`); needs ROUTING_REPLAY_BROKER_KEY. The broker must allow-list
                              the matching public key (`--curve-allow`).
    ROUTING_REPLAY_BROKER_KEY the broker's public key file (NAME.key).

Settings are read when a worker binds to its model and, cheaply and memoised, whenever the scheduler finishes
a request, so two engines started one after the other in one process may use different settings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

ENV_BROKER = "ROUTING_REPLAY_BROKER"
ENV_NPZ_DIR = "ROUTING_REPLAY_NPZ_DIR"
ENV_SERVE = "ROUTING_REPLAY_SERVE"
ENV_SERVE_INSECURE = "ROUTING_REPLAY_SERVE_INSECURE"
ENV_REQUESTS = "ROUTING_REPLAY_REQUESTS"
ENV_CURVE_SECRET = "ROUTING_REPLAY_CURVE_SECRET"
ENV_BROKER_KEY = "ROUTING_REPLAY_BROKER_KEY"
ENV_PREFIX_ROWS = "ROUTING_REPLAY_PREFIX_ROWS"
ENV_STEP_STAMP = "ROUTING_REPLAY_STEP_STAMP"
ENV_PREFIX_REFS = "ROUTING_REPLAY_PREFIX_REFS"
PREFIX_MODES = ("sentinel", "fill")
EMBEDDED = "embedded"
EXTRA_ARG = "return_routed_experts"
REQUEST_MODES = ("all", "opt-in")
EMBEDDED_SERVE_REMEDY = (f"the embedded trainer endpoint has no CURVE: serve on loopback or ipc://, or run "
                         f"`routing-replay broker` and `routing-replay consume --serve ... --curve-secret ... "
                         f"--curve-allow ...` for trainers on other hosts, or set {ENV_SERVE_INSECURE}=1 to "
                         f"accept that")


@dataclass(frozen=True)
class Settings:
    """One reading of the environment: where routing goes and which requests are captured."""

    broker: str                      # "" when the plugin is off
    npz_dir: str | None = None
    serve: str | None = None
    requests: str = "all"
    curve_secret: str | None = None  # this engine's secret key file, with broker_key: CURVE to the broker
    broker_key: str | None = None
    prefix_rows: str = "sentinel"    # "fill": prefix-cached prompt rows carry real routing (PrefixStore)
    step_stamp: bool = True          # under CUDA graphs: step stamps instead of a -1 fill per step
    step_ring: bool = True           # and the step ring (ROUTING_REPLAY_STEP_STAMP=ring, or auto)
    ring_needs_kernels: bool = True  # auto: the ring only where its Triton kernels run (else stamps alone)
    prefix_refs: bool = True         # with fill: hits on blocks a captured request computed go as prefix_refs

    @property
    def enabled(self) -> bool:
        return bool(self.broker)

    @property
    def embedded(self) -> bool:
        return self.broker == EMBEDDED

    def captures(self, sampling_params: Any) -> bool:
        """True if a request with these SamplingParams is captured. Pooling requests (None) never are."""
        if sampling_params is None or not self.broker:
            return False
        extra = getattr(sampling_params, "extra_args", None)
        flag = extra.get(EXTRA_ARG) if extra else None
        if flag is None:
            return self.requests == "all"
        if flag is True or flag is False:          # (per open on the engine thread: no message built for it)
            return flag
        return _truthy(flag, f"extra_args[{EXTRA_ARG!r}]")


def _truthy(value: Any, what: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value.strip().lower() in ("1", "true", "yes", "on")
    raise ValueError(f"{what} must be a boolean, got {value!r}")


def _validate(broker: str, npz_dir: str | None, serve: str | None, requests: str, curve_secret: str = "",
              broker_key: str = "", prefix_rows: str = "sentinel", step_stamp: str = "auto",
              serve_insecure: str = "", prefix_refs: str = "1") -> Settings:
    mode = step_stamp.strip().lower() if isinstance(step_stamp, str) else step_stamp
    ring, auto = mode in ("ring", "auto"), mode == "auto"
    try:
        stamp = ring or _truthy(step_stamp, ENV_STEP_STAMP)
    except ValueError:
        raise ValueError(f"{ENV_STEP_STAMP}={step_stamp!r}: choose auto, on, off or ring") from None
    try:
        refs = _truthy(prefix_refs, ENV_PREFIX_REFS)
    except ValueError:
        raise ValueError(f"{ENV_PREFIX_REFS}={prefix_refs!r}: choose 1 or 0") from None
    if prefix_rows not in PREFIX_MODES:
        raise ValueError(f"{ENV_PREFIX_ROWS}={prefix_rows!r}: choose one of {', '.join(PREFIX_MODES)}")
    if requests not in REQUEST_MODES:
        raise ValueError(f"{ENV_REQUESTS}={requests!r}: choose one of {', '.join(REQUEST_MODES)}")
    if broker and broker != EMBEDDED and "://" not in broker:
        raise ValueError(f"{ENV_BROKER}={broker!r}: expected a ZeroMQ endpoint such as tcp://host:5557, "
                         f"or {EMBEDDED!r}")
    if broker and broker != EMBEDDED and (npz_dir or serve):
        raise ValueError(f"{ENV_NPZ_DIR} and {ENV_SERVE} apply to {ENV_BROKER}={EMBEDDED} only; with an external "
                         f"broker ({broker}) run `routing-replay consume --npz-dir DIR` next to it instead")
    if bool(curve_secret) != bool(broker_key):
        raise ValueError(f"CURVE needs both {ENV_CURVE_SECRET} (this engine's NAME.key_secret) and {ENV_BROKER_KEY} "
                         f"(the broker's NAME.key); got only {ENV_CURVE_SECRET if curve_secret else ENV_BROKER_KEY}")
    if serve and broker == EMBEDDED:
        from routing_replay.protocol import security       # (here: an inert plugin imports nothing, zmq neither)
        insecure = bool(serve_insecure) and _truthy(serve_insecure, ENV_SERVE_INSECURE)
        security.check_bind(serve, curve=False, insecure=insecure, what=ENV_SERVE,
                            remedy=EMBEDDED_SERVE_REMEDY)
    if curve_secret and broker == EMBEDDED:
        raise ValueError(f"{ENV_CURVE_SECRET}/{ENV_BROKER_KEY} apply to an external broker; the embedded pipeline "
                         f"talks to its broker over ipc inside this machine")
    return Settings(broker, npz_dir or None, serve or None, requests, curve_secret or None, broker_key or None,
                    prefix_rows, stamp, ring, auto, refs)


_cache: tuple[tuple, Settings] | None = None


def current() -> Settings:
    """Settings for the environment as it is now (memoised on the raw values; raises ValueError if invalid)."""
    global _cache
    env = os.environ
    raw = (env.get(ENV_BROKER, "").strip(), env.get(ENV_NPZ_DIR, "").strip(), env.get(ENV_SERVE, "").strip(),
           env.get(ENV_REQUESTS, "all").strip().lower() or "all", env.get(ENV_CURVE_SECRET, "").strip(),
           env.get(ENV_BROKER_KEY, "").strip(), env.get(ENV_PREFIX_ROWS, "sentinel").strip().lower() or "sentinel",
           env.get(ENV_STEP_STAMP, "auto").strip().lower() or "auto", env.get(ENV_SERVE_INSECURE, "").strip(),
           env.get(ENV_PREFIX_REFS, "1").strip().lower() or "1")
    cached = _cache
    if cached is not None and cached[0] == raw:
        return cached[1]
    s = _validate(*raw)
    _cache = (raw, s)
    return s
