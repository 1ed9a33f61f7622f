"""The step ring's two Triton kernels (capture/ring_kernels.py says what they do). A module of its own so that
Triton is imported only where a step ring asks for them (ROUTING_REPLAY_RING_KERNELS is not 0)."""

import triton
import triton.language as tl


# Nothing is specialized on values (sizes, strides, pointer alignment): one compile per lane type (and
# WRITE_SLOT), all made by check() at start-up, so no compile ever happens under CUDA graph capture.
@triton.jit(do_not_specialize=["lanes_ptr", "ring_ptr", "slot_ptr", "n_lanes", "slot_lanes", "slot_stride",
                               "stamp_offset", "mask"])
def _stamp_slot_kernel(lanes_ptr, ring_ptr, slot_ptr, n_lanes, slot_lanes, slot_stride, stamp_offset, mask,
                       WRITE_SLOT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n_lanes
    v = tl.load(lanes_ptr + offs, mask=valid) + 1
    tl.store(lanes_ptr + offs, v, mask=valid)
    if WRITE_SLOT:
        slot = (v & mask).to(tl.int64)      # two's complement: (signed counter) mod S for a power of two S
        tl.store(ring_ptr + slot * slot_stride + stamp_offset + offs, v, mask=valid & (offs < slot_lanes))
        tl.store(slot_ptr + offs * 0, slot, mask=offs == 0)


@triton.jit(do_not_specialize=["src_ptr", "ring_ptr", "slot_ptr", "row_lanes", "src_layer_stride",
                               "dst_layer_stride", "slot_stride"])
def _rows_to_slot_kernel(src_ptr, ring_ptr, slot_ptr, row_lanes, src_layer_stride, dst_layer_stride,
                         slot_stride, BLOCK: tl.constexpr):
    layer = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < row_lanes
    slot = tl.load(slot_ptr)
    x = tl.load(src_ptr + layer * src_layer_stride + offs, mask=valid)
    tl.store(ring_ptr + slot * slot_stride + layer * dst_layer_stride + offs, x, mask=valid)
