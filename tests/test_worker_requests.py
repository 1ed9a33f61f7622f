"""engines/vllm_plugin/requests.py: the worker's request tracker (open, finish, abort, record keys), without vLLM.

The producer here is a stand-in that records the calls the tracker makes (open_many, end_many, abort): what goes to
the producer, in which order, is what these tests specify; the producer itself is tested on its own sockets.
"""

from types import SimpleNamespace

import pytest

from routing_replay.engines.vllm_plugin import scheduler_hooks
from routing_replay.engines.vllm_plugin.requests import RequestTracker, show_id
from routing_replay.engines.vllm_plugin.settings import Settings
from routing_replay.engines.vllm_plugin.step_batch import StepBatch
from routing_replay.engines.vllm_plugin.worker import WorkerStats


class Producer:
    """Records the tracker's calls; refuses the opens of keys in `refuse` (as Producer.open_many reports them)."""

    def __init__(self, refuse=()):
        self.calls, self.refuse, self.healthy = [], set(refuse), True

    def open_many(self, items, **kw):
        self.calls.append(("open_many", [it[0] for it in items]))
        return [(i, ValueError(f"refused {it[0]}")) for i, it in enumerate(items) if it[0] in self.refuse]

    def end_many(self, items, **kw):
        self.calls.append(("end_many", [(kind, key, n, reason) for kind, key, n, reason, _ in items]))

    def abort(self, key, reason):
        self.calls.append(("abort", key, reason))


def _sp(captured=True):
    return SimpleNamespace(extra_args={"return_routed_experts": captured})


def _new(rid, n=3, captured=True, cached=0):
    return SimpleNamespace(req_id=rid, sampling_params=_sp(captured), prompt_token_ids=list(range(n)),
                           prompt_embeds=None, num_computed_tokens=cached, block_ids=[[]])


def _tracker(producer=None, randomized=False, batch=None, **kw):
    flushes = []
    t = RequestTracker(Settings(broker="ipc://unused", requests="none"), WorkerStats(), batch=batch or StepBatch(2),
                       randomized=randomized, producer=producer or Producer(), flush=lambda: flushes.append(1),
                       **kw)
    return t, flushes


def test_an_open_waits_for_the_hand_over_and_carries_prompt_and_prefix_flag():
    t, _ = _tracker()
    assert t.open(_new("a-1", n=4, cached=2), 7, True) == "a-1"
    assert t.open(_new("b-1", captured=False), 7, False) is None        # opted out: not tracked, no open
    assert t.tracked == {"a-1": "a-1"} and t.seen == {"a-1": ("a-1", 7)} and t.gen == 1
    assert t.opens == [("a-1", ("a-1", 4, 2, [0, 1, 2, 3], True))] and t.producer.calls == []
    assert t.send_opens() is None and t.opens == [] and t.stats.opened == 1
    assert t.producer.calls == [("open_many", ["a-1"])]


def test_a_refused_open_is_not_captured_and_its_refusal_is_reported():
    refused = []
    t, _ = _tracker(Producer(refuse={"b"}))
    t.on_refused = lambda rid, key: refused.append((rid, key))
    t.open(_new("a"), 1, False)
    t.open(_new("b"), 1, False)
    assert t.send_opens() == {"b"}
    assert t.tracked == {"a": "a"} and "b" not in t.seen and refused == [("b", "b")]
    assert (t.stats.opened, t.stats.skipped) == (1, 1)


def test_finishes_wait_for_the_batch_that_holds_their_rows_then_go_in_one_call():
    batch = StepBatch(2)
    t, flushes = _tracker(batch=batch)
    for rid in ("a", "b", "c"):
        t.open(_new(rid), 1, False)
    t.send_opens()
    batch.parts.append(object())            # rows of the step wait in the batch
    notes = {"a": scheduler_hooks.Finished(2, "stop", [5, 6]), "b": scheduler_hooks.Finished(0, "abort", [])}
    t.end(["a", "b", "x"], notes)           # (x: not captured here)
    assert t.tracked == {"c": "c"} and t.closing == {"a": ("a", notes["a"]), "b": ("b", notes["b"])}
    assert flushes == [] and t.producer.calls == [("open_many", ["a", "b", "c"])]
    closing = t.closing
    batch.parts.clear()                     # (the worker's flush handed the batch over)
    t.handed_over()
    assert t.closing is closing and closing == {} and t.ended == [] and set(t.seen) == {"c"}
    assert t.producer.calls[1:] == [("end_many", [("finish", "a", 2, "stop"), ("abort", "b", 0, "abort")])]
    assert (t.stats.finished, t.stats.aborted) == (1, 1)


def test_a_finish_without_a_note_flushes_first_and_an_empty_batch_lets_it_go_at_once():
    batch = StepBatch(2)
    t, flushes = _tracker(batch=batch, runner=SimpleNamespace(requests={"a": SimpleNamespace(output_token_ids=[9])}))
    t.open(_new("a"), 1, False)
    t.open(_new("b"), 1, False)
    batch.parts.append(object())
    t.end({"a"}, None)                      # no notes: the runner's view, after the rows (a flush)
    assert flushes == [1]
    assert t.producer.calls == [("open_many", ["a", "b"]), ("end_many", [("finish", "a", 1, "unknown")])]
    batch.parts.clear()
    t.end({"b"}, {"b": scheduler_hooks.Finished(3, "length", [1, 2, 3])})     # nothing batched: now
    assert flushes == [1] and t.producer.calls[-1] == ("end_many", [("finish", "b", 3, "length")])
    assert t.tracked == {} and t.ended == ["a", "b"]


def test_keys_are_unique_among_live_requests_and_restart_resends_the_live_opens():
    """A request whose key a live request holds (tracked, or ended with its finish not yet sent) is captured as
    key#n, the smallest free; a key is free again once its request ended. After a helper restart the opens of the
    requests captured then, and still captured, are queued again."""
    t, flushes = _tracker(randomized=True)
    t.keep_opens = True                             # embedded: opens kept to send again

    def end(rid):                                   # as the tracker ends a request
        t.tracked.pop(rid)
        t.gen += 1

    for rid in ["dupid-0000000a", "dupid-0000000b", "dupid-0000000c", "other-0000000d"]:
        t.open(_new(rid), 1, False)
    assert list(t.tracked.values()) == ["dupid", "dupid#1", "dupid#2", "other"]
    end("dupid-0000000b")
    t.open(_new("dupid-0000000e"), 2, False)        # the smallest free number again
    end("dupid-0000000a")
    t.open(_new("dupid-0000000f"), 2, False)        # the plain key is free once its request ended
    t.closing["late"] = ("late-00000001", None)     # ended, finish not yet handed over: still live
    t.open(_new("late-00000002"), 2, False)
    assert [t.tracked[r] for r in ("dupid-0000000e", "dupid-0000000f", "late-00000002")] == \
        ["dupid#1", "dupid", "late#1"]
    assert t.stats.duplicate_keys == 4 and [it[0] for _, it in t.opens] == \
        ["dupid", "dupid#1", "dupid#2", "other", "dupid#1", "dupid", "late#1"]
    assert flushes == []
    t.closing.clear()
    # the helper died and came back: the opens of what is captured then go again, once
    t.opens = []
    t.helper_restarted()
    end("other-0000000d")
    t.open(_new("new-00000003"), 3, False)          # opened after the restart: its own open is queued
    t.reopen()
    assert sorted(it[0] for _, it in t.opens) == ["dupid", "dupid#1", "dupid#2", "late#1", "new"]
    assert not t.reopen_due


def test_a_key_whose_finish_has_not_gone_is_still_live():
    t, flushes = _tracker()
    t.closing["k"] = ("k-old", None)
    assert t.open(_new("k"), 1, False) == "k#1" and flushes == [] and t.stats.duplicate_keys == 1


def test_show_id_escapes_and_cuts():
    assert show_id("abc") == "'abc'"
    assert show_id("\udc80x") == "'\\udc80x'"
    assert show_id("a" * 100, limit=10) == "'aaaaaaaaa... (100 chars)"


@pytest.mark.parametrize("producer_healthy", [True, False])
def test_an_open_that_fails_is_skipped_unless_the_producer_failed(producer_healthy):
    p = Producer()
    p.healthy = producer_healthy
    t, _ = _tracker(p)
    bad = _new("a")
    bad.prompt_token_ids = None                     # no tokens and no embeddings: the open fails
    bad.prompt_embeds = None
    if producer_healthy:
        assert t.open(bad, 1, False) is None and t.stats.skipped == 1 and t.tracked == {}
    else:
        with pytest.raises(AttributeError):
            t.open(bad, 1, False)
