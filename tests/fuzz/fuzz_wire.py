"""Coverage-guided fuzzing (atheris) of what a consumer does with bytes from the network.

Each input becomes one message: either raw bytes as the header frame, or a valid header template (open, delta,
finish, abort, record) with one field replaced by a fuzzed msgpack value, plus fuzzed payload frames. The
message goes through wire.decode_header, the parse_* functions, wire.decode_record and a long-lived
consumer Accumulator. Invariants checked on every input:
  * nothing but wire.ProtocolError is raised (any other exception is a crash that atheris reports);
  * the accumulator never holds more than its max_bytes;
  * every 200 inputs a well-formed request is streamed through the same Accumulator and its record must be
    bit-exact: hostile messages never corrupt another request's record;
  * every 1,000 inputs the process's resident memory is under MAX_RSS_BYTES (read from /proc/self/statm: libFuzzer's
    own -rss_limit_mb reads the peak from getrusage, which a process started by a large one, such as pytest,
    inherits across exec, so tests/test_fuzz.py turns that one off).

    python tests/fuzz/fuzz_wire.py -runs=200000          # bounded run, exit 0 when no invariant broke
    python tests/fuzz/fuzz_wire.py -max_total_time=600   # a longer campaign

Needs `pip install atheris` (the `fuzz` extra). tests/test_fuzz.py runs a short campaign when atheris is
installed; hypothesis covers the same ground without it.
"""

import os
import sys

import atheris

with atheris.instrument_imports():
    import msgpack
    import numpy as np

    from routing_replay.consumer.accumulator import Accumulator
    from routing_replay.protocol import wire

L, K = 4, 2
ROW = L * K * 2
MAX_BYTES = 4 << 20
MAX_RSS_BYTES = 1 << 30             # this process, instrumented modules included, runs at ~75 MB
acc = Accumulator(finish_grace_s=0.0, max_bytes=MAX_BYTES, max_positions=1 << 12, max_record_bytes=1 << 22)
counts = {"inputs": 0, "refused": 0, "accepted": 0, "good_checked": 0}
now = [0.0]

TEMPLATES = [
    ["open", "p", 1, 1, "f-a", {"prompt_len": 6, "num_cached": 2, "num_layers": L, "top_k": K,
                                "layer_ids": list(range(L))}],
    ["delta", "p", 1, 2, ["f-a", "f-b"], wire.delta_body([0, 3], [3, 2], L, K)],
    ["opens", "p", 1, 1, ["f-c", "f-d"], wire.opens_body([4, 5], [0, 2], L, K, list(range(L)), None, [False, True])],
    # batched steps (a producer's coalesced queue, the vLLM plugin's 16-step batches): ids repeat, in position order
    ["delta", "p", 1, 2, ["f-a", "f-b", "f-a", "f-b", "f-a"], wire.delta_body([0, 3, 3, 5, 4], [3, 2, 1, 1, 1], L, K)],
    ["finish", "p", 1, 3, "f-a", {"num_output": 2, "reason": "stop", "prompt_len": 6, "num_cached": 2}],
    ["finishes", "p", 1, 3, ["f-c", "f-d"], {"entries": [{"num_output": 2, "reason": "stop", "lost": [[0, 1]]},
                                                          {"num_output": 1, "prompt_len": 5, "num_cached": 2}]}],
    ["abort", "p", 1, 4, "f-b", {"reason": "abort", "num_output": 1}],
    ["record", "c", 1, 0, "f-a", {"prompt_len": 6, "num_output": 2, "num_cached": 2, "num_layers": L, "top_k": K,
                                  "layer_ids": list(range(L)), "complete": True, "missing": [], "reason": "",
                                  "finish_reason": "stop", "n_prompt_tokens": -1, "n_output_tokens": -1}],
]


def _message(data: bytes) -> tuple[bytes, list]:
    fdp = atheris.FuzzedDataProvider(data)
    mode = fdp.ConsumeIntInRange(0, 3)
    if mode == 0:                                   # raw header bytes
        head = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 512))
    else:                                           # a valid template with one field fuzzed
        t = [wire.PROTOCOL_VERSION] + [x.copy() if isinstance(x, (dict, list)) else x
                                       for x in TEMPLATES[fdp.ConsumeIntInRange(0, len(TEMPLATES) - 1)]]
        raw = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64))
        try:
            value = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        except Exception:
            value = raw
        if mode == 1:
            t[fdp.ConsumeIntInRange(0, len(t) - 1)] = value
        else:
            body = t[6]
            names = sorted(body) + ["layer_lo", "layer_hi", "lost", "reassigned", "n_prompt_tokens", "prefix_filled",
                                    "entries"]
            body[names[fdp.ConsumeIntInRange(0, len(names) - 1)]] = value
        try:
            head = msgpack.packb(t, use_bin_type=True)
        except Exception:
            head = raw
    frames = [fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 4 * ROW * 8)) for _ in range(fdp.ConsumeIntInRange(0, 3))]
    return head, frames


def _good(i: int) -> None:
    """Stream one well-formed request through the shared accumulator; its record must be exact."""
    rid = f"good-{i}"
    P, G, C = 5, 3, 1
    rows = (np.arange((P + G) * L * K, dtype=np.int16).reshape(P + G, L, K) + i) % 128
    acc.apply(wire.decode_header(wire.pack_header("open", "good", 1, 0, rid, {
        "prompt_len": P, "num_cached": C, "num_layers": L, "top_k": K, "layer_ids": list(range(L))})), [], now[0])
    acc.apply(wire.decode_header(wire.pack_header("delta", "good", 1, 0, [rid], wire.delta_body([C], [P + G - 1 - C],
              L, K))), [rows[C:P + G - 1].tobytes()], now[0])
    recs = acc.apply(wire.decode_header(wire.pack_header("finish", "good", 1, 0, rid, {
        "num_output": G, "reason": "stop", "prompt_len": P, "num_cached": C})), [], now[0])
    want = rows.copy()
    want[:C] = -1
    want[P + G - 1] = -1
    assert len(recs) == 1, f"good request {rid}: {len(recs)} records"
    r = recs[0]
    assert r.complete and r.missing == [], (r.complete, r.missing, r.reason)
    assert np.array_equal(r.prompt_routed_experts, want[:P]) and np.array_equal(r.routed_experts, want[P:]), rid
    counts["good_checked"] += 1


def _rss_bytes() -> int | None:
    """This process's resident memory now (Linux), else None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def TestOneInput(data: bytes) -> None:
    counts["inputs"] += 1
    now[0] += 0.001
    head, frames = _message(data)
    try:
        h = wire.decode_header(head)
        if h.kind == "record":
            wire.decode_record(h, frames)
        else:
            for rec in acc.apply(h, frames, now[0]):
                assert isinstance(rec, wire.Record)
        counts["accepted"] += 1
    except wire.ProtocolError:
        counts["refused"] += 1
    assert acc.bytes_held <= MAX_BYTES, acc.bytes_held
    if counts["inputs"] % 200 == 0:
        _good(counts["inputs"] // 200)
        acc.poll(now[0] + 1e6)          # time out whatever the fuzzer left open, so memory stays bounded
        assert acc.bytes_held == 0, acc.bytes_held
    if counts["inputs"] % 1000 == 0:
        rss = _rss_bytes()
        assert rss is None or rss <= MAX_RSS_BYTES, f"resident memory {rss} bytes, limit {MAX_RSS_BYTES}"
    if counts["inputs"] % 5000 == 0:    # libFuzzer exits without running Python's atexit: report as we go
        print(f"fuzz_wire: inputs={counts['inputs']} accepted={counts['accepted']} refused={counts['refused']} "
              f"good_records_checked={counts['good_checked']}", file=sys.stderr, flush=True)


def main() -> None:
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
