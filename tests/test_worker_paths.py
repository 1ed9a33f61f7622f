"""The worker's parts chosen once from its plan: the step path (step_paths.py), the batch reader (runners.py), and
the typed parts a StepBatch holds (step_batch.py). Built through the public constructor (tests/standins.py)."""

from types import SimpleNamespace

import numpy as np
import torch

from routing_replay.engines.vllm_plugin.runners import V1BatchReader, V2BatchReader, batch_reader
from routing_replay.engines.vllm_plugin.settings import Settings
from routing_replay.engines.vllm_plugin.step_batch import HostRef, SlotRef, StepBatch
from routing_replay.engines.vllm_plugin.step_paths import HostPath, RingPath, StepPath
from tests.standins import worker_capture


def test_each_plan_gets_its_step_path_and_post_step_checks_only_what_it_chose():
    host = worker_capture(Settings(broker="ipc://unused"))                  # CPU, enforce_eager
    assert type(host.path) is HostPath and host.path.fast is None
    assert host.path.host_raw == host.path.host_step_raw and host.binding.take_step == host.path.take_step
    ring = worker_capture(Settings(broker="ipc://unused", ring_needs_kernels=False), eager=False,
                          device_type="cuda", max_tokens=64)
    assert type(ring.path) is RingPath and ring.path.fast == ring.path.ring_step and ring.path.host_raw is None
    assert (ring.cache.slots, ring.cache.slot_rows, ring.batch.stamps is not None) == (64, 64, True)
    plain = worker_capture(Settings(broker="ipc://unused", step_stamp=False), eager=False, device_type="cuda")
    assert type(plain.path) is StepPath and (plain.path.fast, plain.path.host_raw) == (None, None)
    assert not hasattr(plain.binding, "take_step") and plain.batch.stamps is None and plain.cache.slots == 0


def test_batch_readers_read_the_v1_persistent_batch_and_share_the_last_steps_id_copy():
    ids = ["a", "b", "c", "d"]
    ib = SimpleNamespace(num_reqs=3, req_ids=ids, num_computed_tokens_cpu=np.array([5, 0, 9, 7], np.int32))
    runner = SimpleNamespace(input_batch=ib, query_start_loc=SimpleNamespace(np=np.array([0, 1, 4, 6, 9], np.int32)))
    reader = batch_reader(runner, "v1")
    assert type(reader) is V1BatchReader and type(batch_reader(runner, "v2")) is V2BatchReader
    req_ids, qsl, computed = reader.layout()
    assert (req_ids, qsl.tolist(), computed.tolist()) == (["a", "b", "c"], [0, 1, 4, 6], [5, 0, 9])
    got, cb, qb, dtypes = reader.raw_step()
    assert got == ["a", "b", "c"] and got is not ids
    assert (np.frombuffer(cb, np.int32).tolist(), np.frombuffer(qb, np.int32).tolist()) == ([5, 0, 9], [0, 1, 4, 6])
    assert dtypes == (np.dtype(np.int32), np.dtype(np.int32))
    assert reader.raw_step()[0] is got                  # the batch repeats: the same copy, no new list


def test_a_step_batch_holds_typed_parts_for_what_goes_by_reference():
    b = StepBatch(2, stamped=True)
    dt = (np.dtype(np.int32), np.dtype(np.int32))
    b.add_slot(2, 3, 5, ["k"], [7], [3], forward=4)
    b.add_raw(0, 6, 6, ["e1", "e2"], b"c", b"q", 5, dt)
    t = [torch.zeros(6, 2, dtype=torch.int32)] * 3
    b.add_host(t, 48, 6, ["e1", "e2"], b"c", b"q", dt, 6)
    assert b.parts == [SlotRef(2, 3, 5, None), SlotRef(0, 6, 6, dt), HostRef(t, 48, 6, dt)]
    assert (b.raw, b.by_ref, b.rows, b.forwards, b.ringed) == ([1, 2], 2, 15, [4, 5, 6], True)
    assert b.extra == 3 * (48 - 6 * 2 * 2)              # each layer's int32 tensor beyond its 6 int16 rows
