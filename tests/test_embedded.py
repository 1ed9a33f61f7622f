"""The embedded pipeline (engines/embedded.py): its wiring, used by the Python API and the vLLM plugin's helper."""

import threading

import numpy as np
import pytest
import zmq

from routing_replay.apps.embedded import EmbeddedPipeline
from routing_replay.producer import Producer

L, K = 3, 2


def test_a_bad_consumer_argument_raises_before_any_thread_starts():
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(ValueError, match="finish_grace_s"):
        EmbeddedPipeline(finish_grace_s=-1.0)
    assert {t.ident for t in threading.enumerate()} - before == set()


def test_a_given_frontend_takes_producers_of_other_contexts(tmp_path):
    got = {}
    front = f"ipc://{tmp_path}/front"
    with EmbeddedPipeline(frontend=front, on_record=lambda r: got.__setitem__(r.request_id, r),
                          finish_grace_s=0) as pipe:
        assert pipe.frontend == front
        rows = np.arange(4 * L * K, dtype=np.int16).reshape(4, L, K) % 7
        with Producer(front, num_layers=L, top_k=K, context=zmq.Context()) as p:    # not the pipeline's context
            p.open("r", prompt_len=3, num_cached_tokens=0)
            p.publish_rows(["r"], [0], [4], rows)
            p.finish("r", num_output_tokens=2)
            assert p.flush(30)
        assert pipe.wait_idle(30)
    r = got["r"]
    assert r.complete
    np.testing.assert_array_equal(r.prompt_routed_experts, rows[:3])
    np.testing.assert_array_equal(r.routed_experts, np.concatenate([rows[3:], np.full((1, L, K), -1, np.int16)]))
