"""Paged per-head storage: pool accounting, attention through block tables, metrics, exactness on a model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

from conftest import tiny_model
from kvtrim.cache.paged import BlockPool, OutOfBlocks, PagedBatchCache, PagedSequence
from kvtrim.errors import InvalidParameterError
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.scoring.squared_attention import squared_attention
from kvtrim.selection.block_eviction import apply_evictions, prefill_metric, schedule_evictions

torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------------------- pool
def test_pool_allocate_free_accounting():
    pool = BlockPool(10, 4, 8, torch.float32)
    assert pool.num_free == 10 and pool.nbytes() == 10 * pool.block_nbytes() == 10 * 2 * 4 * 8 * 4
    a = pool.allocate(3)
    b = pool.allocate(7)
    assert len(set(a) | set(b)) == 10 and pool.num_free == 0
    assert pool.used_nbytes() == pool.nbytes()
    pool.free(a)
    assert pool.num_free == 3 and pool.used_nbytes() == 7 * pool.block_nbytes()
    assert pool.allocate(0) == []


def test_pool_out_of_blocks_and_double_free_leave_pool_unchanged():
    pool = BlockPool(5, 4, 8, torch.float32)
    held = pool.allocate(4)
    with pytest.raises(OutOfBlocks, match="requested 2 KV blocks but only 1"):
        pool.allocate(2)
    assert pool.num_free == 1
    pool.free(held[:2])
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([held[2], held[0]])  # held[0] is already free: nothing is freed
    assert pool.num_free == 3 and pool.is_allocated(held[2])
    with pytest.raises(ValueError, match="twice"):
        pool.free([held[2], held[2]])
    assert pool.num_free == 3
    with pytest.raises(InvalidParameterError):
        pool.allocate(-1)


def test_pool_free_is_proportional_to_blocks_not_pool_size():
    import time

    big = BlockPool(200_000, 1, 1, torch.float32)
    ids = big.allocate(100_000)
    t = time.perf_counter()
    for _ in range(200):
        big.free(big.allocate(4))
    per_op = (time.perf_counter() - t) / 200
    assert per_op < 5e-3  # a scan over the pool would take far longer
    assert big.num_free == 100_000
    big.free(ids)


def test_pool_for_bytes_and_errors():
    pool = BlockPool.for_bytes(10_000, 16, 8, torch.float16)
    assert pool.num_blocks == 10_000 // (2 * 16 * 8 * 2)
    with pytest.raises(InvalidParameterError, match="kv_bytes"):
        BlockPool.for_bytes(10, 16, 8, torch.float16)
    with pytest.raises(InvalidParameterError, match="block_size"):
        BlockPool(4, 0, 8, torch.float32)


# ---------------------------------------------------------------------------------------------------- attention
def _config(layers=2, heads=4, kv_heads=2, head_dim=8):
    return SimpleNamespace(
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=heads * head_dim,
    )


def _forward(cache: PagedBatchCache, q_len: int, g: torch.Generator, positions=None):
    """Run one 'forward' through every layer of ``cache`` with random q/k/v; returns per layer (q, k, v, out)."""
    n, heads, kv, d = len(cache.sequences), 4, cache.kv_heads, cache.head_dim
    outs = []
    for layer in cache.layers:
        q = torch.randn(n, heads, q_len, d, generator=g)
        k = torch.randn(n, kv, q_len, d, generator=g)
        v = torch.randn(n, kv, q_len, d, generator=g)
        cache.update(k, v, layer.layer_idx)
        outs.append((q, k, v, layer.attend(None, q, positions, None, d**-0.5)))
    return outs


def _dense_reference(seq: PagedSequence, layer: int, query: torch.Tensor, qpos: torch.Tensor) -> torch.Tensor:
    """Attention of ``query`` [q_heads, q, d] over the sequence's stored entries of ``layer``, head by head."""
    g = seq.gather()
    hq, tq, d = query.shape
    group = hq // seq.kv_heads
    out = torch.zeros(tq, hq, d, dtype=torch.float64)
    for h in range(hq):
        kv = h // group
        ok = g["valid"][layer, kv]
        k, v, p = g["keys"][layer, kv][ok].double(), g["values"][layer, kv][ok].double(), g["positions"][layer, kv][ok]
        logits = query[h].double() @ k.T * d**-0.5
        logits = logits.masked_fill(p[None, :] > qpos[:, None], float("-inf"))
        out[:, h] = torch.softmax(logits, -1) @ v
    return out


def _uneven_sequences(pool, cfg, g, lengths=(21, 40, 7)):
    """Prefilled sequences with random per-(layer, head) evictions, so every head holds its own count."""
    seqs = []
    for t in lengths:
        seq = PagedSequence(pool, cfg.num_hidden_layers, cfg.num_key_value_heads)
        _forward(PagedBatchCache(cfg, pool, [seq]), t, g)
        plan = schedule_evictions(seq, blocks_to_evict=0, protected_window=0)
        for r in range(seq.num_rows):
            n = int(seq.row_lengths()[r])
            k = int(torch.randint(0, n - 1, (1,), generator=g))
            plan.evicted[r] = torch.randperm(n - 1, generator=g)[:k].sort().values  # the newest entry survives
        apply_evictions(seq, plan)
        seqs.append(seq)
    return seqs


def test_paged_prefill_attention_equals_dense_causal():
    cfg, g = _config(), torch.Generator().manual_seed(0)
    pool = BlockPool(64, 4, cfg.head_dim, torch.float32)
    seq = PagedSequence(pool, cfg.num_hidden_layers, cfg.num_key_value_heads)
    outs = _forward(PagedBatchCache(cfg, pool, [seq]), 11, g)
    assert seq.seen == 11 and bool((seq.lengths() == 11).all())
    for layer, (q, _, _, out) in enumerate(outs):
        ref = _dense_reference(seq, layer, q[0], torch.arange(11))
        torch.testing.assert_close(out[0].double(), ref, atol=1e-5, rtol=1e-5)


def test_batched_decode_with_different_per_head_lengths_equals_dense():
    cfg, g = _config(), torch.Generator().manual_seed(1)
    pool = BlockPool(200, 4, cfg.head_dim, torch.float32)
    seqs = _uneven_sequences(pool, cfg, g)
    lengths = torch.stack([s.lengths() for s in seqs])
    assert len(set(lengths.flatten().tolist())) > 3  # heads and sequences really differ
    for accumulate in (False, True):
        positions = torch.tensor([[s.seen] for s in seqs])
        cache = PagedBatchCache(cfg, pool, seqs, accumulate_decode_metric=accumulate)
        outs = _forward(cache, 1, g, positions)
        for layer, (q, _, _, out) in enumerate(outs):
            for i, s in enumerate(seqs):
                ref = _dense_reference(s, layer, q[i], positions[i])
                torch.testing.assert_close(out[i].double(), ref, atol=1e-5, rtol=1e-5)
    assert [s.seen for s in seqs] == [23, 42, 9]


def test_decode_metric_accumulates_group_sum_of_squared_attention():
    cfg, g = _config(layers=1), torch.Generator().manual_seed(2)
    pool = BlockPool(50, 4, cfg.head_dim, torch.float32)
    seqs = _uneven_sequences(pool, cfg, g, lengths=(9, 14))
    before = [s.gather() for s in seqs]
    positions = torch.tensor([[s.seen] for s in seqs])
    cache = PagedBatchCache(cfg, pool, seqs, accumulate_decode_metric=True, buffer=3)
    ((q, _, _, _),) = _forward(cache, 1, g, positions)
    d = cfg.head_dim
    for i, s in enumerate(seqs):
        after = s.gather()
        for kv in range(cfg.num_key_value_heads):
            ok = after["valid"][0, kv]
            k, p = after["keys"][0, kv][ok], after["positions"][0, kv][ok]
            probs = torch.softmax(q[i, 2 * kv : 2 * kv + 2, 0] @ k.T * d**-0.5, -1)  # [group, n]
            expected = probs.square().sum(0) * (p <= positions[i, 0] - 3)
            old = torch.cat([before[i]["metric"][0, kv][before[i]["valid"][0, kv]], torch.zeros(1)])
            torch.testing.assert_close(after["metric"][0, kv][ok], old + expected, atol=1e-6, rtol=1e-5)


def test_observe_window_and_prefill_metric_match_squared_attention():
    cfg, g = _config(), torch.Generator().manual_seed(3)
    pool = BlockPool(64, 4, cfg.head_dim, torch.float32)
    seq = PagedSequence(pool, cfg.num_hidden_layers, cfg.num_key_value_heads)
    cache = PagedBatchCache(cfg, pool, [seq], observe_window=5)
    outs = _forward(cache, 13, g)
    for kernel, buffer in ((7, 0), (1, 2)):
        pool.metric.zero_()  # the metric adds to what is stored (chunked prefill accumulates chunk windows)
        prefill_metric(cache, kernel=kernel, buffer=buffer)
        data = seq.gather()
        for layer, (q, k, _, _) in enumerate(outs):
            ref = squared_attention(
                q[:, :, -5:],
                torch.arange(8, 13)[None],
                k,
                torch.arange(13).expand(1, 2, 13),
                cfg.head_dim**-0.5,
                kernel=kernel,
                buffer=buffer,
            )[0]
            torch.testing.assert_close(data["metric"][layer][:, :13], ref, atol=1e-6, rtol=1e-5)
    once = seq.gather()["metric"].clone()
    prefill_metric(cache, kernel=1, buffer=2)
    torch.testing.assert_close(seq.gather()["metric"], 2 * once)  # a second window adds to the first
    with pytest.raises(InvalidParameterError, match="observe_window"):
        prefill_metric(PagedBatchCache(cfg, pool, [seq]))


def test_out_of_blocks_before_anything_is_written():
    cfg, g = _config(), torch.Generator().manual_seed(4)
    pool = BlockPool(9, 4, cfg.head_dim, torch.float32)
    seq = PagedSequence(pool, cfg.num_hidden_layers, cfg.num_key_value_heads)
    _forward(PagedBatchCache(cfg, pool, [seq]), 8, g)  # 2 blocks per row, 4 rows: 8 blocks
    assert pool.num_free == 1 and seq.blocks_needed(1) == 4
    other = PagedSequence(pool, cfg.num_hidden_layers, cfg.num_key_value_heads)
    with pytest.raises(OutOfBlocks):
        _forward(PagedBatchCache(cfg, pool, [seq, other]), 1, g, torch.tensor([[8], [0]]))
    assert pool.num_free == 1 and seq.seen == 8 and bool((seq.lengths() == 8).all()) and other.blocks_held() == 0
    seq.release()
    assert pool.num_free == 9 and seq.entries() == 0 and seq.seen == 0


def test_bad_batches_are_rejected():
    cfg = _config()
    pool = BlockPool(8, 4, cfg.head_dim, torch.float32)
    seq = PagedSequence(pool, 2, 2)
    with pytest.raises(InvalidParameterError, match="head_dim"):
        PagedBatchCache(_config(head_dim=16), pool, [seq])
    with pytest.raises(InvalidParameterError, match="twice"):
        PagedBatchCache(cfg, pool, [seq, seq])
    with pytest.raises(InvalidParameterError, match="num_layers"):
        PagedBatchCache(cfg, pool, [PagedSequence(pool, 3, 2)])
    with pytest.raises(InvalidParameterError, match="position_ids"):
        _forward(PagedBatchCache(cfg, pool, [seq]), 1, torch.Generator(), torch.tensor([[5]]))


# ---------------------------------------------------------------------------------------------------- on a model
def _greedy_dynamic(model, ids: list[int], steps: int) -> list[int]:
    cache, out = DynamicCache(config=model.config), []
    logits = model(torch.tensor([ids]), past_key_values=cache, use_cache=True).logits
    for _ in range(steps):
        out.append(int(logits[0, -1].argmax()))
        logits = model(torch.tensor([[out[-1]]]), past_key_values=cache, use_cache=True).logits
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_paged_batched_generation_matches_dynamic_cache(family):
    model = tiny_model(family)
    cfg = model.config
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (23, 40, 9)]
    steps = 12
    with torch.no_grad():
        expected = [_greedy_dynamic(model, p, steps) for p in prompts]
        pool = BlockPool(400, 16, cfg.hidden_size // cfg.num_attention_heads, model.dtype)
        seqs, last = [], []
        with kvtrim_attention_enabled(model):
            for p in prompts:  # prefill one at a time, then decode all together
                seq = PagedSequence(pool, cfg.num_hidden_layers, cfg.num_key_value_heads)
                cache = PagedBatchCache(cfg, pool, [seq], observe_window=8)
                logits = model(torch.tensor([p]), past_key_values=cache, use_cache=True).logits
                prefill_metric(cache)
                seqs.append(seq)
                last.append(int(logits[0, -1].argmax()))
            got = [[t] for t in last]
            for _ in range(steps - 1):
                cache = PagedBatchCache(cfg, pool, seqs, accumulate_decode_metric=True)
                logits = model(
                    torch.tensor([[o[-1]] for o in got]),
                    past_key_values=cache,
                    position_ids=torch.tensor([[s.seen] for s in seqs]),
                    use_cache=True,
                ).logits
                for o, row in zip(got, logits[:, -1], strict=True):
                    o.append(int(row.argmax()))
    assert got == expected
    assert [s.seen for s in seqs] == [len(p) + steps - 1 for p in prompts]


def test_bytes_held_within_one_partial_block_per_head():
    cfg, g = _config(), torch.Generator().manual_seed(6)
    pool = BlockPool(200, 4, cfg.head_dim, torch.float32)
    for seq in _uneven_sequences(pool, cfg, g, lengths=(30, 17)):
        slack = seq.held_nbytes() - seq.kv_nbytes()
        assert 0 <= slack <= seq.num_rows * (pool.block_size - 1) * 2 * cfg.head_dim * 4
        assert seq.kv_nbytes() == seq.entries() * 2 * cfg.head_dim * 4
    assert pool.used_nbytes() == sum(pool.block_nbytes() for _ in range(pool.num_used))


# ---------------------------------------------------------------------------------------------------- packed prefill
def _paged_model_forward(model, pool, seqs, chunks, window, packed: bool):
    """Feed ``chunks[i]`` (token lists) to ``seqs[i]``: one packed forward, or one forward per sequence.
    Returns each chunk's last-token logits ``[k, vocab]`` (the metric of the recorded window is added)."""
    cfg = model.config
    if not packed:
        rows = []
        for s, c in zip(seqs, chunks, strict=True):
            cache = PagedBatchCache(cfg, pool, [s], observe_window=min(window, len(c)))
            pos = torch.arange(s.seen, s.seen + len(c))[None]
            rows.append(
                model(torch.tensor([c]), position_ids=pos, past_key_values=cache, logits_to_keep=1).logits[0, -1]
            )
            prefill_metric(cache)
        return torch.stack(rows)
    lengths = [len(c) for c in chunks]
    cache = PagedBatchCache(cfg, pool, seqs, observe_window=min(window, max(lengths)), chunk_lengths=lengths)
    ids = torch.tensor([[t for c in chunks for t in c]])
    pos = torch.tensor([[s.seen + j for s, c in zip(seqs, chunks, strict=True) for j in range(len(c))]])
    last = torch.tensor(lengths).cumsum(0) - 1
    out = model(ids, position_ids=pos, past_key_values=cache, logits_to_keep=last).logits[0]
    prefill_metric(cache)
    return out


def test_packed_prefill_of_unequal_chunks_equals_one_forward_per_sequence():
    model = tiny_model("llama", layers=2, heads=4, kv_heads=2)
    cfg, g = model.config, torch.Generator().manual_seed(5)
    first = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (5, 17, 11)]
    second = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (9, 2, 23)]
    results = {}
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        for packed in (False, True):
            pool = BlockPool(200, 4, cfg.hidden_size // cfg.num_attention_heads, torch.float32)
            seqs = [PagedSequence(pool, cfg.num_hidden_layers, cfg.num_key_value_heads) for _ in range(3)]
            # a fresh packed prefill, an eviction so that heads differ, then a packed chunk on top of the entries
            a = _paged_model_forward(model, pool, seqs, first, 8, packed)
            for s in seqs:
                plan = schedule_evictions(s, blocks_to_evict=2, protected_window=2)
                apply_evictions(s, plan)
            b = _paged_model_forward(model, pool, seqs, second, 8, packed)
            results[packed] = (a, b, [s.gather() for s in seqs], [s.seen for s in seqs])
    (a0, b0, g0, s0), (a1, b1, g1, s1) = results[False], results[True]
    torch.testing.assert_close(a1, a0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b1, b0, atol=1e-5, rtol=1e-5)
    assert s0 == s1 == [14, 19, 34]
    for x, y in zip(g0, g1, strict=True):
        assert torch.equal(x["positions"], y["positions"]) and torch.equal(x["valid"], y["valid"])
        ok = x["valid"]  # slots beyond a row's length hold stale data
        torch.testing.assert_close(y["keys"][ok], x["keys"][ok], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(y["metric"][ok], x["metric"][ok], atol=1e-5, rtol=1e-5)  # the window metric too
        assert bool((x["metric"][ok] > 0).any())


def test_packed_prefill_rejects_bad_chunk_lengths():
    cfg = _config()
    pool = BlockPool(50, 4, cfg.head_dim, torch.float32)
    seqs = [PagedSequence(pool, cfg.num_hidden_layers, cfg.num_key_value_heads) for _ in range(2)]
    with pytest.raises(InvalidParameterError, match="chunk_lengths"):
        PagedBatchCache(cfg, pool, seqs, chunk_lengths=[3])
    with pytest.raises(InvalidParameterError, match="chunk_lengths"):
        PagedBatchCache(cfg, pool, seqs, chunk_lengths=[3, 0])
    cache = PagedBatchCache(cfg, pool, seqs, chunk_lengths=[3, 4])
    with pytest.raises(InvalidParameterError, match="packed prefill"):
        cache.update(torch.zeros(1, 2, 6, 8), torch.zeros(1, 2, 6, 8), 0)
    assert pool.num_free == 50


def test_scratch_block_is_outside_the_pool_and_bucketed_decode_needs_it():
    pool = BlockPool(4, 2, 8, torch.float32, scratch=True)
    assert pool.scratch_block == 4 and pool.keys.shape[0] == 5 and pool.num_free == 4
    assert sorted(pool.allocate(4)) == [0, 1, 2, 3] and pool.num_free == 0  # the scratch block is never handed out
    cfg = _config()
    plain = BlockPool(8, 2, cfg.head_dim, torch.float32)
    with pytest.raises(InvalidParameterError, match="scratch=True"):
        PagedBatchCache(
            cfg, plain, [PagedSequence(plain, cfg.num_hidden_layers, cfg.num_key_value_heads)], bucketed=True
        )
