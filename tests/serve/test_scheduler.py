"""The engine's scheduler as pure logic: admission, compression triggers, prefill lock, preemption order."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvtrim.serve.scheduler import BlockGeometry, Scheduler, max_cache_tokens

GEO = BlockGeometry(layers=2, kv_heads=2, block_size=16)  # 4 tables: a 16-token prompt takes 4 blocks


@dataclass(eq=False)
class FakeSeq:
    arrival: int
    tokens: int = 16
    held: int = 0
    need: int = 0
    entries: int = 0
    steps_since_compression: int = 0
    compressed_since_prefill: bool = False
    remaining: int = 0  # prefill tokens still to feed while running (0: decoding)
    projected: int | None = None  # committed blocks (None: the uncompressed prompt + first token)

    def prefill_tokens(self) -> int:
        return self.tokens

    def prefill_remaining(self) -> int:
        return self.remaining

    def chunk_blocks_needed(self, tokens: int, last: bool) -> int:
        return GEO.blocks_for(tokens + int(last))

    def committed_blocks(self) -> int:
        proj = GEO.blocks_for(self.tokens + 1) if self.projected is None else self.projected
        return max(self.held, proj)

    def blocks_held(self) -> int:
        return self.held

    def decode_blocks_needed(self) -> int:
        return self.need

    def kv_entries(self) -> int:
        return self.entries


def make(num_blocks: int = 40, **kw) -> Scheduler:
    kw.setdefault("compress", True)
    return Scheduler(GEO, num_blocks, **kw)


def admit(s: Scheduler, num_free: int, decode_tokens: int = 0) -> tuple[list, list]:
    plan = s.schedule_prefill(num_free, decode_tokens)
    return plan.admitted, plan.impossible


def test_geometry_and_budget():
    assert GEO.blocks_for(16) == 4 and GEO.blocks_for(17) == 8 and GEO.blocks_for(0) == 0
    assert GEO.budget_blocks(128) == 32 and GEO.budget_blocks(129) == 33
    assert max_cache_tokens(1000, 8, 128, 16) == 128  # floor((125 - 1) / 16) * 16 = 112 < 128
    assert max_cache_tokens(4000, 8, 128, 16) == 496
    assert max_cache_tokens(4000, 2, 0, 16) == 1984


def test_admission_fcfs_by_free_blocks_and_first_token():
    s = make(num_blocks=40)
    a, b, c = FakeSeq(0, tokens=15), FakeSeq(1, tokens=16), FakeSeq(2, tokens=5)
    for q in (a, b, c):
        s.add(q)
    admitted, impossible = admit(s, num_free=12)
    # a: 15 + 1 tokens -> 4 blocks; b: 16 + 1 -> 8 blocks, exactly the 8 left; c must wait
    assert admitted == [a, b] and impossible == [] and list(s.waiting) == [c]
    assert not s.uncompressed_prefill  # set by prefill_done once the engine fed the last chunk
    assert admit(s, num_free=3) == ([], [])  # c needs 4


def test_admission_reserves_running_growth_and_max_batch():
    s = make(num_blocks=40, max_batch=2)
    r = FakeSeq(0, need=3)
    s.running.append(r)
    w1, w2 = FakeSeq(1, tokens=10), FakeSeq(2, tokens=10)
    s.add(w1)
    s.add(w2)
    assert admit(s, num_free=6) == ([], [])  # 4 blocks + 3 growth > 6
    assert admit(s, num_free=7) == ([w1], [])
    assert admit(s, num_free=100) == ([], [])  # max_batch reached
    assert list(s.waiting) == [w2]


def test_impossible_waiting_sequence_is_removed():
    s = make(num_blocks=8)
    big, small = FakeSeq(0, tokens=40), FakeSeq(1, tokens=4)
    s.add(big)
    s.add(small)
    admitted, impossible = admit(s, num_free=8)
    assert impossible == [big] and admitted == [small]


def test_compression_forced_after_prefill_without_lock():
    s = make(compression_interval=1000)
    s.add(FakeSeq(0, tokens=4))
    admit(s, num_free=40)
    s.prefill_done()
    plan = s.plan_compression(num_free=40)
    assert plan is not None and plan.after_prefill and not plan.memory_pressure
    assert not s.lock_prefill
    # nothing forces the next step and the interval is long: no compression
    assert s.plan_compression(num_free=40) is None


def test_pressure_compression_locks_prefill_until_finish_or_preempt():
    s = make(compression_interval=1000)
    r1, r2 = FakeSeq(0, need=4, held=10), FakeSeq(1, need=4, held=10)
    s.running += [r1, r2]
    plan = s.plan_compression(num_free=5)  # 8 needed > 5 free
    assert plan is not None and plan.memory_pressure and s.lock_prefill
    s.add(FakeSeq(2, tokens=1))
    assert admit(s, num_free=100) == ([], [])  # locked
    s.finish(r2)
    assert not s.lock_prefill
    assert len(admit(s, num_free=100)[0]) == 1
    # preemption unlocks too
    s.lock_prefill = True
    s.running[-1].need = 50
    assert s.preempt(num_free=10)
    assert not s.lock_prefill


def test_pressure_with_prefill_does_not_lock():
    s = make()
    s.running.append(FakeSeq(0, need=4))
    s.uncompressed_prefill = True
    plan = s.plan_compression(num_free=0)
    assert plan.after_prefill and plan.memory_pressure and not s.lock_prefill


def test_interval_and_no_compression_mode():
    s = make(compression_interval=3)
    s.running.append(FakeSeq(0))
    assert [s.plan_compression(40) is not None for _ in range(6)] == [False, False, True, False, False, True]
    off = make(compress=False)
    off.running.append(FakeSeq(0, need=99))
    off.uncompressed_prefill = True
    assert off.plan_compression(0) is None and not off.lock_prefill and not off.uncompressed_prefill


def test_candidates_ordered_by_staleness_and_capped():
    s = make(max_kv_per_compression=250)
    a = FakeSeq(0, entries=100, steps_since_compression=1)
    b = FakeSeq(1, entries=100, steps_since_compression=5)
    c = FakeSeq(2, entries=100, steps_since_compression=3)
    s.running += [a, b, c]
    plan = s.plan_compression(40)
    assert plan.sequences == [b, c]  # a would exceed the 250-entry cap
    # at least one is always taken
    s2 = make(max_kv_per_compression=10)
    s2.running.append(FakeSeq(0, entries=100))
    assert len(s2.plan_compression(40).sequences) == 1


def test_compress_once_skips_compressed_sequences():
    s = make(compress_once=True)
    a, b = FakeSeq(0), FakeSeq(1)
    s.running += [a, b]
    s.mark_compressed(a)
    assert s.plan_compression(40).sequences == [b]
    s.tick()
    assert a.steps_since_compression == 1 and b.steps_since_compression == 1


def test_preempt_newest_first_and_requeue_in_arrival_order():
    s = make(num_blocks=100)
    old, mid, new = FakeSeq(0, need=4, held=8), FakeSeq(1, need=4, held=8), FakeSeq(2, need=4, held=6)
    s.running += [mid, new, old]
    waiting = FakeSeq(3)
    s.add(waiting)
    # need 12, free 0: evicting new (6 free < 8 needed) then mid (14 free >= 4 needed) suffices
    victims = s.preempt(num_free=0)
    assert victims == [new, mid]
    assert s.running == [old]
    assert list(s.waiting) == [mid, new, waiting]


def test_preempt_spares_sequence_that_could_never_be_recomputed():
    s = make(num_blocks=20)
    old = FakeSeq(0, need=4, held=4, tokens=10)
    huge = FakeSeq(1, need=4, held=16, tokens=200)  # recompute needs more than the pool
    s.running += [old, huge]
    assert s.preempt(num_free=4) == [old]


def test_preempt_nothing_when_it_fits():
    s = make()
    s.running.append(FakeSeq(0, need=4))
    assert s.preempt(num_free=4) == []


def test_finish_removes_from_waiting():
    s = make()
    q = FakeSeq(0)
    s.add(q)
    s.finish(q)
    assert not s.has_work


def test_bad_arguments():
    with pytest.raises(ValueError):
        make(compression_interval=0)
    with pytest.raises(ValueError):
        make(max_batch=0)


def test_chunks_share_the_token_budget_with_decodes_one_chunk_per_sequence():
    s = make(num_blocks=1000, prefill_chunk=64, max_num_batched_tokens=100)
    dec = FakeSeq(0)
    s.running.append(dec)  # decoding (remaining 0)
    long, short = FakeSeq(1, tokens=300), FakeSeq(2, tokens=30)
    s.add(long)
    s.add(short)
    plan = s.schedule_prefill(num_free=1000, decode_tokens=50)
    # 50 tokens left: the 64-token chunk still goes (one chunk is always allowed), the next one does not fit
    assert plan.chunks == [(long, 64)] and plan.admitted == [long] and list(s.waiting) == [short]
    long.remaining, long.held = 236, 4 * 4
    plan = s.schedule_prefill(num_free=1000, decode_tokens=10)
    assert plan.chunks == [(long, 64)]  # running prefills first; the short one's 30 tokens exceed 90 - 64
    plan = s.schedule_prefill(num_free=1000, decode_tokens=0)
    assert plan.chunks == [(long, 64), (short, 30)]
    assert s.prefilling() == [long] and s.decoding() == [dec, short]
    long.remaining = 44
    s.prefill_done()
    assert s.uncompressed_prefill


def test_prefilling_sequence_blocked_by_memory_blocks_younger_ones():
    s = make(num_blocks=1000, prefill_chunk=64)
    old = FakeSeq(0, tokens=300, remaining=200, held=4)
    s.running.append(old)
    s.add(FakeSeq(1, tokens=4))
    plan = s.schedule_prefill(num_free=10)  # old's chunk needs 16 blocks
    assert plan.chunks == [] and len(s.waiting) == 1


def test_admission_counts_projected_compressed_size():
    # Uncompressed, each 100-token request needs 7 * 4 = 28 blocks; compressed it is projected at 8.
    s = make(num_blocks=48)
    for i in range(5):
        s.add(FakeSeq(i, tokens=100, projected=8))
    admitted, _ = admit(s, num_free=48)
    assert len(admitted) == 1  # the next one's 28-block chunk is not free now
    for r in s.running:
        r.held, r.remaining = 8, 0  # compressed to its projection
    admitted, _ = admit(s, num_free=40)
    assert len(admitted) == 1  # committed 8 + 8 + its 28-block chunk = 44 <= 48
    for r in s.running:
        r.held = 8
    # 16 + 8 + 28 > 48: no room for another uncompressed chunk although 32 blocks are free
    assert admit(s, num_free=32) == ([], [])
    plain = make(num_blocks=40)
    for i in range(3):
        plain.add(FakeSeq(i, tokens=10))  # 4 blocks each, projected = uncompressed
    plain.running.append(FakeSeq(9, tokens=100, held=33))
    assert admit(plain, num_free=40) == ([], [])  # 33 committed + 4 + 4 > 40 although 40 are "free"


def test_stalled_prefills_preempt_the_newest():
    s = make(num_blocks=100)
    a, b = FakeSeq(0, remaining=5, held=4), FakeSeq(1, remaining=5, held=4)
    s.running += [a, b]
    assert s.stalled_victim() is b and s.running == [a] and list(s.waiting) == [b]
    assert s.stalled_victim() is None  # alone: nothing to make room for


def test_budget_arguments():
    with pytest.raises(ValueError, match="prefill_chunk"):
        make(prefill_chunk=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make(max_num_batched_tokens=True)
