"""Encode and validate routing-replay wire messages (protocol v2): the frame layout of every kind, one module.

Every stage imports this module and nothing else builds frames. This docstring is the layout (what is in each
frame and field, its type and default); docs/PROTOCOL.md says what the fields mean and how delivery works.

A message is a ZeroMQ multipart message. Frame 0 is a msgpack header, the frames after it are raw payloads:

    frame 0   header: msgpack array [version, kind, producer, epoch, seq, key, body(, link)]
                version   int, PROTOCOL_VERSION (2); a v1 header is read too (its rows are int16: a v1 peer
                          never sends `ids`, and a v1 header that does is refused); a v1 peer refuses a v2 header
                          (bad_version), so an older peer is refused, never misread
                kind      str, one of KINDS
                producer  str of at most MAX_PEER_ID_LEN characters: the id of the process that made the
                          message (producer, broker "broker", consumer or trainer-client id)
                epoch     int >= 0, the sender's incarnation (a producer, consumer or broker picks a new one per start)
                seq       int >= 0: per (producer, epoch), 1, 2, 3, ... on data messages (open, delta, finish,
                          abort); 0 on the broker's own aborts, on records and on broker/producer control
                          messages; a counter of its own on consumer and trainer-client control messages
                key       a request id (str of at most MAX_REQUEST_ID_BYTES UTF-8 bytes); a list of request ids
                          for delta and fetch; the sender's id on control messages; "", a request id or a list of
                          them on error
                body      map of kind-specific fields (below); readers ignore fields they do not know
                link      8th element, broker -> consumer data messages only: [broker_epoch, gen, lseq]
    frame 1.. payload frames, raw little-endian bytes, sent zero-copy above COPY_THRESHOLD

Routing rows are (tokens, layers, top_k) arrays of expert ids in one of three dtypes, named by the `ids` field of
every body that carries or announces rows (open, opens, delta, record; absent = "i2"):
    "u1"  uint8,      255 = never computed     models with num_experts <= 255 (id_dtype)
    "u2"  uint16 LE,  65535 = never computed   num_experts <= 65535 (256 experts need it: 255 is an expert id)
    "i2"  int16 LE,   -1 = never computed      the capture's dtype; every row of a v1 peer and of an npz without `ids`
Every missing value is all one-bits, so a run of never-computed rows is 0xff bytes in each dtype.

Data kinds, producer -> broker -> consumer ([x]: optional; "= v": the default when absent):
    open      key: request id
              {prompt_len, num_cached, num_layers, top_k[, layer_ids = range(num_layers)][, n_prompt_tokens = 0]
               [, prefix_filled = false][, prefix_refs = []][, reassigned][, ids = "i2"]}
                                                  prefix_filled: the producer sends rows [0, num_cached) too (from
                                                  its prefix store); reassigned: added by the broker only
                                                  prefix_refs (with prefix_filled only): [[writer, writer_pos, pos,
                                                  count], ...], at most MAX_PREFIX_REFS, pos ascending and disjoint,
                                                  pos + count <= num_cached: rows [pos, pos + count) are request
                                                  `writer`'s rows [writer_pos, writer_pos + count) and are not sent
              frame 1 (when n_prompt_tokens is sent): the prompt token ids, n_prompt_tokens int32 LE
    opens     key: list of request ids (distinct), the opens of several requests in one message: each entry is
              what an `open` of that request would say. Sent only to a peer that takes it (FEATURE_OPENS in its
              hello/heartbeat: broker -> producer reply, consumer -> broker); a peer that does not gets `open`s
              {prompt_len: bin, num_cached: bin, num_layers, top_k[, layer_ids = range(num_layers)]
               [, n_prompt_tokens: bin][, prefix_filled: bin][, prefix_refs: [entry refs, ...]][, ids = "i2"]}
              prompt_len, num_cached, n_prompt_tokens: int32 LE arrays, one entry per request id (n_prompt_tokens
              absent: none sent); prefix_filled: one byte per request id, 0 or 1 (absent: all 0); prefix_refs: one
              list per request id, each what that entry's `open` would carry ([] for none; absent: none at all);
              num_layers, top_k, layer_ids and ids are every entry's
              frame 1 (when any n_prompt_tokens entry is > 0): the prompt token ids of every entry, in key order,
              sum(n_prompt_tokens) int32 LE
    delta     key: list of request ids
              {start: bin, count: bin, num_layers, top_k[, layer_lo = 0, layer_hi = num_layers][, ids = "i2"]}
              start, count: int32 LE arrays as msgpack bin, one entry per request id; layer_lo and layer_hi
              are sent together, only for a partial layer range (a pipeline-parallel stage)
              frames 1..: the rows, (sum(count), layer_hi - layer_lo, top_k) of dtype `ids`, requests in key order;
              several frames only where a frame boundary falls on a request boundary (a broker's zero-copy split,
              a producer's coalesced steps: one frame per step); the key may repeat an id (several steps batched)
    finish    key: request id
              {num_output[, reason = "stop"][, prompt_len][, num_cached][, lost: [[lo, hi], ...]]
               [, refused: [[lo, hi], ...]][, broker_refused: [[lo, hi], ...]][, n_output_tokens = 0]}
              lost: positions the producer could not deliver; refused: those of them it would not send (rows
              that failed its checks); broker_refused: those of them whose delta the broker accepted and dropped
              (its `error` named the seq); both subsets of lost
              frame 1 (when n_output_tokens is sent): the output token ids, n_output_tokens int32 LE
    finishes  key: list of request ids (distinct), the finishes of several requests in one message
              {entries: [finish body, ...]}   entry i: the body a `finish` of key[i] would have (above); sent only to
              a peer that takes it (FEATURE_FINISHES, as `opens`); a peer that does not gets `finish`es
              frame 1 (when any entry's n_output_tokens is > 0): every entry's output token ids, in key order, int32 LE
    abort     key: request id                     {[reason = "abort"][, num_output]}             no frames
    refused   broker -> consumer only; key: list of request ids   {reason}                        no frames
              a delta that carried rows of these requests (the consumer's own) was accepted and dropped by the
              broker (it could not take it); sent on the consumer's link in that delta's place, so it comes before
              the requests' finishes; header producer, epoch and seq: the refused delta's (parse_refused)

Control kinds, one frame (the header) each; key: the sender's id unless said:
    hello       producer -> broker      {unacked_from = 1}
                consumer -> broker      {broker = 0}
                trainer -> consumer     {[subscribe: prefix][, layers][, tokens]}   without subscribe: no
                                        subscription; layers, tokens: as in fetch (each live record's slice)
    heartbeat   producer -> broker      {unacked_from = 1}
                broker -> producer      {consumers = 0[, takes = []]}   the reply to each producer hello/heartbeat;
                                                          key: the producer id; takes: the optional data kinds it
                                                          takes (FEATURE_OPENS, FEATURE_FINISHES)
                consumer -> broker      {broker = 0[, takes = []]}   (hello too); takes: FEATURE_OPENS,
                                                          FEATURE_FINISHES, FEATURE_HOLDS (it answers `claim`)
    claim       broker -> consumer      key: ""; {}   a restarted broker asks a consumer that got data from an
                                        earlier broker (its hello's `broker` is another epoch) and takes
                                        FEATURE_HOLDS which requests it holds
    holds       consumer -> broker      key: list of request ids (at most MAX_HOLDS_IDS; several messages for
                                        more); {}   the answer to `claim` (parse_holds): each id no other live
                                        consumer owns is this consumer's from then on
    bye         producer -> broker, consumer -> broker, trainer -> consumer: {}
    ack         broker -> producer      key: the producer id; {epoch, upto[, rewind][, expect][, hello]
                                        [, owners]} (ProducerAck, producer_ack_body, parse_producer_ack); upto = -1:
                                        nothing yet; expect and hello come only with rewind: true; owners:
                                        [[request ids], [owner groups]] (owner hints, take_owner_hints)
                consumer -> broker      {link: [broker_epoch, gen, upto][, gap]} (LinkAck, link_ack_body,
                                        parse_link_ack)
    error       broker -> producer or consumer, consumer -> trainer: {reason[, refused_seq, epoch]}; refused_seq
                                        and epoch (together, broker -> producer only): the data message of that
                                        producer epoch the broker accepted and dropped (Refusal, refusal_body,
                                        parse_refusal); key: "", a request id, or a list of ids (fetch answers)
    fetch       trainer -> consumer     key: list of request ids; {timeout_ms = 60000[, answer_unknown = false]
                                        [, layers: [lo, hi]][, tokens: [lo, hi]]} (Fetch, parse_fetch, Slice):
                                        layers: model layer ids [lo, hi), tokens: positions [lo, hi) of prompt +
                                        output, 0 <= lo < hi (absent: all); only that slice of each record is sent
    record      consumer -> trainer     key: request id (encode_record, decode_record)
                {prompt_len, num_output, num_cached, num_layers, top_k, layer_ids, complete, missing: [[lo, hi],
                 ...], reason, finish_reason, n_prompt_tokens, n_output_tokens[, num_prefix_filled = 0]
                 [, row_frames = [1, 1]][, layer_range: [lo, hi]][, token_range: [lo, hi, n]][, ids = "i2"]}
                 (token counts -1:
                 not sent); layer_range, token_range: sent only for a slice (slice_record): the layer range asked for
                 (layer_ids: the MoE layers kept); the positions [lo, hi) the rows cover, of the record's n = P + G
                 (clipped to n, so lo == hi == n when it lay past the end; prompt_len, num_output: the rows sent of
                 each part)
                frame 1: prompt rows (prompt_len, num_layers, top_k) of dtype `ids`; frame 2: generation rows
                (num_output, num_layers, top_k) of dtype `ids`; then, for each count >= 0, prompt and output token ids,
                int32 LE. A part over MAX_PAYLOAD_FRAME_BYTES goes as several frames of whole rows, each at most
                that (row_frames: how many for the prompt rows, how many for the generation rows)

Every decode path here validates against the named limits below before anything is allocated from an untrusted
number, and raises ProtocolError(reason_key, message) for the caller to log, count and drop.
"""

from __future__ import annotations

import array
import sys
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, Sequence

import msgpack
import numpy as np

PROTOCOL_VERSION = 2
ACCEPTED_VERSIONS = (1, 2)           # what decode_header takes: v1 headers carry int16 rows and no `ids` field
ROW_DTYPE = np.dtype("<i2")          # the capture's rows (step stamps need a signed value), v1's, and "i2"
TOKEN_DTYPE = np.dtype("<i4")

# The dtypes rows travel and are stored in, by their `ids` code (module docstring). The missing value of each is
# all one-bits (-1, 255, 65535): holes are filled with 0xff bytes whatever the dtype.
ID_DTYPES = {"u1": np.dtype("u1"), "u2": np.dtype("<u2"), "i2": ROW_DTYPE}
_ID_CODES = {dt: code for code, dt in ID_DTYPES.items()}
_MISSING = {ID_DTYPES["u1"]: 255, ID_DTYPES["u2"]: 65535, ROW_DTYPE: -1}

KINDS = frozenset({
    "open", "opens", "delta", "finish", "finishes", "abort", "refused",
    "hello", "heartbeat", "bye", "ack", "error", "claim", "holds",
    "fetch", "record",
})

# Data kinds a peer takes only when it says so (`takes` in its hello/heartbeat body): peers of this protocol
# version that do not say so get the same opens (finishes) as `open` (`finish`) messages.
FEATURE_OPENS = "opens"
FEATURE_FINISHES = "finishes"
# a consumer that takes `claim` (the broker's question after a restart) and answers with `holds`: the ids of the
# requests it holds, which the new broker gives back to it before it places any request (see Ownership.claim)
FEATURE_HOLDS = "holds"
MAX_HOLDS_IDS = 4096                 # request ids per `holds` message (a consumer sends as many as it needs)
MAX_BATCH_ENTRIES = 4096             # what a producer puts in one `opens` or `finishes` (a receiver takes up to
                                     # MAX_REQUESTS_PER_DELTA)
BATCH_ID_CHARS = 1 << 20             # and at most this many characters of request ids (the header stays far
                                     # below MAX_HEADER_BYTES)

# Limits on untrusted input. A message beyond any of them is refused before it allocates anything.
MAX_HEADER_BYTES = 4 << 20
MAX_MESSAGE_BYTES = 1 << 30          # ZMQ_MAXMSGSIZE on every receiving socket (per frame)
# the largest payload frame this project sends (a delta's rows, a record part's): under CURVE a frame travels with
# ~33 bytes more, which ZMQ_MAXMSGSIZE counts; a frame of 1 GiB less 32 bytes was dropped, with the connection
MAX_PAYLOAD_FRAME_BYTES = MAX_MESSAGE_BYTES - (64 << 10)
MAX_REQUEST_ID_BYTES = 1024          # UTF-8 bytes of a request id (the one definition; see check_request_id)
MAX_PEER_ID_LEN = 256
MAX_REQUESTS_PER_DELTA = 1 << 16
MAX_ROWS_PER_DELTA = 1 << 20
MAX_POSITION = 1 << 26               # 64M tokens
MAX_LAYERS = 1024
MAX_LAYER_ID = 1 << 16               # model layer ids a slice may name ([lo, hi), hi at most this)
MAX_TOP_K = 256
MAX_PREFIX_REFS = 4096               # references per open (runs of KV blocks: a prompt of 512k tokens in 128s)
MAX_FRAMES = 1 + MAX_REQUESTS_PER_DELTA
# Whole-message bounds (protocol/loop.recv_frames): a multipart message above its socket's bound is refused by its
# total size, frame by frame as it is read, whatever each frame's size. libzmq hands a multipart message over only
# once all its frames have arrived and counts ZMQ_MAXMSGSIZE per frame, so what it holds for one message before
# that is each frame's bound times the frames: these bounds stop the message at the receiver's loop (nothing is
# decoded, forwarded or kept), the per-frame bound is what caps libzmq's buffer.
MAX_CONTROL_MESSAGE_BYTES = MAX_HEADER_BYTES + 4096          # one header frame (and a ROUTER's routing id frame)
MAX_DATA_MESSAGE_BYTES = MAX_MESSAGE_BYTES + MAX_HEADER_BYTES + 4096   # a header and at most one frame's rows
COPY_THRESHOLD = 64 * 1024           # payload frames larger than this are sent zero-copy

_UNPACK_LIMITS = dict(
    max_str_len=MAX_REQUEST_ID_BYTES,    # bytes of every str in a header (request ids are the longest)
    max_bin_len=MAX_HEADER_BYTES,
    max_array_len=MAX_REQUESTS_PER_DELTA * 2,
    max_map_len=64,
    max_ext_len=0,
)


class ProtocolError(ValueError):
    """A message that breaks the protocol. `reason` is a short stable key for counters and logs."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


# ---------------------------------------------------------------------------------------------------------------
# expert id dtypes


def id_dtype(num_experts: int | None) -> np.dtype:
    """The compact dtype of a model's expert ids: uint8 when num_experts <= 255 (255 marks a row never computed),
    uint16 when <= 65535 (65535 marks it); None (unknown): int16 (-1). A 256-expert model gets uint16: every uint8
    value is then an expert id, and "never computed" needs a value of its own."""
    if num_experts is None:
        return ROW_DTYPE
    if type(num_experts) not in (int, np.int32, np.int64) or num_experts < 1:
        raise ValueError(f"num_experts={num_experts!r}: expected a positive integer")
    if num_experts <= 255:
        return ID_DTYPES["u1"]
    if num_experts <= 65535:
        return ID_DTYPES["u2"]
    raise ValueError(f"num_experts={num_experts}: expert ids travel as at most uint16 (65,535 experts)")


def as_id_dtype(dtype: Any) -> np.dtype:
    """`dtype` (a dtype, its name or its `ids` code) as one of ID_DTYPES; ValueError naming it otherwise."""
    if isinstance(dtype, np.dtype) and dtype in _ID_CODES:     # (the hot path: a dtype already)
        return dtype
    if isinstance(dtype, str) and dtype in ID_DTYPES:
        return ID_DTYPES[dtype]
    try:
        dt = np.dtype(dtype).newbyteorder("<")
    except TypeError:
        dt = None
    if dt not in _ID_CODES:
        raise ValueError(f"expert id dtype {str(dtype)[:32]!r}: expected uint8, uint16 or int16 "
                         f"(codes {sorted(ID_DTYPES)})")
    return dt


def ids_code(dtype: Any) -> str:
    """The `ids` code ("u1", "u2", "i2") of an expert id dtype."""
    code = _ID_CODES.get(dtype) if isinstance(dtype, np.dtype) else None
    return code if code is not None else _ID_CODES[as_id_dtype(dtype)]


def missing_id(dtype: Any) -> int:
    """The value that marks a row never computed in `dtype`: -1 for int16, the largest value for uint8/uint16."""
    m = _MISSING.get(dtype) if isinstance(dtype, np.dtype) else None
    return m if m is not None else _MISSING[as_id_dtype(dtype)]


def narrow_rows(rows: np.ndarray, dtype: Any, out: np.ndarray | None = None) -> np.ndarray:
    """int16 rows (-1: never computed) as `dtype` (-1 -> missing_id(dtype)), a new C-contiguous array (or `out`).

    ValueError naming the offending value when an id lies outside [0, missing_id(dtype)) and is not -1 (the
    producer refuses such a step as it refuses rows that fail its other checks). int16 asked: a contiguous copy
    after the same check for values below -1."""
    dt = as_id_dtype(dtype)
    rows = np.asarray(rows)
    if rows.dtype != ROW_DTYPE:
        raise ValueError(f"rows to narrow are {rows.dtype}, expected int16")
    if rows.size:
        lo, hi = int(rows.min()), int(rows.max())
        top = missing_id(dt) - 1 if dt != ROW_DTYPE else np.iinfo(ROW_DTYPE).max
        if lo < -1 or hi > top:
            bad = lo if lo < -1 else hi
            raise ValueError(f"expert id {bad} does not fit {dt.name} rows (ids 0..{top}, -1 never computed)")
    if out is None:
        out = np.empty(rows.shape, dt)
    # int16 -> uint: two's complement wrap turns -1 into all one-bits (255, 65535), the missing value; every other
    # value was checked to lie in [0, missing) above
    np.copyto(out, rows, casting="unsafe")
    return out


IDS_CHOICES = ("int16", "compact")      # what a reader of records asks for (Record.as_ids)


def check_ids_choice(ids: str) -> str:
    """`ids` if it is one of IDS_CHOICES; ValueError naming it otherwise (checked before any work is done)."""
    if ids not in IDS_CHOICES:
        raise ValueError(f"ids={str(ids)[:32]!r}: expected 'int16' or 'compact'")
    return ids


def widen_rows(rows: np.ndarray) -> np.ndarray:
    """Rows of any ID_DTYPES dtype as int16 with -1 for never computed (today's arrays); int16 rows as they are."""
    rows = np.asarray(rows)
    if rows.dtype == ROW_DTYPE:
        return rows
    dt = as_id_dtype(rows.dtype)
    miss = missing_id(dt)
    out = rows.astype(ROW_DTYPE)
    if dt.itemsize == 2 and rows.size:
        big = rows[(rows > np.iinfo(ROW_DTYPE).max) & (rows != miss)]
        if big.size:
            raise ValueError(f"expert id {int(big[0])} does not fit int16 rows (use ids=\"compact\")")
    out[rows == miss] = -1
    return out


def parse_ids(h: "Header", body: dict | None = None) -> np.dtype:
    """The row dtype a message states (`ids`, absent: int16); ProtocolError "bad_field" naming an unknown code,
    or any code but "i2" in a v1 header (a v1 peer's rows are int16)."""
    code = (h.body if body is None else body).get("ids", "i2")
    if type(code) is not str or code not in ID_DTYPES:
        raise _bad("bad_field", f"ids {str(code)[:32]!r}: expected one of {sorted(ID_DTYPES)}")
    if code != "i2" and h.version < 2:
        raise _bad("bad_field", f"ids {code!r} in a protocol v{h.version} header (v1 rows are int16)")
    return ID_DTYPES[code]


@dataclass(slots=True)
class Header:
    """One decoded, validated header frame."""

    version: int
    kind: str
    producer: str
    epoch: int
    seq: int
    key: Any                  # str, or list[str] for delta/fetch
    body: dict
    link: tuple | None = None  # (broker_epoch, gen, lseq) on broker -> consumer data messages


def pack_header(kind: str, producer: str, epoch: int, seq: int, key: Any, body: dict,
                link: Sequence[int] | None = None) -> bytes:
    h = [PROTOCOL_VERSION, kind, producer, epoch, seq, key, body]
    if link is not None:
        h.append(list(link))
    return msgpack.packb(h, use_bin_type=True)


_LINK_PACKER = msgpack.Packer(use_bin_type=True)


def pack_header_packed_key(kind: str, producer: str, epoch: int, seq: int, packed_key: bytes, body: dict) -> bytes:
    """pack_header with `key` given already packed (msgpack bytes of a str or list of str): the same bytes, without
    packing the key again (the broker packs each owner's key list once per split plan, not per message)."""
    p = _LINK_PACKER
    return b"".join((b"\x97", p.pack(PROTOCOL_VERSION), p.pack(kind), p.pack(producer), p.pack(epoch), p.pack(seq),
                     packed_key, p.pack(body)))


def with_seq(frame: bytes | memoryview, seq: int) -> bytes:
    """The header frame `frame` (as pack_header writes it) with `seq` in place of its seq: decoded and re-packed
    (the producer renumbering its unacknowledged messages, a rare event)."""
    h = msgpack.unpackb(frame, raw=False, strict_map_key=False)
    h[4] = seq
    return msgpack.packb(h, use_bin_type=True)


def with_link(frame: bytes | memoryview, link: Sequence[int]) -> bytes:
    """The header frame `frame` with `link` as its 8th element (any link it carried is replaced).

    Per message, not per request: a header packed as a 7-element fixarray (0x97, what pack_header writes) gets
    its first byte changed and the link appended (one copy of the frame, no re-encoding); anything else is
    decoded and re-packed.
    """
    if frame[0] == 0x97:
        return b"".join((b"\x98", frame[1:], _LINK_PACKER.pack(list(link))))
    h = decode_header(frame)
    return pack_header(h.kind, h.producer, h.epoch, h.seq, h.key, h.body, link)


def _bad(reason: str, message: str) -> ProtocolError:
    return ProtocolError(reason, message)


def _int_list(values: Any, name: str, lo: int, hi: int) -> array.array:
    if not isinstance(values, list):
        raise _bad("bad_field", f"{name} must be a list, got {type(values).__name__}")
    try:
        arr = array.array("q", values)
    except (TypeError, OverflowError) as e:
        raise _bad("bad_field", f"{name} must hold integers: {e}") from None
    if arr and (min(arr) < lo or max(arr) > hi):
        raise _bad("out_of_range", f"{name} outside [{lo}, {hi}]: min {min(arr)}, max {max(arr)}")
    return arr


def int_field(body: dict, name: str, lo: int, hi: int, default: Any = ...) -> int:
    """body[name] as an int in [lo, hi] (`default` when absent, if given); ProtocolError otherwise."""
    v = body.get(name, default)
    if v is ...:
        raise _bad("missing_field", f"body lacks {name!r}")
    if type(v) is not int or not lo <= v <= hi:
        raise _bad("bad_field", f"{name}={v!r} not an integer in [{lo}, {hi}]")
    return v



def request_id_problem(key: Any) -> str | None:
    """Why `key` cannot travel as a request id (None if it can): the one definition, used by every sender.

    A request id is a non-empty str whose UTF-8 encoding has at most MAX_REQUEST_ID_BYTES bytes (the receivers'
    msgpack limit counts bytes); a str with lone surrogates has no UTF-8 encoding at all.
    """
    if type(key) is not str or not key:
        return f"request id must be a non-empty str, got {type(key).__name__} {str(key)[:64]!r}"
    if len(key) > MAX_REQUEST_ID_BYTES:       # cheap bound first: every character is at least one byte
        return f"request id of {len(key)} characters exceeds {MAX_REQUEST_ID_BYTES} UTF-8 bytes"
    if key.isascii():                         # (a flag of the str: one byte per character, nothing to encode)
        return None
    try:
        n = len(key.encode("utf-8"))
    except UnicodeEncodeError as e:
        return f"request id is not encodable as UTF-8 ({e.reason} at index {e.start})"
    if n > MAX_REQUEST_ID_BYTES:
        return f"request id of {len(key)} characters is {n} UTF-8 bytes, limit {MAX_REQUEST_ID_BYTES}"
    return None


def check_request_id(key: Any) -> str:
    """`key` if it can travel as a request id; ProtocolError("bad_request_id") saying why otherwise."""
    problem = request_id_problem(key)
    if problem is not None:
        raise _bad("bad_request_id", problem)
    return key



def decode_header(frame: bytes | memoryview) -> Header:
    """Decode and validate frame 0. Raises ProtocolError; never anything else on any input bytes."""
    if len(frame) > MAX_HEADER_BYTES:
        raise _bad("header_too_large", f"header of {len(frame)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        h = msgpack.unpackb(frame, raw=False, strict_map_key=True, **_UNPACK_LIMITS)
    except Exception as e:  # msgpack raises a zoo of types on garbage (ValueError, ExtraData, UnicodeDecodeError, ...)
        raise _bad("undecodable", f"header is not msgpack: {type(e).__name__}: {str(e)[:80]}") from None
    if not isinstance(h, list) or len(h) < 7:
        raise _bad("bad_header", f"header must be an array of at least 7 fields, got {type(h).__name__}")
    version, kind, producer, epoch, seq, key, body = h[:7]
    if type(version) is not int or version not in ACCEPTED_VERSIONS:
        raise _bad("bad_version", f"protocol version {str(version)[:32]}, this peer speaks "
                                  f"{', '.join(map(str, ACCEPTED_VERSIONS))}")
    if type(kind) is not str or kind not in KINDS:
        raise _bad("unknown_kind", f"unknown message kind {str(kind)[:32]!r}")
    if type(producer) is not str or len(producer) > MAX_PEER_ID_LEN:
        raise _bad("bad_header", f"producer id must be a str of at most {MAX_PEER_ID_LEN} characters")
    if type(epoch) is not int or type(seq) is not int or epoch < 0 or seq < 0 or epoch >= 1 << 63 or seq >= 1 << 63:
        raise _bad("bad_header", f"epoch {epoch!r} and seq {seq!r} must be non-negative 64-bit integers")
    if not isinstance(body, dict):
        raise _bad("bad_header", f"body must be a map, got {type(body).__name__}")
    link = None
    if len(h) > 7 and h[7] is not None:
        link = h[7]
        if (not isinstance(link, list) or len(link) != 3
                or not all(type(x) is int and 0 <= x < 1 << 63 for x in link)):
            raise _bad("bad_header", "link must be [broker_epoch, gen, lseq], non-negative 64-bit integers")
        link = tuple(link)
    return Header(version, kind, producer, epoch, seq, key, body, link)


class Envelope(NamedTuple):
    """What a receiver can still read of a header that decode_header refused: enough to answer for it.

    Used so that one undecodable data message never leaves a permanent gap in a sequence: the broker accepts
    and drops a producer's `seq` (and tells the producer which), the consumer does the same with a link's lseq.
    Any field that cannot be read is None; `key` is the request id(s) as text where readable.
    """

    kind: str | None
    producer: str | None
    epoch: int | None
    seq: int | None
    key: Any
    link: tuple | None


def _u63(v: Any) -> int | None:
    return v if type(v) is int and 0 <= v < 1 << 63 else None


def peek_envelope(frame: bytes | memoryview) -> Envelope | None:
    """Read kind, producer, epoch, seq, key and link from a header frame without its limits on strings (the frame
    size is still bounded by MAX_HEADER_BYTES). None if the frame is not a msgpack array at all."""
    if len(frame) > MAX_HEADER_BYTES:
        return None
    n = len(frame)
    try:
        h = msgpack.unpackb(frame, raw=False, unicode_errors="surrogateescape", strict_map_key=False,
                            max_str_len=n, max_bin_len=n, max_array_len=n, max_map_len=n, max_ext_len=n)
    except Exception:  # noqa: BLE001 (garbage of any kind: nothing readable)
        return None
    if not isinstance(h, list) or len(h) < 5:
        return None
    kind = h[1] if type(h[1]) is str and h[1] in KINDS else None
    producer = h[2] if type(h[2]) is str else None
    key = h[5] if len(h) > 5 else None
    link = None
    if len(h) > 7 and isinstance(h[7], list) and len(h[7]) == 3 and all(_u63(x) is not None for x in h[7]):
        link = tuple(h[7])
    return Envelope(kind, producer, _u63(h[3]), _u63(h[4]), key, link)


# ---------------------------------------------------------------------------------------------------------------
# delta


@dataclass(slots=True)
class Delta:
    """A validated delta header: who gets how many rows, and the row geometry."""

    request_ids: list
    starts: np.ndarray        # int32, one per request
    counts: np.ndarray        # int32, one per request
    num_layers: int
    top_k: int
    layer_lo: int
    layer_hi: int
    total_rows: int
    dtype: np.dtype = ROW_DTYPE   # the rows' dtype (`ids`)

    @property
    def row_bytes(self) -> int:
        return (self.layer_hi - self.layer_lo) * self.top_k * self.dtype.itemsize


_I32 = np.dtype("<i4")


def _int32_array(v: Any, name: str, n: int, lo: int, hi: int) -> np.ndarray:
    if not isinstance(v, bytes):
        raise _bad("bad_field", f"{name} must be int32 bytes (msgpack bin), got {type(v).__name__}")
    if len(v) != 4 * n:
        raise _bad("bad_field", f"{name} has {len(v)} bytes for {n} request ids (4 bytes each)")
    arr = np.frombuffer(v, dtype=_I32)
    if n and (int(arr.min()) < lo or int(arr.max()) > hi):
        raise _bad("out_of_range", f"{name} outside [{lo}, {hi}]: min {arr.min()}, max {arr.max()}")
    return arr


def parse_delta(h: Header) -> Delta:
    ids = _id_list(h.key, "delta")
    b = h.body
    n = len(ids)
    starts = _int32_array(b.get("start"), "start", n, 0, MAX_POSITION)
    counts = _int32_array(b.get("count"), "count", n, 0, MAX_ROWS_PER_DELTA)
    total = int(counts.sum(dtype=np.int64))
    if total > MAX_ROWS_PER_DELTA:
        raise _bad("too_large", f"delta carries {total} rows, limit {MAX_ROWS_PER_DELTA}")
    L = int_field(b, "num_layers", 1, MAX_LAYERS)
    K = int_field(b, "top_k", 1, MAX_TOP_K)
    lo = int_field(b, "layer_lo", 0, L - 1, 0)
    hi = int_field(b, "layer_hi", lo + 1, L, L)
    return Delta(ids, starts, counts, L, K, lo, hi, total, parse_ids(h))


def check_payload(d: Delta, frames: Sequence) -> None:
    """Check that the payload frames hold exactly the rows the header announces, split on request boundaries."""
    rb = d.row_bytes
    want = d.total_rows * rb
    sizes = [len(f.buffer) if hasattr(f, "buffer") else len(f) for f in frames]
    got = sum(sizes)
    if got != want:
        raise _bad("size_mismatch", f"delta announces {d.total_rows} rows of {rb} bytes ({d.dtype.name}) = {want} "
                   f"bytes, payload has {got} bytes in {len(sizes)} frames")
    if len(sizes) > 1:
        # every frame's end is the end of some request's rows (one searchsorted, not a loop over requests)
        bounds = np.cumsum(d.counts, dtype=np.int64) * rb
        ends = np.cumsum(np.asarray(sizes, dtype=np.int64))
        at = np.searchsorted(bounds, ends)
        if len(bounds) == 0 or int(at.max()) >= len(bounds) or not np.array_equal(bounds[at], ends):
            raise _bad("split_mid_request", "a payload frame boundary falls inside a request's rows")


_LITTLE = sys.byteorder == "little" and array.array("i").itemsize == 4


def _i32_bytes(values: Sequence[int] | np.ndarray) -> bytes:
    """int32 LE bytes of a list of ints (array.array: a C loop, several times faster than numpy on a list)."""
    if _LITTLE and isinstance(values, list):
        try:
            return array.array("i", values).tobytes()
        except TypeError:          # numpy integers in the list: numpy converts them
            pass
    return np.asarray(values, dtype=_I32).tobytes()


def delta_body(starts: Sequence[int] | np.ndarray, counts: Sequence[int] | np.ndarray, num_layers: int,
               top_k: int, layer_lo: int = 0, layer_hi: int | None = None, ids: Any = ROW_DTYPE) -> dict:
    """A delta's body; `ids`: the rows' dtype (or its code), stated unless int16."""
    body = {"start": _i32_bytes(starts), "count": _i32_bytes(counts), "num_layers": num_layers, "top_k": top_k}
    if layer_lo != 0 or (layer_hi is not None and layer_hi != num_layers):
        body["layer_lo"] = layer_lo
        body["layer_hi"] = num_layers if layer_hi is None else layer_hi
    _put_ids(body, ids)
    return body


def _put_ids(body: dict, dtype: Any) -> None:
    code = dtype if isinstance(dtype, str) and dtype in ID_DTYPES else ids_code(dtype)
    if code != "i2":
        body["ids"] = code


# ---------------------------------------------------------------------------------------------------------------
# open / finish / abort


@dataclass(slots=True)
class Open:
    request_id: str
    prompt_len: int
    num_cached: int
    num_layers: int
    top_k: int
    layer_ids: list
    n_prompt_tokens: int
    prefix_filled: bool = False
    # ((writer, writer_pos, pos, count), ...): rows [pos, pos + count) of this request are `writer`'s rows
    # [writer_pos, writer_pos + count), not sent (the consumer resolves them: consumer/prefix_pool.py)
    prefix_refs: tuple = ()
    id_dtype: np.dtype = ROW_DTYPE   # the dtype of this request's rows (`ids`)


def parse_prefix_refs(raw: Any, num_cached: int, rid: str) -> tuple:
    """An open's prefix_refs, checked: a list of at most MAX_PREFIX_REFS [writer, writer_pos, pos, count] (writer a
    valid request id other than `rid`, writer_pos >= 0, count >= 1, writer_pos + count <= MAX_POSITION, ranges
    [pos, pos + count) ascending, disjoint, inside [0, num_cached)). Returns a tuple of tuples."""
    if type(raw) is not list:
        raise _bad("bad_field", f"prefix_refs of {rid[:64]!r} must be a list, got {type(raw).__name__}")
    if len(raw) > MAX_PREFIX_REFS:
        raise _bad("bad_field", f"prefix_refs of {rid[:64]!r} has {len(raw)} entries, limit {MAX_PREFIX_REFS}")
    out = []
    end = 0
    for ref in raw:
        if type(ref) is not list or len(ref) != 4:
            raise _bad("bad_field", f"prefix_refs entry {str(ref)[:80]} of {rid[:64]!r} is not "
                       f"[writer, writer_pos, pos, count]")
        w, wp, pos, n = ref
        problem = request_id_problem(w)
        if problem is not None:
            raise _bad("bad_request_id", f"prefix_refs writer of {rid[:64]!r}: {problem}")
        if w == rid:
            raise _bad("bad_field", f"prefix_refs of {rid[:64]!r} names the request itself as writer")
        if (type(wp) is not int or type(pos) is not int or type(n) is not int or wp < 0 or n < 1
                or wp + n > MAX_POSITION):
            raise _bad("bad_field", f"prefix_refs entry [{w[:64]!r}, {wp!r}, {pos!r}, {n!r}] of {rid[:64]!r}: "
                       f"writer_pos >= 0, count >= 1, writer_pos + count <= {MAX_POSITION} (ints)")
        if pos < end or pos + n > num_cached:
            raise _bad("out_of_range", f"prefix_refs entry [{w[:64]!r}, {wp}, {pos}, {n}] of {rid[:64]!r}: rows "
                       f"[{pos}, {pos + n}) not ascending and disjoint inside [0, num_cached={num_cached})")
        end = pos + n
        out.append((w, wp, pos, n))
    return tuple(out)


def _refs_body(refs: tuple) -> list:
    return [list(r) for r in refs]


# the last layer_ids list that passed the checks (a new list of ints): every open of one model carries the same
# list, so the next one is a list compare and a type count in C instead of a conversion, two scans and a new list
_last_layer_ids: list = []


def _layer_ids(body: dict, L: int) -> list:
    """An open's layer_ids (range(L) when absent), checked: L integers in [0, 2**20]. The list returned may be
    shared by the opens of other requests: readers never change it."""
    global _last_layer_ids
    last = _last_layer_ids
    raw = body["layer_ids"] if "layer_ids" in body else list(range(L))
    if (type(raw) is list and len(raw) == L and raw == last
            and list(map(type, raw)).count(int) == L):    # equal as values and all ints: the checked list itself
        return last
    ids = list(_int_list(raw, "layer_ids", 0, 1 << 20))
    if len(ids) != L:
        raise _bad("bad_field", f"layer_ids has {len(ids)} entries for num_layers={L}")
    _last_layer_ids = ids
    return ids


def parse_open(h: Header) -> Open:
    rid = check_request_id(h.key)
    b = h.body
    P = int_field(b, "prompt_len", 0, MAX_POSITION)
    C = int_field(b, "num_cached", 0, P)
    L = int_field(b, "num_layers", 1, MAX_LAYERS)
    K = int_field(b, "top_k", 1, MAX_TOP_K)
    ids = _layer_ids(b, L)
    nt = int_field(b, "n_prompt_tokens", 0, MAX_POSITION, 0)
    filled = b.get("prefix_filled", False)
    if type(filled) is not bool:
        raise _bad("bad_field", f"prefix_filled must be a bool, got {type(filled).__name__}")
    refs = ()
    if b.get("prefix_refs"):
        if not filled:
            raise _bad("bad_field", f"prefix_refs of {rid[:64]!r} without prefix_filled")
        refs = parse_prefix_refs(b["prefix_refs"], C, rid)
    return Open(rid, P, C, L, K, ids, nt, filled, refs, parse_ids(h))


class _EntryTokens:
    """The token ids of an `opens` or `finishes` entry: entry i's are tokens[offsets[i]:offsets[i + 1]] of the
    message's one token array (`offsets`: int64, one more than the entries)."""

    __slots__ = ()

    def tokens_of(self, i: int, tokens: np.ndarray | None) -> np.ndarray | None:
        """Entry i's token ids (None when it has none)."""
        off = self.offsets
        if tokens is None or off[i] == off[i + 1]:
            return None
        return tokens[off[i]:off[i + 1]]

    def token_frames(self, i: int, tokens: np.ndarray | None) -> list:
        """Entry i's payload frames as a message of its own: its token ids as bytes, or none."""
        t = self.tokens_of(i, tokens)
        return [] if t is None else [memoryview(t).cast("B")]

    def subset_token_frames(self, tokens: np.ndarray | None, idx: Sequence[int]) -> list:
        """The payload frames of a message holding entries `idx`, in that order: their token ids in one frame, or
        none."""
        parts = [t for t in (self.tokens_of(i, tokens) for i in idx) if t is not None]
        return [memoryview(np.concatenate(parts)).cast("B")] if parts else []


def _offsets(counts: Sequence[int] | np.ndarray) -> np.ndarray:
    out = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=out[1:])
    return out


@dataclass(slots=True)
class Opens(_EntryTokens):
    """A validated `opens` header: entry i is the open of request_ids[i] (open_at(i))."""

    request_ids: list
    prompt_len: np.ndarray    # int32, one per request
    num_cached: np.ndarray    # int32
    n_prompt_tokens: np.ndarray | None   # int32 (None: no token ids sent)
    prefix_filled: np.ndarray | None     # bool (None: all False)
    num_layers: int
    top_k: int
    layer_ids: list
    offsets: np.ndarray                  # int64, len + 1 (_EntryTokens; all 0 when no token ids were sent)
    prefix_refs: list | None = None      # per entry: a tuple of (writer, writer_pos, pos, count) (None: none)
    id_dtype: np.dtype = ROW_DTYPE       # every entry's row dtype (`ids`)

    def open_at(self, i: int) -> Open:
        return Open(self.request_ids[i], int(self.prompt_len[i]), int(self.num_cached[i]), self.num_layers,
                    self.top_k, self.layer_ids,
                    0 if self.n_prompt_tokens is None else int(self.n_prompt_tokens[i]),
                    False if self.prefix_filled is None else bool(self.prefix_filled[i]),
                    () if self.prefix_refs is None else self.prefix_refs[i], self.id_dtype)

    def single(self, h: Header, tokens: np.ndarray | None, i: int, reassigned: bool = False) -> tuple:
        """Entry i as an `open` of its own, from the same sender and seq: (header, payload frames)."""
        o = self.open_at(i)
        return (pack_header("open", h.producer, h.epoch, h.seq, o.request_id, open_body(o, reassigned)),
                self.token_frames(i, tokens))

    def subset(self, h: Header, tokens: np.ndarray | None, idx: Sequence[int]) -> list:
        return subset_opens(h, self, tokens, idx)


def _id_list(ids: Any, kind: str) -> list:
    """A data message's key as a list of request ids: at most MAX_REQUESTS_PER_DELTA non-empty str."""
    if not isinstance(ids, list) or len(ids) > MAX_REQUESTS_PER_DELTA:
        raise _bad("bad_field", f"{kind} key must be a list of at most {MAX_REQUESTS_PER_DELTA} request ids")
    try:
        "".join(ids)                      # C-speed check that every id is a str (lengths: the unpack limit)
    except TypeError:
        raise _bad("bad_request_id", f"{kind} key holds a request id that is not a str") from None
    if "" in ids:
        raise _bad("bad_request_id", f"empty request id in {kind} key")
    return ids


def parse_opens(h: Header, frames: Sequence = ()) -> tuple[Opens, np.ndarray | None]:
    """An `opens` header and its payload frames: (the entries, every entry's token ids as one int32 array or
    None). Raises ProtocolError for anything one `open` of an entry would be refused for, and for a repeated
    request id or a payload that does not match the counts: the whole message then."""
    ids = _id_list(h.key, "opens")
    if not ids or len(set(ids)) != len(ids):
        raise _bad("bad_field", "opens key is empty or repeats a request id")
    b = h.body
    n = len(ids)
    P = _int32_array(b.get("prompt_len"), "prompt_len", n, 0, MAX_POSITION)
    C = _int32_array(b.get("num_cached"), "num_cached", n, 0, MAX_POSITION)
    if n and bool((C > P).any()):
        i = int(np.argmax(C > P))
        raise _bad("bad_field", f"num_cached={int(C[i])} exceeds prompt_len={int(P[i])} for {ids[i][:64]!r}")
    L = int_field(b, "num_layers", 1, MAX_LAYERS)
    K = int_field(b, "top_k", 1, MAX_TOP_K)
    layer_ids = _layer_ids(b, L)
    NT = None
    if b.get("n_prompt_tokens") is not None:
        NT = _int32_array(b["n_prompt_tokens"], "n_prompt_tokens", n, 0, MAX_POSITION)
    offsets = _offsets(NT if NT is not None else np.zeros(n, np.int32))
    filled = None
    if b.get("prefix_filled") is not None:
        raw = b["prefix_filled"]
        if not isinstance(raw, bytes) or len(raw) != n:
            raise _bad("bad_field", f"prefix_filled must be {n} bytes (msgpack bin), one per request id")
        u = np.frombuffer(raw, np.uint8)
        if n and int(u.max()) > 1:
            raise _bad("bad_field", "prefix_filled bytes must be 0 or 1")
        filled = u.astype(bool)
    refs = None
    if b.get("prefix_refs") is not None:
        raw = b["prefix_refs"]
        if type(raw) is not list or len(raw) != n:
            raise _bad("bad_field", f"prefix_refs must be a list of {n} lists, one per request id")
        refs = []
        for i, r in enumerate(raw):
            if r and (filled is None or not filled[i]):
                raise _bad("bad_field", f"prefix_refs of {ids[i][:64]!r} without prefix_filled")
            refs.append(parse_prefix_refs(r, int(C[i]), ids[i]) if r else ())
    total = int(offsets[-1])
    if len(frames) != (1 if total else 0):
        raise _bad("frame_count", f"opens announces {total} prompt tokens but has {len(frames)} payload frames")
    tokens = tokens_from_frame(frames[0], total, "prompt token") if total else None
    return Opens(ids, P, C, NT, filled, L, K, layer_ids, offsets, refs, parse_ids(h)), tokens


def opens_body(prompt_len: Sequence[int], num_cached: Sequence[int], num_layers: int, top_k: int,
               layer_ids: Sequence[int] | None = None, n_prompt_tokens: Sequence[int] | None = None,
               prefix_filled: Sequence[bool] | None = None, prefix_refs: Sequence[tuple] | None = None,
               ids: Any = ROW_DTYPE) -> dict:
    """The body of an `opens` (entries in key order); layer_ids None: range(num_layers); prefix_refs: per entry
    its references (() for none); ids: the rows' dtype (stated unless int16)."""
    body = {"prompt_len": _i32_bytes(prompt_len), "num_cached": _i32_bytes(num_cached), "num_layers": num_layers,
            "top_k": top_k}
    if layer_ids is not None:
        body["layer_ids"] = list(layer_ids)
    if n_prompt_tokens is not None:
        body["n_prompt_tokens"] = _i32_bytes(n_prompt_tokens)
    if prefix_filled is not None and any(prefix_filled):
        body["prefix_filled"] = bytes(bytearray(1 if x else 0 for x in prefix_filled))
    if prefix_refs is not None and any(prefix_refs):
        body["prefix_refs"] = [_refs_body(r) for r in prefix_refs]
    _put_ids(body, ids)
    return body


def open_body(o: Open, reassigned: bool = False) -> dict:
    """The body of one `open` saying what `o` says (an `opens` entry sent as an `open`)."""
    body = {"prompt_len": o.prompt_len, "num_cached": o.num_cached, "num_layers": o.num_layers, "top_k": o.top_k,
            "layer_ids": o.layer_ids}
    if o.n_prompt_tokens:
        body["n_prompt_tokens"] = o.n_prompt_tokens
    if o.prefix_filled:
        body["prefix_filled"] = True
    if o.prefix_refs:
        body["prefix_refs"] = _refs_body(o.prefix_refs)
    if reassigned:
        body["reassigned"] = True
    _put_ids(body, o.id_dtype)
    return body


def subset_opens(h: Header, o: Opens, tokens: np.ndarray | None, idx: Sequence[int]) -> list:
    """[header, payload frames...] of an `opens` holding entries `idx` of `o` (in that order), same sender and seq
    (the broker's split by owner)."""
    idx = np.asarray(idx, dtype=np.int64)
    nt = None if o.n_prompt_tokens is None else o.n_prompt_tokens[idx]
    body = opens_body(o.prompt_len[idx], o.num_cached[idx], o.num_layers, o.top_k, o.layer_ids, nt,
                      None if o.prefix_filled is None else o.prefix_filled[idx],
                      None if o.prefix_refs is None else [o.prefix_refs[i] for i in idx.tolist()], ids=o.id_dtype)
    if "layer_ids" not in h.body:
        del body["layer_ids"]
    ids = idx.tolist()
    return [pack_header("opens", h.producer, h.epoch, h.seq, [o.request_ids[i] for i in ids], body),
            *o.subset_token_frames(tokens, ids)]


@dataclass(slots=True)
class Finish:
    request_id: str
    num_output: int
    reason: str
    prompt_len: int | None
    num_cached: int | None
    lost: list
    n_output_tokens: int
    refused: list = field(default_factory=list)     # of `lost`: ranges the producer refused (checks failed)
    broker_refused: list = field(default_factory=list)  # of `lost`: ranges of deltas the broker dropped


def _ranges(raw: Any, name: str) -> list:
    """A finish's list of [lo, hi] position ranges (its field `name`) as (lo, hi) tuples."""
    if not isinstance(raw, list) or len(raw) > 4096:
        raise _bad("bad_field", f"{name} must be a list of at most 4096 [lo, hi] ranges")
    out = []
    for r in raw:
        if (not isinstance(r, list) or len(r) != 2 or type(r[0]) is not int or type(r[1]) is not int
                or not 0 <= r[0] <= r[1] <= MAX_POSITION):
            raise _bad("bad_field", f"{name} range {r!r} is not [lo, hi] with 0 <= lo <= hi")
        out.append((r[0], r[1]))
    return out


def parse_finish(h: Header) -> Finish:
    rid = check_request_id(h.key)
    b = h.body
    G = int_field(b, "num_output", 0, MAX_POSITION)
    reason = b.get("reason", "stop")
    if type(reason) is not str or len(reason) > 64:
        raise _bad("bad_field", "finish reason must be a str of at most 64 characters")
    P = int_field(b, "prompt_len", 0, MAX_POSITION, None) if b.get("prompt_len") is not None else None
    C = int_field(b, "num_cached", 0, MAX_POSITION, None) if b.get("num_cached") is not None else None
    lost = _ranges(b.get("lost", []), "lost")
    refused = _ranges(b.get("refused", []), "refused")
    broker_refused = _ranges(b.get("broker_refused", []), "broker_refused")
    nt = int_field(b, "n_output_tokens", 0, MAX_POSITION, 0)
    return Finish(rid, G, reason, P, C, lost, nt, refused, broker_refused)


@dataclass(slots=True)
class Finishes(_EntryTokens):
    """A validated `finishes` header: entry i is the finish of request_ids[i] (`finishes[i]`), its output token ids
    tokens[offsets[i]:offsets[i + 1]] of the message's token array."""

    request_ids: list
    bodies: list              # each entry's body as sent (a `finish` body)
    finishes: list            # each entry as parse_finish reads it
    offsets: np.ndarray       # int64, len + 1 (_EntryTokens)

    def single(self, h: Header, tokens: np.ndarray | None, i: int) -> tuple:
        """Entry i as a `finish` of its own, from the same sender and seq: (header, payload frames)."""
        return (pack_header("finish", h.producer, h.epoch, h.seq, self.request_ids[i], self.bodies[i]),
                self.token_frames(i, tokens))

    def subset(self, h: Header, tokens: np.ndarray | None, idx: Sequence[int]) -> list:
        return subset_finishes(h, self, tokens, idx)


def parse_finishes(h: Header, frames: Sequence = ()) -> tuple[Finishes, np.ndarray | None]:
    """A `finishes` header and its payload frames: (the entries, every entry's output token ids as one int32 array
    or None). Each entry is checked as parse_finish checks a `finish`; anything wrong (an entry, a repeated id, a
    payload that does not match the entries' token counts) refuses the whole message."""
    ids = _id_list(h.key, "finishes")
    if not ids or len(set(ids)) != len(ids):
        raise _bad("bad_field", "finishes key is empty or repeats a request id")
    bodies = h.body.get("entries")
    if not isinstance(bodies, list) or len(bodies) != len(ids):
        raise _bad("bad_field", f"finishes needs entries: a list of {len(ids)} finish bodies, one per request id")
    out = []
    for rid, b in zip(ids, bodies):
        if not isinstance(b, dict):
            raise _bad("bad_field", f"finishes entry for {rid[:64]!r} is not a map")
        out.append(parse_finish(Header(h.version, "finish", h.producer, h.epoch, h.seq, rid, b)))
    offsets = _offsets([f.n_output_tokens for f in out])
    total = int(offsets[-1])
    if len(frames) != (1 if total else 0):
        raise _bad("frame_count", f"finishes announces {total} output tokens but has {len(frames)} payload frames")
    tokens = tokens_from_frame(frames[0], total, "output token") if total else None
    return Finishes(ids, bodies, out, offsets), tokens


def subset_finishes(h: Header, f: Finishes, tokens: np.ndarray | None, idx: Sequence[int]) -> list:
    """[header, payload frames...] of a `finishes` holding entries `idx` of `f` (in that order), same sender and seq
    (the broker's split by owner)."""
    idx = list(idx)
    return [pack_header("finishes", h.producer, h.epoch, h.seq, [f.request_ids[i] for i in idx],
                        {"entries": [f.bodies[i] for i in idx]}),
            *f.subset_token_frames(tokens, idx)]


def parse_abort(h: Header) -> tuple[str, str, int | None]:
    rid = check_request_id(h.key)
    reason = h.body.get("reason", "abort")
    if type(reason) is not str or len(reason) > 64:
        raise _bad("bad_field", "abort reason must be a str of at most 64 characters")
    n = h.body.get("num_output")
    if n is not None:
        n = int_field(h.body, "num_output", 0, MAX_POSITION)
    return rid, reason, n


def parse_refused(h: Header) -> tuple[list, str]:
    """broker -> consumer `refused`: (the request ids, the broker's reason)."""
    ids = h.key
    if not isinstance(ids, list) or len(ids) > MAX_REQUESTS_PER_DELTA:
        raise _bad("bad_field", f"refused key must be a list of at most {MAX_REQUESTS_PER_DELTA} request ids")
    reason = h.body.get("reason", "")
    if type(reason) is not str or len(reason) > 300:
        raise _bad("bad_field", "refused reason must be a str of at most 300 characters")
    return [check_request_id(r) for r in ids], reason


def tokens_from_frame(frame, n: int, what: str) -> np.ndarray:
    buf = frame.buffer if hasattr(frame, "buffer") else frame
    if len(buf) != n * TOKEN_DTYPE.itemsize:
        raise _bad("size_mismatch", f"{what} frame has {len(buf)} bytes for {n} int32 token ids")
    return np.frombuffer(buf, dtype=TOKEN_DTYPE).copy()


# ---------------------------------------------------------------------------------------------------------------
# control bodies: one typed parser per body, used at the boundary; the builders are the one place they are written

_U63 = (1 << 63) - 1


class ProducerAck(NamedTuple):
    """broker -> producer `ack`: every data message of producer epoch `epoch` with seq <= `upto` was applied."""

    epoch: int
    upto: int                 # -1: nothing yet
    rewind: bool = False      # send a hello, then resend everything unacknowledged, in seq order
    expect: int | None = None  # with rewind: the seq the broker expects next
    hello: bool = False       # with rewind: the broker does not know this producer (send a hello first)
    owners: tuple | None = None  # (request ids, owner groups): owner hints, see PROTOCOL.md


MAX_OWNER_HINTS = 4096         # per ack (the broker sends more in later acks)
OWNER_HINT_ID_BYTES = 1 << 20  # request id bytes per ack: the ack stays far below MAX_HEADER_BYTES
_OWNER_GROUP_MAX = (1 << 31) - 1


def take_owner_hints(due: dict) -> tuple[list, list]:
    """Take the owner hints one ack carries out of `due` (request id -> group), oldest first: at most
    MAX_OWNER_HINTS, and ids of at most OWNER_HINT_ID_BYTES in all (at least one)."""
    ids, groups, nbytes = [], [], 0
    for rid in due:
        nbytes += len(rid.encode("utf-8", "surrogatepass"))
        if ids and (len(ids) == MAX_OWNER_HINTS or nbytes > OWNER_HINT_ID_BYTES):
            break
        ids.append(rid)
    for rid in ids:
        groups.append(due.pop(rid))
    return ids, groups


def producer_ack_body(ack: ProducerAck) -> dict:
    body = {"epoch": ack.epoch, "upto": ack.upto}
    if ack.owners:
        body["owners"] = [list(ack.owners[0]), list(ack.owners[1])]
    if ack.rewind:
        body["rewind"] = True
        if ack.expect is not None:
            body["expect"] = ack.expect
        if ack.hello:
            body["hello"] = True
    return body


def parse_producer_ack(h: Header) -> ProducerAck:
    b = h.body
    expect = b.get("expect")
    if expect is not None:
        expect = int_field(b, "expect", 0, _U63)
    owners = b.get("owners")
    if owners is not None:
        if (not isinstance(owners, list) or len(owners) != 2 or not isinstance(owners[0], list)
                or not isinstance(owners[1], list) or len(owners[0]) != len(owners[1])
                or len(owners[0]) > MAX_OWNER_HINTS or not all(type(r) is str for r in owners[0])
                or not all(type(g) is int and 0 <= g <= _OWNER_GROUP_MAX for g in owners[1])):
            raise _bad("bad_field", f"ack owners must be [request ids, owner groups in [0, 2**31)], two lists of "
                                    f"equal length <= {MAX_OWNER_HINTS}, got {str(owners)[:80]}")
        owners = (owners[0], owners[1]) if owners[0] else None
    return ProducerAck(int_field(b, "epoch", 0, _U63), int_field(b, "upto", -1, _U63), bool(b.get("rewind")),
                       expect, bool(b.get("hello")), owners)


class LinkAck(NamedTuple):
    """consumer -> broker `ack`: every link message up to lseq `upto` of (broker_epoch, gen) was applied."""

    broker_epoch: int
    gen: int
    upto: int
    gap: int | None = None    # the lseq the consumer expected when a later one came: asks for a resync


def link_ack_body(ack: LinkAck) -> dict:
    body = {"link": [ack.broker_epoch, ack.gen, ack.upto]}
    if ack.gap is not None:
        body["gap"] = ack.gap
    return body


def parse_link_ack(h: Header) -> LinkAck:
    link = h.body.get("link")
    if (not isinstance(link, list) or len(link) != 3
            or not all(type(x) is int and 0 <= x <= _U63 for x in link)):
        raise _bad("bad_field", f"ack link must be [broker_epoch, gen, upto], got {str(link)[:80]}")
    gap = h.body.get("gap")
    if gap is not None:
        gap = int_field(h.body, "gap", 0, _U63)
    return LinkAck(link[0], link[1], link[2], gap)


def parse_producer_hello(h: Header) -> int:
    """producer -> broker `hello`/`heartbeat`: the producer's first seq not yet acknowledged (default 1)."""
    return int_field(h.body, "unacked_from", 0, _U63, 1)


def parse_consumer_hello(h: Header) -> int:
    """consumer -> broker `hello`/`heartbeat`: the last broker epoch it got data from (0: none)."""
    return int_field(h.body, "broker", 0, _U63, 0)


def parse_takes(h: Header) -> frozenset:
    """The optional data kinds a peer's hello/heartbeat (or the broker's reply) says it takes (`takes`)."""
    raw = h.body.get("takes")
    if raw is None:
        return frozenset()
    if not isinstance(raw, list) or len(raw) > 64 or not all(type(x) is str for x in raw):
        raise _bad("bad_field", "takes must be a list of at most 64 str")
    return frozenset(raw)


TAKES = [FEATURE_OPENS, FEATURE_FINISHES]      # what this version takes (sent in its hello/heartbeat bodies)
CONSUMER_TAKES = [*TAKES, FEATURE_HOLDS]       # and a consumer of this version: it answers `claim` too


def parse_holds(h: Header) -> list:
    """consumer -> broker `holds`: the request ids (the key) of requests the consumer holds, at most MAX_HOLDS_IDS;
    ProtocolError for a key that is not a list of valid request ids."""
    ids = h.key
    if not isinstance(ids, list) or len(ids) > MAX_HOLDS_IDS:
        raise _bad("bad_field", f"holds key must be a list of at most {MAX_HOLDS_IDS} request ids")
    return [check_request_id(r) for r in ids]


def parse_broker_hello(h: Header) -> int:
    """broker -> producer reply to `hello`/`heartbeat`: the number of live consumers."""
    return int_field(h.body, "consumers", 0, _U63, 0)


def parse_error(h: Header) -> str:
    """`error` body: the reason a peer's message was refused, as printable text of at most 300 characters."""
    return str(h.body.get("reason", ""))[:300]


class Refusal(NamedTuple):
    """broker -> producer `error` {reason, refused_seq, epoch}: the broker accepted and dropped that data message
    of that producer epoch (it can never be valid) and moves its ack frontier past it."""

    reason: str
    seq: int
    epoch: int


def refusal_body(r: Refusal) -> dict:
    return {"reason": r.reason[:300], "refused_seq": r.seq, "epoch": r.epoch}


def parse_refusal(h: Header) -> Refusal | None:
    """The Refusal an `error` carries; None for a plain error (no refused_seq)."""
    if h.body.get("refused_seq") is None:
        return None
    return Refusal(parse_error(h), int_field(h.body, "refused_seq", 1, _U63), int_field(h.body, "epoch", 0, _U63))


class Slice(NamedTuple):
    """The part of each record a trainer rank asks for (`fetch`/`subscribe` body fields `layers`, `tokens`).

    layers: (lo, hi) model layer ids [lo, hi) -- a pipeline stage's own decoder layers (Megatron: its layer
    offset and count); the record keeps the MoE layers whose `moe_layer_ids` fall there (at least one, or the
    record is answered `error` "bad_slice"). tokens: (lo, hi) absolute positions [lo, hi) of prompt + output (a
    context-parallel rank's chunk), clipped to the record's length. None: all of that axis."""

    layers: tuple | None = None
    tokens: tuple | None = None

    def body(self) -> dict:
        return {k: [int(v[0]), int(v[1])] for k, v in (("layers", self.layers), ("tokens", self.tokens))
                if v is not None}


def check_range(value: Any, name: str, hi_limit: int) -> tuple | None:
    """A slice range (lo, hi), 0 <= lo < hi <= hi_limit, or None; ValueError naming the value otherwise."""
    if value is None:
        return None
    try:
        lo, hi = value
    except (TypeError, ValueError):
        raise ValueError(f"{name}={str(value)[:64]}: expected (lo, hi)") from None
    if type(lo) not in (int, np.int32, np.int64) or type(hi) not in (int, np.int32, np.int64) \
            or not 0 <= lo < hi <= hi_limit:
        raise ValueError(f"{name}=({str(lo)[:32]}, {str(hi)[:32]}): expected integers 0 <= lo < hi <= {hi_limit}")
    return int(lo), int(hi)


def make_slice(layers: Any = None, tokens: Any = None) -> Slice | None:
    """A Slice from a trainer's arguments (None when both are None); ValueError naming a bad range."""
    sl = Slice(check_range(layers, "layers", MAX_LAYER_ID), check_range(tokens, "tokens", MAX_POSITION))
    return None if sl == Slice() else sl


def parse_slice(body: dict) -> Slice | None:
    """The `layers`/`tokens` fields of a fetch or subscribe body (absent: None, the whole record)."""
    try:
        return make_slice(_as_range(body.get("layers")), _as_range(body.get("tokens")))
    except ValueError as e:
        raise _bad("bad_slice", str(e)) from None


def _as_range(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


class Fetch(NamedTuple):
    """trainer -> consumer `fetch`: the records of these request ids, waiting up to timeout_ms for unfinished ones."""

    request_ids: list
    timeout_ms: int
    answer_unknown: bool = False   # also answer `error{reason: "unknown"}` at once for ids the consumer never saw
    slice: Slice | None = None     # only this part of each record (None: all of it)


def parse_fetch(h: Header) -> Fetch:
    ids = h.key
    if not isinstance(ids, list) or len(ids) > MAX_REQUESTS_PER_DELTA:
        raise _bad("bad_field", f"fetch key must be a list of at most {MAX_REQUESTS_PER_DELTA} request ids")
    for rid in ids:
        check_request_id(rid)
    return Fetch(ids, int_field(h.body, "timeout_ms", 0, 1 << 31, 60_000), h.body.get("answer_unknown") is True,
                 parse_slice(h.body))


def parse_subscribe(h: Header) -> str | None:
    """trainer -> consumer `hello`: the request-id prefix it subscribes to (None: not a subscription)."""
    prefix = h.body.get("subscribe")
    if prefix is None:
        return None
    if type(prefix) is not str or len(prefix) > MAX_REQUEST_ID_BYTES:
        raise _bad("bad_field", f"subscribe prefix must be a str of at most {MAX_REQUEST_ID_BYTES} characters")
    return prefix


def slice_record(rec: "Record", sl: Slice | None) -> "Record":
    """The part of `rec` that `sl` asks for, as a Record that says which part it is (layer_range, token_range).

    Rows and token ids are views where the kept layers are consecutive. `missing` keeps the absolute positions that
    fall in the token range; num_cached_tokens and num_prefix_filled stay absolute counts. A layer range that
    holds none of the record's MoE layers is ProtocolError "bad_slice" naming both."""
    if sl is None:
        return rec
    P, G = rec.prompt_routed_experts.shape[0], rec.routed_experts.shape[0]
    pr, ge, ids = rec.prompt_routed_experts, rec.routed_experts, np.asarray(rec.moe_layer_ids)
    pt, ot, missing = rec.prompt_token_ids, rec.output_token_ids, list(rec.missing)
    layer_range = token_range = None
    if sl.layers is not None:
        lo, hi = sl.layers
        cols = np.nonzero((ids >= lo) & (ids < hi))[0]
        if not len(cols):
            raise _bad("bad_slice", f"layers [{lo}, {hi}) hold no MoE layer of record {rec.request_id[:64]!r} "
                                    f"(moe_layer_ids {ids.tolist()[:8]}{'...' if len(ids) > 8 else ''})")
        c = (slice(int(cols[0]), int(cols[-1]) + 1) if int(cols[-1]) - int(cols[0]) + 1 == len(cols) else cols)
        pr, ge, ids = pr[:, c], ge[:, c], ids[c]
        layer_range = (lo, hi)
    if sl.tokens is not None:
        lo, hi = min(sl.tokens[0], P + G), min(sl.tokens[1], P + G)
        ps, gs = slice(min(lo, P), min(hi, P)), slice(max(lo - P, 0), max(hi - P, 0))
        pr, ge = pr[ps], ge[gs]
        pt = None if pt is None else pt[ps]
        ot = None if ot is None else ot[gs]
        missing = [(max(a, lo), min(b, hi)) for a, b in missing if max(a, lo) < min(b, hi)]
        token_range = (lo, hi, P + G)
    return Record(rec.request_id, pr, ge, rec.num_cached_tokens, ids, rec.complete, missing, rec.reason,
                  rec.finish_reason, pt, ot, rec.num_prefix_filled, layer_range, token_range)


# ---------------------------------------------------------------------------------------------------------------
# records (consumer -> trainer)


@dataclass
class Record:
    """One finished request's routing: prompt part and generation part, one row per token.

    From a Consumer, both arrays are views of the request's rows in the consumer's arena (no copy): the memory
    goes back to the consumer once every view of them is gone, so keeping a small slice keeps the whole record."""

    request_id: str
    prompt_routed_experts: np.ndarray          # (P, L, K) int16, -1 where never computed (and, unless
                                               # num_prefix_filled, where prefix-cached); or uint8/uint16 with
                                               # missing_id there (id_dtype; ids="compact" readers)
    routed_experts: np.ndarray                 # (G, L, K), row j computed when output token j was fed
    num_cached_tokens: int
    moe_layer_ids: np.ndarray                  # (L,) int32: the model's layer index of each MoE layer
    complete: bool
    missing: list = field(default_factory=list)   # [(lo, hi)] absolute positions never delivered
    reason: str = ""                           # why incomplete ("" when complete)
    finish_reason: str = ""
    prompt_token_ids: np.ndarray | None = None
    output_token_ids: np.ndarray | None = None
    # rows [0, num_prefix_filled) were filled from the engine's prefix store (ROUTING_REPLAY_PREFIX_ROWS=fill):
    # the routing that computed the cached KV. 0: prefix-cached rows are -1 (the default, `sentinel`). A filled
    # row whose source was gone is -1 and listed in `missing` (reason "prefix_not_found").
    num_prefix_filled: int = 0
    # a slice (slice_record, a fetch or subscribe that asked for one): the model layer range [lo, hi) asked for
    # (moe_layer_ids are the MoE layers kept); (lo, hi, n): the absolute positions [lo, hi) the rows cover, of the
    # whole record's n = P + G: prompt rows are positions [lo, min(hi, P)) and generation rows the rest, so row i
    # of concat(prompt, generation) is position lo + i, and the sample's last position is in it when hi == n.
    # None: all layers / all positions (the whole record).
    layer_range: tuple | None = None
    token_range: tuple | None = None

    @property
    def id_dtype(self) -> np.dtype:
        """The dtype of both row arrays: int16 (-1 never computed, the default of every reader) or, fetched or
        loaded with ids="compact", uint8 (255) / uint16 (65535) as the consumer stored them."""
        return self.prompt_routed_experts.dtype

    @property
    def missing_id(self) -> int:
        """The value of a row never computed in this record's rows (missing_id(id_dtype))."""
        return missing_id(self.id_dtype)

    def widened(self) -> "Record":
        """This record with int16 rows, -1 where never computed (today's arrays); itself when they are int16."""
        if self.prompt_routed_experts.dtype == ROW_DTYPE and self.routed_experts.dtype == ROW_DTYPE:
            return self
        return replace(self, prompt_routed_experts=widen_rows(self.prompt_routed_experts),
                       routed_experts=widen_rows(self.routed_experts))

    def as_ids(self, ids: str) -> "Record":
        """The record as a reader asked for it: ids="int16" (widened(), today's arrays) or "compact" (as stored,
        no copy); ValueError naming anything else."""
        if ids == "int16":
            return self.widened()
        if ids == "compact":
            return self
        raise ValueError(f"ids={str(ids)[:32]!r}: expected 'int16' or 'compact'")

    @property
    def nbytes(self) -> int:
        n = self.prompt_routed_experts.nbytes + self.routed_experts.nbytes
        for t in (self.prompt_token_ids, self.output_token_ids):
            if t is not None:
                n += t.nbytes
        return n

    def equals(self, other: "Record") -> bool:
        return (self.request_id == other.request_id and self.complete == other.complete
                and self.num_cached_tokens == other.num_cached_tokens
                and self.num_prefix_filled == other.num_prefix_filled
                and self.layer_range == other.layer_range and self.token_range == other.token_range
                and [tuple(m) for m in self.missing] == [tuple(m) for m in other.missing]
                and self.reason == other.reason and self.finish_reason == other.finish_reason
                and np.array_equal(self.moe_layer_ids, other.moe_layer_ids)
                and _same(self.prompt_routed_experts, other.prompt_routed_experts)
                and _same(self.routed_experts, other.routed_experts)
                and _same_opt(self.prompt_token_ids, other.prompt_token_ids)
                and _same_opt(self.output_token_ids, other.output_token_ids))


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def _same_opt(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return _same(a, b)


def encode_record(rec: Record, producer: str, seq: int) -> list:
    P, L, K = rec.prompt_routed_experts.shape
    body = {
        "prompt_len": P, "num_output": rec.routed_experts.shape[0], "num_cached": rec.num_cached_tokens,
        "num_layers": L, "top_k": K, "layer_ids": [int(x) for x in rec.moe_layer_ids],
        "complete": rec.complete, "missing": [list(m) for m in rec.missing], "reason": rec.reason,
        "finish_reason": rec.finish_reason,
        "n_prompt_tokens": -1 if rec.prompt_token_ids is None else len(rec.prompt_token_ids),
        "n_output_tokens": -1 if rec.output_token_ids is None else len(rec.output_token_ids),
    }
    if rec.num_prefix_filled:
        body["num_prefix_filled"] = int(rec.num_prefix_filled)
    if rec.layer_range is not None:
        body["layer_range"] = [int(x) for x in rec.layer_range]
    if rec.token_range is not None:
        body["token_range"] = [int(x) for x in rec.token_range]
    dt = as_id_dtype(rec.prompt_routed_experts.dtype)
    if rec.routed_experts.dtype != dt:
        raise ValueError(f"record {rec.request_id[:64]!r} has {dt.name} prompt rows and "
                         f"{rec.routed_experts.dtype.name} generation rows")
    _put_ids(body, dt)
    prompt = _row_frames(rec.prompt_routed_experts, L * K * dt.itemsize, dt)
    gen = _row_frames(rec.routed_experts, L * K * dt.itemsize, dt)
    if len(prompt) > 1 or len(gen) > 1:
        # a part over MAX_PAYLOAD_FRAME_BYTES goes as several frames: the trainer's socket drops one over
        # MAX_MESSAGE_BYTES (ZMQ_MAXMSGSIZE) and, with it, its connection (the record came back every retry and
        # never arrived)
        body["row_frames"] = [len(prompt), len(gen)]
    frames = [pack_header("record", producer, 0, seq, rec.request_id, body), *prompt, *gen]
    if rec.prompt_token_ids is not None:
        frames.append(np.ascontiguousarray(rec.prompt_token_ids, TOKEN_DTYPE))
    if rec.output_token_ids is not None:
        frames.append(np.ascontiguousarray(rec.output_token_ids, TOKEN_DTYPE))
    return frames


def _row_frames(rows: np.ndarray, row_bytes: int, dtype: np.dtype) -> list:
    """A record part's rows as frames of at most MAX_PAYLOAD_FRAME_BYTES each (one frame, as before, when it
    fits); views of one contiguous array, no copy where the rows already are one."""
    rows = np.ascontiguousarray(rows, dtype)
    per = MAX_PAYLOAD_FRAME_BYTES // row_bytes
    if len(rows) <= per:
        return [rows]
    return [rows[i:i + per] for i in range(0, len(rows), per)]


def decode_record(h: Header, frames: Sequence) -> Record:
    rid = check_request_id(h.key)
    b = h.body
    P = int_field(b, "prompt_len", 0, MAX_POSITION)
    G = int_field(b, "num_output", 0, MAX_POSITION)
    L = int_field(b, "num_layers", 1, MAX_LAYERS)
    K = int_field(b, "top_k", 1, MAX_TOP_K)
    npt = int_field(b, "n_prompt_tokens", -1, MAX_POSITION, -1)
    nout = int_field(b, "n_output_tokens", -1, MAX_POSITION, -1)
    split = b.get("row_frames", [1, 1])
    if not (isinstance(split, list) and len(split) == 2 and all(type(x) is int and 1 <= x <= MAX_FRAMES
                                                                 for x in split)):
        raise _bad("bad_field", f"record row_frames {str(split)[:64]}: expected [prompt frames, generation frames]")
    nfp, nfg = split
    want = nfp + nfg + (npt >= 0) + (nout >= 0)
    if len(frames) != want:
        raise _bad("frame_count", f"record has {len(frames)} payload frames, expected {want}")
    dt = parse_ids(h)
    row_bytes = L * K * dt.itemsize

    def rows(part, n, what):
        """`part`: the frames of n rows; every frame holds whole rows, all of them n rows. One copy."""
        bufs = [f.buffer if hasattr(f, "buffer") else f for f in part]
        sizes = [memoryview(x).nbytes for x in bufs]
        if sum(sizes) != n * row_bytes or any(sz % row_bytes for sz in sizes) or (len(bufs) > 1 and 0 in sizes):
            raise _bad("size_mismatch", f"record {what} rows frames have {sizes[:8]} bytes for ({n}, {L}, {K}) "
                                        f"{dt.name}")
        out = np.empty((n, L, K), dtype=dt)
        at = 0
        for x, sz in zip(bufs, sizes):
            k = sz // row_bytes
            out[at:at + k] = np.frombuffer(x, dtype=dt).reshape(k, L, K)
            at += k
        return out

    prompt = rows(frames[:nfp], P, "prompt")
    gen = rows(frames[nfp:nfp + nfg], G, "generation")
    i = nfp + nfg
    pt = ot = None
    if npt >= 0:
        pt = tokens_from_frame(frames[i], npt, "prompt token")
        i += 1
    if nout >= 0:
        ot = tokens_from_frame(frames[i], nout, "output token")
    missing = [tuple(m) for m in b.get("missing", [])]
    try:
        layer_range = check_range(_as_range(b.get("layer_range")), "layer_range", MAX_LAYER_ID)
    except ValueError as e:
        raise _bad("bad_field", f"record {e}") from None
    token_range = b.get("token_range")          # [lo, hi, n], lo == hi == n where the range lay past the end
    if token_range is not None:
        if not (isinstance(token_range, list) and len(token_range) == 3 and all(type(x) is int for x in token_range)
                and 0 <= token_range[0] <= token_range[1] <= token_range[2] <= 2 * MAX_POSITION):
            raise _bad("bad_field", f"record token_range {str(token_range)[:64]}: expected [lo, hi, n], "
                                    f"0 <= lo <= hi <= n")
        token_range = tuple(token_range)
    if token_range is not None and token_range[1] - token_range[0] != P + G:
        raise _bad("bad_field", f"record token_range {list(token_range)} for {P} + {G} rows")
    return Record(rid, prompt, gen, int_field(b, "num_cached", 0, MAX_POSITION),
                  np.asarray(b.get("layer_ids", list(range(L))), dtype=np.int32), bool(b.get("complete")),
                  missing, str(b.get("reason", "")), str(b.get("finish_reason", "")), pt, ot,
                  int_field(b, "num_prefix_filled", 0, P if token_range is None else MAX_POSITION, 0),
                  layer_range, token_range)
