"""The engines -> producer contract (producer/handover.py): what deferred rows must have, the defaults of what they
may lack, and the TypeError at publish time for an object that is not rows at all."""

from __future__ import annotations

import numpy as np
import pytest

from routing_replay.producer import Producer
from routing_replay.producer.coalesce import RequestMajor, StepParts
from routing_replay.producer.handover import CallerRows, RowsBase, deferred_rows

L, K = 2, 2


class Minimal:
    """The least a caller's deferred rows may be: shape, dtype, result()."""

    def __init__(self, a):
        self.a, self.shape, self.dtype = a, a.shape, a.dtype

    def result(self):
        return self.a


@pytest.fixture
def producer():
    p = Producer("tcp://127.0.0.1:9", num_layers=L, top_k=K, linger_ms=0)
    yield p
    p.close(timeout_s=0)


def test_an_object_that_is_not_rows_is_refused_at_publish_time_naming_what_it_lacks(producer):
    p = producer
    p.open("a", prompt_len=8)

    class NoResult:
        shape, dtype = (2, L, K), np.dtype(np.int16)

    class Nothing:
        pass

    class SaysDeferred(Minimal):
        deferred = True

    with pytest.raises(TypeError, match=r"rows of type .*NoResult are neither an ndarray nor deferred rows: "
                                        r"missing result\(\) \(producer/handover.py, DeferredRows\)"):
        p.publish_rows(["a"], [0], [2], NoResult())
    with pytest.raises(TypeError, match=r"missing shape, dtype, result\(\)"):
        p.publish_rows(["a"], [0], [2], Nothing())
    with pytest.raises(TypeError, match=r"missing shape, dtype, result\(\)"):
        p.publish_steps([["a"]], [[0]], [[2]], [[1, 2]])        # a list is not rows
    with pytest.raises(TypeError, match=r"missing resolve\(\) \(it says deferred=True\)"):
        p.publish_steps([["a"]], [[0]], [[2]], SaysDeferred(np.zeros((2, L, K), np.int16)), checked=True)
    assert p.stats.dropped_msgs == 0 and p.queued_msgs == 1          # only the open went in


def test_a_callers_partial_object_gets_the_defaults():
    a = np.arange(2 * 3 * L * K, dtype=np.int16).reshape(6, L, K)      # 2 steps of 3 requests, step-major
    rows = deferred_rows(Minimal(a))
    assert type(rows) is CallerRows
    assert (rows.shape, rows.dtype, rows.dropped, rows.extra_nbytes, rows.deferred) == ((6, L, K), np.int16, False,
                                                                                         0, False)
    assert rows.owns_result                 # no release(): its result() stays valid
    assert rows.resolve(["x"], [0], [1]) == (["x"], [0], [1])
    want = a.reshape(2, 3, L, K).swapaxes(0, 1).reshape(6, L, K)
    np.testing.assert_array_equal(rows.result_request_major(2), want)
    inverse = np.array([2, 0, 1])
    np.testing.assert_array_equal(rows.result_request_major(2, inverse)[[4, 5, 0, 1, 2, 3]], want)
    rows.release()                          # nothing to give back


def test_a_callers_members_are_used_and_read_when_asked():
    class Slot(Minimal):
        released = 0
        dropped = False

        def release(self):
            Slot.released += 1

    s = Slot(np.zeros((4, L, K), np.int16))
    rows = deferred_rows(s)
    assert not rows.owns_result             # release() gives its memory back: the producer copies first
    s.dropped = True
    assert rows.dropped                     # read from the object, not a copy taken at wrap time
    rows.release()
    assert Slot.released == 1


def test_an_engine_class_that_subclasses_rowsbase_passes_as_it_is_and_resolves_on_the_producers_thread():
    class EngineRows(RowsBase):
        __slots__ = ("shape", "dtype", "_a", "released")
        deferred = True

        def __init__(self, a):
            self.shape, self.dtype, self._a, self.released = a.shape, a.dtype, a, 0

        def resolve(self, request_ids, starts, counts):          # engine ids -> record keys, one row left out
            self._a = self._a[1:]
            self.shape = self._a.shape
            return [[f"key-{r}" for r in ids[1:]] for ids in request_ids], [s[1:] for s in starts], \
                [c[1:] for c in counts]

        def result(self):
            return self._a

        def release(self):
            self.released += 1

    a = np.arange(3 * L * K, dtype=np.int16).reshape(3, L, K)
    rows = EngineRows(a)
    assert deferred_rows(rows) is rows
    step = StepParts([[7, 8, 9]], [[0, 4, 6]], [[1, 1, 1]], rows).step()
    assert (step.request_ids, step.starts, step.counts) == (["key-8", "key-9"], [4, 6], [1, 1])
    assert step.rows is rows and rows.shape == (2, L, K)
    np.testing.assert_array_equal(rows.result(), a[1:])


def test_request_major_of_deferred_rows_takes_their_own_copy_and_releases_them_once():
    a = np.arange(4 * L * K, dtype=np.int16).reshape(4, L, K)         # 2 steps of 2 requests

    class Own(Minimal):
        released = 0
        calls: list = []

        def result_request_major(self, steps, inverse=None):
            Own.calls.append((steps, inverse))
            return self.a[[0, 2, 1, 3]]

        def release(self):
            Own.released += 1

    rm = RequestMajor(deferred_rows(Own(a)), 2)
    assert rm.owns_result and not rm.dropped and rm.shape == (4, L, K)
    np.testing.assert_array_equal(rm.result(), a[[0, 2, 1, 3]])
    rm.release()
    assert Own.calls == [(2, None)] and Own.released == 1
    np.testing.assert_array_equal(RequestMajor(a, 2).result(), a[[0, 2, 1, 3]])
