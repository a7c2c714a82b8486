"""Scheduling for the serving engine: queues, chunked prefill under a token budget, admission by projected
compressed size, compression triggers, preemption.

Pure logic, testable without a model: sequences are seen through :class:`ScheduledSequence` and the pool
through its free-block count; the engine owns the model, the pool and the caches, and calls the scheduler
in this order every step (the schedule of KV-Compress's vLLM runner, arXiv 2410.00161):

1. :meth:`Scheduler.plan_compression` — whether compression runs now and on which running sequences. Forced
   after a new prefill and when the running sequences need more blocks than are free (``must_preempt``); a
   compression forced only by memory pressure locks new prefills until a running sequence finishes or is
   preempted. Otherwise it runs every ``compression_interval`` steps.
2. :meth:`Scheduler.preempt` — if the next decode step still does not fit, preempt by recompute, newest first.
3. The engine decodes every *decoding* running sequence (prefill complete) in one batch, then calls
   :meth:`Scheduler.finish` for the finished ones and :meth:`Scheduler.tick`.
4. :meth:`Scheduler.schedule_prefill` — chunked prefill as vLLM schedules it: one step's token budget
   (``max_num_batched_tokens``) is shared by the decodes (one token each) and prefill chunks of at most
   ``prefill_chunk`` tokens, one chunk per sequence per step, so a long prompt delays the other streams by at most
   one chunk. Sequences already prefilling go first (oldest first), then waiting sequences are admitted first
   come, first served while (a) every running sequence's committed blocks plus the newcomer's stay within the pool
   — a sequence is committed for ``max(held, projected)``, the projection being what it holds once compressed
   (:meth:`ScheduledSequence.committed_blocks`), so the batch is bounded by compressed, not uncompressed, sizes;
   with room for its uncompressed first chunk on top — and (b) the chunk's blocks are free now. Preemption by
   recompute is the safety net when the projection is short.

Chunk boundaries depend only on the request (every chunk but the last is exactly ``prefill_chunk`` tokens), never
on what else runs, so a request's output does not depend on the batch it shares.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from ..errors import InvalidParameterError


class ScheduledSequence(Protocol):
    """The scheduler's view of one request (the engine's request object implements it)."""

    arrival: int  # submission order; larger is newer
    steps_since_compression: int  # decode steps since its last compression (or its prefill)
    compressed_since_prefill: bool  # compressed at least once since its latest (re)prefill

    def prefill_tokens(self) -> int:
        """Tokens a (re)prefill feeds: the prompt plus every token generated so far."""

    def blocks_held(self) -> int:
        """Blocks of the pool it holds now (0 while waiting)."""

    def decode_blocks_needed(self) -> int:
        """Extra blocks its next decode step allocates (0 while waiting)."""

    def kv_entries(self) -> int:
        """Stored (token, layer, KV head) entries."""

    def prefill_remaining(self) -> int:
        """Tokens of its (re)prefill not yet fed (0 once it decodes; ``prefill_tokens()`` while waiting)."""

    def chunk_blocks_needed(self, tokens: int, last: bool) -> int:
        """Extra blocks a prefill chunk of ``tokens`` allocates (``last``: plus the first decoded token's)."""

    def committed_blocks(self) -> int:
        """Blocks admission counts it for: ``max(held now, projected after compression)``."""


class BlockCounts(Protocol):
    """Block counts of many sequences at once (an engine answers for all of them in one batched call)."""

    def decode_need(self, seqs: list) -> int:
        """Extra blocks the next decode step of the decoding sequences ``seqs`` allocates, summed."""

    def committed(self, seqs: list) -> int:
        """``committed_blocks()`` summed over ``seqs``."""


class PerSequenceCounts:
    """:class:`BlockCounts` asked of each sequence in turn, through the :class:`ScheduledSequence` protocol."""

    @staticmethod
    def decode_need(seqs: list) -> int:
        return sum(s.decode_blocks_needed() for s in seqs)

    @staticmethod
    def committed(seqs: list) -> int:
        return sum(s.committed_blocks() for s in seqs)


@dataclass(frozen=True)
class BlockGeometry:
    """Block arithmetic of a paged cache with one block table per (layer, KV head)."""

    layers: int
    kv_heads: int
    block_size: int

    @property
    def tables(self) -> int:
        return self.layers * self.kv_heads

    def blocks_for(self, tokens: int) -> int:
        """Blocks that ``tokens`` uncompressed tokens occupy (every table holds all of them)."""
        return self.tables * math.ceil(tokens / self.block_size)

    def budget_blocks(self, max_cache_tokens: int) -> int:
        """Blocks a sequence keeps at a per-head average budget of ``max_cache_tokens`` (rounded up)."""
        return math.ceil(max_cache_tokens * self.tables / self.block_size)


def max_cache_tokens(tokens: int, compression_rate: float, min_cache_tokens: int, block_size: int) -> int:
    """The per-head average budget M for a sequence of ``tokens`` at compression rate ``cr`` (the paper's
    runners): M = max(min_cache_tokens, floor((T/cr − 1) / block_size) · block_size)."""
    return max(min_cache_tokens, math.floor((tokens / compression_rate - 1) / block_size) * block_size)


@dataclass
class CompressionPlan:
    """Sequences to compress this step, oldest-compressed first, and why compression runs."""

    sequences: list
    after_prefill: bool
    memory_pressure: bool


@dataclass
class PrefillPlan:
    """This step's prefill work: ``chunks`` as ``(sequence, tokens)`` (running prefills first, then newly
    ``admitted`` ones), and waiting sequences removed because they could never fit (``impossible``)."""

    chunks: list
    admitted: list
    impossible: list


class Scheduler:
    """Waiting and running queues of one engine over a pool of ``num_blocks`` blocks.

    Args:
        geometry: block arithmetic of the pool's paged cache
        num_blocks: blocks in the pool
        compress: whether compression runs at all (compression rate > 1)
        compress_once: compress each sequence only in the first compression after its (re)prefill
        compression_interval: steps between compressions that nothing forces (1 = every step)
        max_kv_per_compression: entries one compression may cover (candidates are added while the total stays
            within it; at least one is always taken)
        max_batch: running sequences at most (None = only memory limits it)
        prefill_chunk: tokens of one prefill chunk (every chunk of a prompt but the last has exactly this many)
        max_num_batched_tokens: tokens one step feeds at most, decodes and prefill chunks together (at least one
            chunk is scheduled when a sequence waits to prefill, whatever the decodes take)
        counts: how block counts over many sequences are computed (default: sequence by sequence); the engine
            passes one that answers for the whole batch in one vectorized call over its block tables
    """

    def __init__(
        self,
        geometry: BlockGeometry,
        num_blocks: int,
        *,
        compress: bool,
        compress_once: bool = False,
        compression_interval: int = 1,
        max_kv_per_compression: int = 5_000_000,
        max_batch: int | None = None,
        prefill_chunk: int = 512,
        max_num_batched_tokens: int = 2048,
        counts: BlockCounts | None = None,
    ):
        for name, value in (("prefill_chunk", prefill_chunk), ("max_num_batched_tokens", max_num_batched_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidParameterError(f"{name} must be an integer >= 1, got {value!r}")
        if compression_interval < 1:
            raise InvalidParameterError(f"compression_interval must be >= 1, got {compression_interval}")
        if max_batch is not None and max_batch < 1:
            raise InvalidParameterError(f"max_batch must be >= 1 or None, got {max_batch}")
        self.geometry = geometry
        self.num_blocks = num_blocks
        self.compress = compress
        self.compress_once = compress_once
        self.compression_interval = compression_interval
        self.max_kv_per_compression = max_kv_per_compression
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.max_num_batched_tokens = max_num_batched_tokens
        self.counts: BlockCounts = PerSequenceCounts() if counts is None else counts
        self.waiting: deque = deque()
        self.running: list = []
        self.uncompressed_prefill = False
        self.lock_prefill = False
        self.iterations = 0  # steps since the last compression

    # ------------------------------------------------------------------------------------------- queues
    def add(self, seq: ScheduledSequence) -> None:
        """Queue a new request (first come, first served)."""
        self.waiting.append(seq)

    def finish(self, seq: ScheduledSequence) -> None:
        """Drop a finished or cancelled sequence from whichever queue holds it (the caller frees its blocks)."""
        if seq in self.running:
            self.running.remove(seq)
            self.lock_prefill = False
        elif seq in self.waiting:
            self.waiting.remove(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def decoding(self) -> list:
        """Running sequences whose prefill is complete (they decode this step), in running order."""
        return [s for s in self.running if s.prefill_remaining() == 0]

    def prefilling(self) -> list:
        """Running sequences with prefill chunks still to feed, oldest first."""
        return sorted((s for s in self.running if s.prefill_remaining() > 0), key=lambda s: s.arrival)

    # ---------------------------------------------------------------------------------------- memory
    def decode_need(self) -> int:
        """Blocks the decoding sequences' next decode step allocates."""
        return self.counts.decode_need(self.decoding())

    def must_preempt(self, num_free: int) -> bool:
        return self.decode_need() > num_free

    def can_ever_fit(self, tokens: int) -> bool:
        """Whether a prefill of ``tokens`` (plus its first decoded token) fits in the empty pool."""
        return self.geometry.blocks_for(tokens + 1) <= self.num_blocks

    # ----------------------------------------------------------------------------------- compression
    def plan_compression(self, num_free: int) -> CompressionPlan | None:
        """Decide whether compression runs this step and on which running sequences (None: it does not)."""
        decoding = self.decoding()
        if not self.compress or not decoding:
            self.uncompressed_prefill = False
            return None
        self.iterations += 1
        pressure = self.must_preempt(num_free)
        after_prefill = self.uncompressed_prefill
        if not (after_prefill or pressure or self.iterations >= self.compression_interval):
            return None
        candidates = [s for s in decoding if not (self.compress_once and s.compressed_since_prefill)]
        candidates.sort(key=lambda s: s.steps_since_compression, reverse=True)  # stable: older first on ties
        picked, total = [], 0
        for seq in candidates:
            entries = seq.kv_entries()
            if picked and total + entries > self.max_kv_per_compression:
                break
            picked.append(seq)
            total += entries
        if pressure and not after_prefill:
            self.lock_prefill = True  # avoid compress/preempt thrash: no prefill until something leaves
        self.uncompressed_prefill = False
        self.iterations = 0
        return CompressionPlan(picked, after_prefill=after_prefill, memory_pressure=pressure)

    @staticmethod
    def mark_compressed(seq: ScheduledSequence) -> None:
        seq.steps_since_compression = 0
        seq.compressed_since_prefill = True

    # ------------------------------------------------------------------------------------- preemption
    def preempt(self, num_free: int) -> list:
        """Preempt running sequences by recompute, newest first, until the next decode step fits.

        Victims go back to the front of the waiting queue (oldest victim first); the caller releases their
        blocks and resets them for a recompute prefill. A sequence whose recompute could never fit in the
        empty pool is spared while another victim exists.
        """
        victims: list = []
        free = num_free
        while self.running and self.decode_need() > free:
            by_age = sorted(self.running, key=lambda s: s.arrival, reverse=True)
            victim = next((s for s in by_age if self.can_ever_fit(s.prefill_tokens())), by_age[0])
            self.running.remove(victim)
            free += victim.blocks_held()
            victims.append(victim)
        for victim in sorted(victims, key=lambda s: s.arrival, reverse=True):
            self.waiting.appendleft(victim)
        if victims:
            self.lock_prefill = False
        return victims

    # -------------------------------------------------------------------------------------- admission
    def schedule_prefill(self, num_free: int, decode_tokens: int = 0) -> PrefillPlan:
        """The prefill chunks of this step (see the module docstring); admitted sequences join ``running``.

        Args:
            num_free: free blocks of the pool now
            decode_tokens: tokens the decodes of this step took from the budget
        """
        plan = PrefillPlan([], [], [])
        budget = self.max_num_batched_tokens - decode_tokens
        free = num_free - self.decode_need()

        def fits_budget(n: int) -> bool:
            return n <= budget or not plan.chunks  # progress: one chunk per step at least

        for seq in self.prefilling():
            remaining = seq.prefill_remaining()
            n = min(self.prefill_chunk, remaining)
            need = seq.chunk_blocks_needed(n, n == remaining)
            if not fits_budget(n) or need > free:
                return plan  # first come, first served: nothing younger overtakes it
            plan.chunks.append((seq, n))
            budget -= n
            free -= need
        if self.lock_prefill:
            return plan
        committed = self.counts.committed(self.running) + self.decode_need()
        while self.waiting and (self.max_batch is None or len(self.running) < self.max_batch):
            seq = self.waiting[0]
            if not self.can_ever_fit(seq.prefill_tokens()):
                plan.impossible.append(self.waiting.popleft())
                continue
            remaining = seq.prefill_tokens()
            n = min(self.prefill_chunk, remaining)
            need = seq.chunk_blocks_needed(n, n == remaining)
            projected = seq.committed_blocks()
            # Its first chunk sits uncompressed in the pool until compressed: without room for it as well, an
            # admitted prompt would wait behind the compressed sequences, holding blocks.
            if committed + projected + need > self.num_blocks and self.running:
                break
            if not fits_budget(n) or need > free:
                break
            self.waiting.popleft()
            self.running.append(seq)
            plan.admitted.append(seq)
            plan.chunks.append((seq, n))
            committed += projected
            budget -= n
            free -= need
        return plan

    def prefill_done(self) -> None:
        """A sequence fed its last prefill chunk: the next compression is forced."""
        self.uncompressed_prefill = True

    def stalled_victim(self):
        """When nothing could run this step (no decode, no chunk fits), the newest prefilling sequence to preempt
        so that older ones progress; None if only one sequence is running (it cannot fit even alone)."""
        if len(self.running) < 2:
            return None
        victim = max(self.running, key=lambda s: s.arrival)
        self.running.remove(victim)
        self.waiting.appendleft(victim)
        self.lock_prefill = False
        return victim

    def tick(self) -> None:
        """End of a decode step: every running sequence is one step further from its last compression."""
        for seq in self.running:
            if seq.prefill_remaining() == 0:
                seq.steps_since_compression += 1
