"""The step ring's device writes as two Triton kernels (CUDA), in place of four torch kernels.

RoutingCache.flush with a step ring (capture/cache.py) ends every complete step with: the stamp add (+1 in every
lane of the stamp layer), `torch.remainder` of the counter into the slot index, then two `index_copy_` (the
stamps, then the rows, into that slot). Four small kernels, part of every captured CUDA graph: they make the
step's capture work on the compute stream about twice that of stamps and a snapshot (docs/PERFORMANCE.md). Here
the same writes are two kernels:

- `stamp_slot`: every lane of the stamp layer v -> v + 1, and the same new value into the stamp lanes of slot
  (v + 1) mod S of the ring, and the slot index into a one-element tensor. Every element reads only its own lane
  (all lanes hold the same counter), so no element sees another's write;
- `rows_to_slot`: the step's n rows of every layer into that slot, the slot index read from that tensor. It runs
  after `stamp_slot` on the same stream: the stamps land before the rows, the order the reader relies on
  (capture/cache.py, "Step ring").

Bits are moved as 64-bit lanes (top_k a multiple of 4) or 32-bit ones (even top_k), the stamps' own lane type.
`available(device)` says whether Triton can run here; `check(device)` runs both kernels once on scratch memory of
that device against the torch path and says whether the results are bit-exact (RoutingCache falls back to the
torch kernels otherwise). On by default (ROUTING_REPLAY_RING_KERNELS=0 turns them off). They are checked bit for
bit against the torch path in Triton's CPU interpreter (TRITON_INTERPRET=1 runs the same kernels on CPU tensors:
the tests do that on machines without a GPU), on CUDA by tests/test_capture_gpu.py, and on the device at start-up.
With them a ring step's capture work on the compute stream is no more than that of stamps and a snapshot
(docs/PERFORMANCE.md, "The step ring, written by two Triton kernels"), so ROUTING_REPLAY_STEP_STAMP=auto (the
default) uses the ring.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("routing_replay.capture")

ENV = "ROUTING_REPLAY_RING_KERNELS"     # `0`: the torch kernels; anything else (default `1`): these where they run
_BLOCK = 1024                           # lanes per program (one compile per kernel: sizes are not specialized)
_checked: dict = {}                     # device -> whether check() passed
_module = None                          # capture/_ring_triton.py once imported; False: it cannot be


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _triton():
    """capture/_ring_triton.py (the kernels), imported on first use; None where Triton cannot be imported or cannot
    define them (one WARNING)."""
    global _module
    if _module is None:
        try:
            from routing_replay.capture import _ring_triton
            _module = _ring_triton
        except Exception as e:          # noqa: BLE001 -- not installed, or an incompatible Triton: the torch path
            log.warning("routing-replay: the step ring's Triton kernels are not available (%s: %s); using the torch "
                        "kernels", type(e).__name__, str(e)[:200])
            _module = False
    return _module or None


def available(device: torch.device) -> bool:
    """Whether the kernels are wanted (ROUTING_REPLAY_RING_KERNELS, `1` by default; `0` keeps the torch kernels)
    and can run on `device`: a CUDA device (or CPU under Triton's interpreter), and Triton importable."""
    if os.environ.get(ENV, "1").strip() == "0":
        return False
    if not (device.type == "cuda" or (device.type == "cpu" and interpreting())):
        return False
    return _triton() is not None


class RingKernels:
    """The two launches for one RoutingCache's stamp layer and step ring (shapes and lane views fixed at
    construction; each call is one kernel launch on the current stream, graph-safe, no host read)."""

    def __init__(self, full: torch.Tensor, ring: torch.Tensor, slot: torch.Tensor):
        # full: (L + 1, T, K) int16, the cache with its stamp layer last; ring: (S, L + 1, R, K) int16;
        # slot: (1,) int64, where stamp_slot leaves the slot index for rows_to_slot
        k = _triton()
        if k is None:
            raise RuntimeError("the step ring's Triton kernels are not available")
        self._k = k
        L1, T, K = full.shape
        S, _, R, _ = ring.shape
        lane = torch.int64 if K % 4 == 0 else torch.int32
        per = K // (4 if lane == torch.int64 else 2)            # lanes per row
        self._full = full.view(lane)                              # (L + 1, T, per)
        self._ring = ring.view(lane)                              # (S, L + 1, R, per)
        self._slot = slot
        self._stamp_lanes = self._full[L1 - 1]                    # (T, per)
        self._per = per
        self._n_lanes = T * per
        self._slot_lanes = R * per
        self._slot_stride = L1 * R * per
        self._stamp_offset = (L1 - 1) * R * per
        self._src_layer_stride = T * per
        self._dst_layer_stride = R * per
        self._layers = L1 - 1
        self._mask = S - 1
        self._stamp_grid = (-(-self._n_lanes // _BLOCK),)

    def stamp_slot(self, write_slot: bool = True) -> None:
        """+1 in every stamp lane; with write_slot, the new stamps into slot (counter mod S) and its index into
        the slot tensor."""
        self._k._stamp_slot_kernel[self._stamp_grid](
            self._stamp_lanes, self._ring, self._slot, self._n_lanes, self._slot_lanes, self._slot_stride,
            self._stamp_offset, self._mask, WRITE_SLOT=write_slot, BLOCK=_BLOCK)

    def rows_to_slot(self, n: int) -> None:
        """Rows [0, n) of every routing layer into the slot stamp_slot picked (n <= the ring's rows per slot)."""
        row_lanes = n * self._per
        self._k._rows_to_slot_kernel[(-(-row_lanes // _BLOCK), self._layers)](
            self._full, self._ring, self._slot, row_lanes, self._src_layer_stride, self._dst_layer_stride,
            self._slot_stride, BLOCK=_BLOCK)


def check(device: torch.device) -> bool:
    """Run both kernels on scratch memory of `device` beside the torch path (capture/cache.py's) and compare bit
    for bit: a counter near a lane type's wrap, a slot write and a step of a few rows, twice. Cached per device;
    False (and one WARNING) when they differ or fail, so the caller keeps the torch kernels."""
    key = str(device)
    ok = _checked.get(key)
    if ok is not None:
        return ok
    ok = False
    try:
        ok = _compare(device)
        if not ok:
            log.warning("routing-replay: the step ring's Triton kernels differ from the torch path on %s; using "
                        "the torch kernels", device)
    except Exception as e:              # noqa: BLE001 -- a compile or launch failure: the torch path
        log.warning("routing-replay: the step ring's Triton kernels failed on %s (%s: %s); using the torch "
                    "kernels", device, type(e).__name__, str(e)[:200])
    _checked[key] = ok
    return ok


def _compare(device: torch.device) -> bool:
    results = []
    for fused in (False, True):
        for K in (8, 6):                # 64-bit and 32-bit lanes
            L, T, S, R = 3, 20, 4, 12
            g = torch.Generator().manual_seed(K)
            full = torch.randint(-1, 127, (L + 1, T, K), generator=g, dtype=torch.int16).to(device)
            lane = torch.int64 if K % 4 == 0 else torch.int32
            full[L].view(lane).fill_(torch.iinfo(lane).max - 1)     # wraps on the second step
            ring = torch.full((S, L + 1, R, K), -1, dtype=torch.int16, device=device)
            slot = torch.zeros(1, dtype=torch.int64, device=device)
            kern = RingKernels(full, ring, slot) if fused else None
            for n in (5, 12, 20):       # the last one is larger than a slot: the stamp add alone
                full[:L, :n] += 1
                if fused:
                    kern.stamp_slot(n <= R)
                    if n <= R:
                        kern.rows_to_slot(n)
                else:
                    full[L].view(lane).add_(1)
                    if n <= R:
                        torch.remainder(full[L].view(lane)[0, :1], S, out=slot)
                        ring[:, L].index_copy_(0, slot, full[L, :R].unsqueeze(0))
                        ring[:, :L, :n].index_copy_(0, slot, full[:L, :n].unsqueeze(0))
            results.append((full.cpu(), ring.cpu(), slot.cpu()))
    half = len(results) // 2
    return all(torch.equal(a, b) for x, y in zip(results[:half], results[half:]) for a, b in zip(x, y))
