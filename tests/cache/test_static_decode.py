"""The static decode step (kvtrim.cache.static_decode): host preparation into static buffers, then a forward that reads
only them, equals the eager paged decode step: same outputs, same stored entries, same decode metric."""

from __future__ import annotations

import pytest
import torch
from test_paged import _config, _uneven_sequences

from kvtrim.cache.paged import BlockPool, OutOfBlocks, PagedBatchCache
from kvtrim.cache.static_decode import StaticDecodeCache, batch_bucket, reserve_decode_step, width_bucket
from kvtrim.errors import InvalidParameterError


def _setup(seed: int = 4):
    cfg, g = _config(), torch.Generator().manual_seed(seed)
    pool = BlockPool(200, 4, cfg.head_dim, torch.float32, scratch=True)
    return cfg, pool, _uneven_sequences(pool, cfg, g)


def _step(cache: PagedBatchCache, rows: int, qkv: list, positions: torch.Tensor | None) -> list[torch.Tensor]:
    outs = []
    for layer, (q, k, v) in zip(cache.layers, qkv, strict=True):
        cache.update(k[:rows], v[:rows], layer.layer_idx)
        outs.append(layer.attend(None, q[:rows], positions, None, q.shape[-1] ** -0.5))
    return outs


@pytest.mark.parametrize("accumulate", [False, True])
def test_static_step_equals_the_eager_step(accumulate):
    (cfg, pool, seqs), (_, pool2, seqs2) = _setup(), _setup()  # two identical pools
    g = torch.Generator().manual_seed(9)
    b, d = batch_bucket(len(seqs)), cfg.head_dim
    qkv = [tuple(torch.randn(b, h, 1, d, generator=g) for h in (4, 2, 2)) for _ in range(cfg.num_hidden_layers)]
    eager = PagedBatchCache(cfg, pool2, seqs2, accumulate_decode_metric=accumulate)
    ref = _step(eager, len(seqs), qkv, torch.tensor([[s.seen] for s in seqs2]))

    slots, width = reserve_decode_step(seqs)
    assert width == width_bucket(max(int(s._nblocks.max()) for s in seqs)) and width & (width - 1) == 0
    cache = StaticDecodeCache(cfg, pool, seqs, batch=b, width=width, accumulate_decode_metric=accumulate)
    cache.load(seqs, slots, [5, 6, 7])
    assert cache.input_ids.flatten().tolist() == [5, 6, 7, 0] and cache.position_ids.flatten().tolist()[3] == 0
    out = _step(cache, b, qkv, cache.position_ids)
    for o, r in zip(out, ref, strict=True):
        torch.testing.assert_close(o[: len(seqs)], r, atol=1e-6, rtol=1e-6)
    real = slice(0, pool.num_blocks)
    for name in ("keys", "values", "positions", "metric"):
        torch.testing.assert_close(getattr(pool, name)[real], getattr(pool2, name)[real], atol=1e-6, rtol=1e-6)
    assert [s.seen for s in seqs] == [s.seen for s in seqs2]
    for s, s2 in zip(seqs, seqs2, strict=True):
        assert torch.equal(s.lengths(), s2.lengths()) and s.tables == s2.tables


def test_reserve_out_of_blocks_changes_nothing_and_bad_loads_are_rejected():
    cfg, pool, seqs = _setup()
    pool.allocate(pool.num_free)  # nothing left for the new token's blocks
    before = [(s.tables, s.lengths(), s.seen) for s in seqs]
    with pytest.raises(OutOfBlocks):
        reserve_decode_step(seqs)
    after = [(s.tables, s.lengths(), s.seen) for s in seqs]
    assert all(a[0] == b[0] and torch.equal(a[1], b[1]) and a[2] == b[2] for a, b in zip(before, after, strict=True))
    with pytest.raises(InvalidParameterError, match="batch must be a batch bucket"):
        StaticDecodeCache(cfg, pool, seqs, batch=3, width=8)
    with pytest.raises(InvalidParameterError, match="width must be a power of two"):
        StaticDecodeCache(cfg, pool, seqs, batch=4, width=6)
    cache = StaticDecodeCache(cfg, pool, seqs, batch=4, width=1)
    with pytest.raises(InvalidParameterError, match="do not fit width 1"):
        cache.load(seqs, torch.tensor([s.slot for s in seqs]), [1, 2, 3])
    with pytest.raises(InvalidParameterError, match="one token and one slot each"):
        cache.load(seqs, torch.tensor([s.slot for s in seqs]), [1, 2])
    plain_pool = BlockPool(200, 4, cfg.head_dim, torch.float32)
    plain_seqs = _uneven_sequences(plain_pool, cfg, torch.Generator().manual_seed(1), lengths=(5,))
    with pytest.raises(InvalidParameterError, match="scratch"):
        StaticDecodeCache(cfg, plain_pool, plain_seqs, batch=1, width=2)
    with pytest.raises(InvalidParameterError, match="scratch"):
        reserve_decode_step(plain_seqs)
