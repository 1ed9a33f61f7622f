"""Tell stale routing rows from fresh ones: the step stamps a stamped RoutingCache writes, checked on the producer's
thread against the engine's own count of forwards (StampCheck), and the two errors a batch of rows can raise.

LostHookError: a MoE layer's hook did not record a step that captured a request; the rows are refused, never
published. RingReadLost: rows read from the step ring (or the host ring) cannot be shown to be their step's; they
are reported lost, never wrong.
"""

from __future__ import annotations

import numpy as np

from routing_replay.capture.cache import read_stamp, stamp_bits, stamp_lanes
from routing_replay.producer.handover import RowsLost


class LostHookError(RuntimeError):
    """A MoE layer did not record its routing in a step that captured a request: never publish stale rows."""


class RingReadLost(RowsLost):
    """Rows read from the step ring cannot be shown to be their step's (a later step reused the slot before it was
    read, or the device counted a forward the engine did not), or the host ring had no room for them: the batch's
    positions are reported lost (not refused: nothing was wrong with what the forward wrote)."""


STEP_RING_SLOTS = 64                # steps the producer's thread may fall behind before step-ring rows are lost


class StampCheck:
    """Check, on the producer's thread, that each step's rows were written by the forward of that step. The stamped
    cache (RoutingCache(stamp=True)) counts complete flushes on the device; the engine thread counts the forwards
    it launched (WorkerCapture.forwards, steps with tokens). Their difference, the offset, can only grow (a forward
    the engine did not launch through execute_model, e.g. a data-parallel dummy batch, adds a flush and no
    forward). A step whose stamp leaves the offset below the last one's had a forward without a complete flush:
    its hooks did not run (a graph replayed without them) or missed a layer, so its rows are stale:
    LostHookError. So are rows of one step that carry different stamps.

    A refusal moves the offset to what the device counted (the stale step's stamp, or the batch's checkpoint), so
    one lost flush loses the batch that holds it and the steps after it are checked, and published, against the
    new count: a graph that never stamps is still refused at every step (each falls one more flush behind)."""

    __slots__ = ("mask", "offset", "steps", "resyncs")

    def __init__(self, top_k: int):
        self.mask = (1 << stamp_bits(top_k)) - 1
        self.offset: int | None = None      # flushes - forwards (mod 2**bits): from baseline() or the first step
        self.steps = 0
        self.resyncs = 0                    # refusals after which the offset moved to the device's count

    def baseline(self, stamp: int, forwards: int) -> None:
        """The device counter and the engine's forward count at a quiet point (after warm-up), so that the very
        first step is checked too."""
        self.offset = (stamp - forwards) & self.mask

    def __call__(self, stamps: np.ndarray, forward: int) -> None:
        v = read_stamp(stamps)
        if v is None:
            lanes = stamp_lanes(stamps)
            bad = int(np.argmax((lanes != lanes.flat[0]).any(axis=1)))
            raise LostHookError(f"routing-replay: rows of one step carry different step stamps (row 0 and row "
                                f"{bad} of {len(stamps)}): a capture hook was lost for some of the step's tokens. "
                                "Refusing to publish stale routing.")
        off = (v - forward) & self.mask
        last = self.offset
        if last is not None:
            behind = (last - off) & self.mask
            if 0 < behind <= self.mask >> 1:
                self.offset = off           # later steps are checked against what the device counted
                self.resyncs += 1
                raise LostHookError(f"routing-replay: the rows of forward {forward} carry step stamp {v}: {behind} "
                                    "complete flush(es) fewer than forwards since the last checked step. The "
                                    "forward did not run the capture hooks of every MoE layer (e.g. a CUDA graph "
                                    "replayed without them). Refusing to publish stale routing; later steps are "
                                    "checked against the device's count")
        self.offset = off
        self.steps += 1

    def exact(self, stamps: np.ndarray, forward: int, where: str) -> None:
        """Step-ring rows (read from the slot the offset predicts for `forward`): their stamps must be the ones
        that forward's flush wrote. Older: the forward did not write the slot (LostHookError); newer, or lanes
        that differ: a later step reused the slot before it was read (RingReadLost)."""
        mask = self.mask
        want = (forward + self.offset) & mask
        v = read_stamp(stamps)
        if v == want:
            self.steps += 1
            return
        if v is not None and 0 < ((want - v) & mask) <= mask >> 1:
            raise LostHookError(f"routing-replay: {where} of forward {forward} holds step stamp {v}, its flush "
                                f"would have written {want}: the forward did not run the capture hooks of every "
                                "MoE layer (e.g. a CUDA graph replayed without them). Refusing to publish stale "
                                "routing.")
        raise RingReadLost(f"routing-replay: {where} of forward {forward} was reused by a later step (stamp "
                           f"{'mixed' if v is None else v}, expected {want}) before the producer's thread read it "
                           "(it fell behind by the ring's size): the batch's rows are lost, never wrong")

    def checkpoint(self, value: int, forward: int) -> None:
        """The device counter at the batch's hand-over, when the engine had launched `forward` forwards: equal to
        forward + offset, or some step-ring read of the batch may have taken another forward's slot."""
        mask = self.mask
        want = (forward + self.offset) & mask
        v = value & mask
        if v == want:
            return
        ahead = (v - want) & mask
        if 0 < ahead <= mask >> 1:
            self.offset = (v - forward) & mask
            raise RingReadLost(f"routing-replay: the device counted {ahead} complete flush(es) more than the "
                               f"engine's forwards by forward {forward} (a forward the engine did not launch through "
                               "execute_model): this batch's step-ring reads may hold another forward's rows, so its "
                               "rows are reported lost; later steps use the new offset")
        self.resync(v, forward)             # later batches read the slots the device writes now
        raise LostHookError(f"routing-replay: the device counted {(want - v) & mask} complete flush(es) fewer than "
                            f"the engine's {forward} forwards at the hand-over: a forward did not run the capture "
                            "hooks of every MoE layer. Refusing to publish stale routing; later batches use the "
                            "device's count")

    def resync(self, value: int | None, forward: int) -> None:
        """After a step-ring read of a batch was refused: the offset from the batch's checkpoint (the device
        counter at the hand-over, when the engine had launched `forward` forwards), so that a lost flush does not
        make every later batch read the slot before its own. None (no checkpoint taken): nothing."""
        if value is None:
            return
        off = (value - forward) & self.mask
        if off != self.offset:
            self.offset = off
            self.resyncs += 1
