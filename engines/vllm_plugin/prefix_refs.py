"""Name, per KV block, the captured request whose computed prompt tokens filled it: prefix_refs for later hits.

In GRPO a group's samples share a prompt and groups share a system prompt: the engine computes those KV blocks
once, later requests hit them. With ROUTING_REPLAY_PREFIX_ROWS=fill each hit's rows are read from the prefix store
and sent again; with references (ROUTING_REPLAY_PREFIX_REFS, on by default with fill) an open names instead the
request that computed them and the rows are not sent (docs/PROTOCOL.md, "Prefix references").

`BlockWriters` owns, per KV block id (group 0), its writer: (record key, position of the block's first token,
the chain hash of the writer's token ids up to the block's end). Host data only, from the scheduler output: a
captured request's blocks (`block_ids` at its first step, `new_block_ids` at later ones) and the prompt positions
each step computes. A block is recorded once one request computed all its tokens itself (chunked prefill: over
several steps); blocks the request only hit keep their writer, blocks filled by decode tokens or by requests not
captured are not recorded. A reference is given for a hit block only when its writer is known and the chain hash
of the referencing request's tokens up to that block's end equals the writer's: a block id reallocated to other
content never names the earlier writer. A writer's key opened again forgets that key's blocks (the consumer
resolves a writer by key); a reload or reset of the KV cache forgets all.

Only the leading run of hit blocks with a known writer becomes references: the positions after the first unknown
block are gathered from the prefix store as before, so a record's rows [0, num_cached) are references then rows
sent, and the consumer's fail-closed rules cover every case (a writer whose rows it does not hold: -1, flagged).
"""

from __future__ import annotations

from typing import Sequence


def chain_hashes(tokens: Sequence[int], block_size: int, n_blocks: int) -> list:
    """hash of tokens [0, (b + 1) * block_size) for b < n_blocks (each over the previous one and the block's own
    tokens: O(len) in all)."""
    out, h = [], 0
    for b in range(n_blocks):
        h = hash((h, tuple(tokens[b * block_size:(b + 1) * block_size])))
        out.append(h)
    return out


class _Prefill:
    """One captured request while it computes its prompt: its blocks so far, its blocks' chain hashes, the first
    block it computes itself and the next block not yet recorded."""

    __slots__ = ("key", "blocks", "hashes", "next_block", "full_blocks")

    def __init__(self, key: str, blocks: list, hashes: list, first_block: int):
        self.key, self.blocks, self.hashes = key, blocks, hashes
        self.next_block = first_block
        self.full_blocks = len(hashes)


class BlockWriters:
    """Own the writer of every recorded KV block and the captured requests still computing their prompts."""

    def __init__(self, block_size: int, max_blocks: int = 1 << 22):
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.writer: dict[int, tuple] = {}       # block id -> (key, first position, chain hash)
        self._by_key: dict[str, list] = {}       # key -> block ids recorded for it (forget on reuse)
        self.prefill: dict[str, _Prefill] = {}   # engine request id -> its prompt computation
        self.ref_rows = 0                        # rows sent by reference (stats)
        self.ref_requests = 0

    def clear(self) -> None:
        """The KV cache's contents can no longer be told from the rows recorded (reload, reset): forget all."""
        self.writer.clear()
        self._by_key.clear()
        self.prefill.clear()

    def open(self, rid: str, key: str, tokens, blocks: Sequence[int], hits: int, prompt_len: int,
             scheduled: int) -> tuple[tuple, int]:
        """A captured request's first step: its references ((writer, writer_pos, pos, count), ...) and the rows
        they cover (a multiple of the block size, from 0), then its computation recorded as from now. `blocks`:
        its group-0 block ids; `hits`: prefix-cache hits (whole blocks); `scheduled`: tokens this step computes."""
        self.forget_key(key)
        bs = self.block_size
        if tokens is None or bs <= 0:
            return (), 0
        n_full = prompt_len // bs
        hashes = chain_hashes(tokens, bs, n_full)
        refs: list = []
        covered = 0
        writer = self.writer
        for b in range(hits // bs):
            w = writer.get(blocks[b]) if b < len(blocks) else None
            if w is None or w[2] != hashes[b] or w[0] == key:
                break
            wk, wpos = w[0], w[1]
            last = refs[-1] if refs else None
            if last is not None and last[0] == wk and last[1] + last[3] == wpos and last[2] + last[3] == b * bs:
                last[3] += bs
            else:
                refs.append([wk, wpos, b * bs, bs])
            covered += bs
        if covered:
            self.ref_rows += covered
            self.ref_requests += 1
        first = (hits + bs - 1) // bs          # (hits are whole blocks: its first block computed here)
        if first < n_full:
            st = self.prefill[rid] = _Prefill(key, list(blocks), hashes, first)
            self._computed(rid, st, hits + scheduled)
        return tuple(tuple(r) for r in refs), covered

    def forget_key(self, key: str) -> None:
        blocks = self._by_key.pop(key, None)
        if blocks:
            writer = self.writer
            for b in blocks:
                w = writer.get(b)
                if w is not None and w[0] == key:
                    del writer[b]

    def step(self, cached, num_scheduled: dict) -> None:
        """A step's scheduled requests that were opened before (`cached`: vLLM's CachedRequestData): the blocks of
        the captured ones still computing their prompts; called only while there are such requests."""
        pf = self.prefill
        at = dict(zip(cached.req_ids, range(len(cached.req_ids))))     # (C speed: no Python line per request)
        for rid in list(pf):
            i = at.get(rid)
            if i is None:
                continue                            # not scheduled this step
            st = pf[rid]
            if rid in cached.resumed_req_ids:       # preempted and resumed: its blocks are new, not followed
                del pf[rid]
                continue
            nb = cached.new_block_ids[i]
            if nb:
                st.blocks += nb[0]
            self._computed(rid, st, cached.num_computed_tokens[i] + num_scheduled.get(rid, 0))

    def _computed(self, rid: str, st: _Prefill, upto: int) -> None:
        """Positions [0, upto) of the request are computed after this step: record its full blocks among them."""
        bs = self.block_size
        done = min(upto // bs, st.full_blocks, len(st.blocks))
        b = st.next_block
        if done > b:
            writer, blocks, hashes, key = self.writer, st.blocks, st.hashes, st.key
            mine = self._by_key.setdefault(key, [])
            for j in range(b, done):
                writer[blocks[j]] = (key, j * bs, hashes[j])
                mine.append(blocks[j])
            st.next_block = done
            if len(writer) > self.max_blocks:        # (never: at most the KV cache's blocks are ever named)
                self.clear()
                return
        if st.next_block >= st.full_blocks:
            self.prefill.pop(rid, None)

    def ended(self, rids) -> None:
        """Requests finished or preempted: no longer followed (their recorded blocks keep their writer)."""
        pf = self.prefill
        for rid in rids:
            pf.pop(rid, None)
