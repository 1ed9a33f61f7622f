"""Record keys stay unique: duplicate naming (protocol.ids) and the consumer's renaming of a reused key
(consumer/keys.py), on records and files alone; the real engine and OpenAI server are in test_vllm_request_ids.py."""

import numpy as np

from routing_replay.consumer.keys import RecordKeys
from routing_replay.consumer.npz import NpzIndex, read_record, record_files, write_record
from routing_replay.protocol import wire
from routing_replay.protocol.ids import duplicate_key, is_key_of, record_key_for


def _rec(rid, prompt, output, fill=1):
    P, G = len(prompt), len(output)
    return wire.Record(request_id=rid, prompt_routed_experts=np.full((P, 2, 2), fill, np.int16),
                       routed_experts=np.full((G, 2, 2), fill, np.int16), num_cached_tokens=0,
                       moe_layer_ids=np.arange(2, dtype=np.int32), complete=True, finish_reason="length",
                       prompt_token_ids=np.asarray(prompt, np.int32), output_token_ids=np.asarray(output, np.int32))


def test_duplicate_names_and_matching():
    assert duplicate_key("dupid", 1) == "dupid#1" and duplicate_key("0_cmpl-x-0", 2) == "0_cmpl-x-0#2"
    long = "a" * 1023
    assert duplicate_key(long, 1) == record_key_for(long + "#1") and duplicate_key(long, 1).startswith("rr-sha256-")
    keys = ["dupid", "dupid#1", "dupid#2", "dupid#1#1", "dupid#", "dupid#01", "dupid2", "dupid#x", "0_dupid", "dup"]
    assert [k for k in keys if is_key_of(k, "dupid")] == ["dupid", "dupid#1", "dupid#2", "dupid#1#1"]
    assert [k for k in keys if is_key_of(k, "dupid#1")] == ["dupid#1", "dupid#1#1"]


def test_a_reused_key_is_renamed_in_memory_and_against_files_and_a_resend_keeps_its_key(tmp_path):
    held = {"live"}
    index = NpzIndex(tmp_path)
    keys = RecordKeys(held.__contains__, index.read, remember=2)
    a = keys.name(_rec("k", [1, 2], [3]))
    assert a.request_id == "k"
    b = keys.name(_rec("k", [5, 6], [7], fill=2))            # the id reused: a second record, its own key
    assert b.request_id == "k#1"
    c = keys.name(_rec("k", [8], [9], fill=3))
    assert c.request_id == "k#2" and keys.renamed == 2
    assert keys.name(_rec("live", [1], [2])).request_id == "live#1"    # a request in flight holds the key
    for r in (a, b, c):
        write_record(tmp_path, r)
    # a restarted consumer (nothing remembered): the files hold the keys
    keys2 = RecordKeys(set().__contains__, NpzIndex(tmp_path).read)
    d = keys2.name(_rec("k", [10], [11], fill=4))
    assert d.request_id == "k#3"
    write_record(tmp_path, d)
    # the same request sent again (same tokens in and out): keeps its key, its file is written again
    again = keys2.name(_rec("k#1", [5, 6], [7], fill=2))
    assert again.request_id == "k#1" and keys2.renamed == 1
    names = sorted(p.name for p in record_files(tmp_path))
    assert names == ["k%231.npz", "k%232.npz", "k%233.npz", "k.npz"]
    got = {p.name: read_record(p) for p in record_files(tmp_path)}
    assert [int(got[n].prompt_routed_experts[0, 0, 0]) for n in names] == [2, 3, 4, 1]
    assert [got[n].request_id for n in names] == ["k#1", "k#2", "k#3", "k"]
