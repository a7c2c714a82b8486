"""QuantizedBlockPool on hand-made tensors: bytes measured from the tensors, round-trip error, moves, sizing by
bytes, paged attention and MoveCache over packed entries, and the errors for bad formats and kernels."""

from __future__ import annotations

import pytest
import torch

from kvtrim.cache.block_pool import BlockPool
from kvtrim.cache.paged import PagedSequence
from kvtrim.cache.paged_kernels import choose_decode_kernel
from kvtrim.cache.quant import KVQuant, rotate, rotation
from kvtrim.cache.quantized_block_pool import QuantizedBlockPool, packed_entry_bytes, pool_kv_quant
from kvtrim.errors import InvalidParameterError
from kvtrim.selection.block_eviction import compress_sequences


def _storage_bytes(pool: QuantizedBlockPool) -> int:
    parts = (pool.key_codes, pool.value_codes, pool.key_scale, pool.key_zero, pool.value_scale, pool.value_zero)
    return sum(t.untyped_storage().nbytes() for t in parts)


@pytest.mark.parametrize(("fmt", "codes"), [("int8", 64), ("int4", 32)])
def test_bytes_are_blocks_times_packed_entries_plus_scales(fmt, codes):
    pool = QuantizedBlockPool(12, 16, 64, torch.float32, fmt)
    per_entry = 2 * codes + 2 * 2 * 2  # K and V codes + (scale, zero) float16 for K and for V
    assert pool.entry_nbytes() == per_entry == packed_entry_bytes(pool.quant, 64)
    assert pool.block_nbytes() == 16 * per_entry
    assert pool.nbytes() == _storage_bytes(pool) == 12 * 16 * per_entry
    assert pool.key_codes.shape == (12, 16, codes) and pool.key_scale.shape == (12, 16, 1)
    plain = BlockPool(12, 16, 64, torch.float16)
    assert plain.nbytes() / pool.nbytes() == pytest.approx(256 / per_entry)  # 1.88x (int8), 3.56x (int4)


def test_value_groups_add_scales_per_group():
    fmt = KVQuant("int4", residual=0, value_group=16, sink=0, rotate=False)
    pool = QuantizedBlockPool(3, 4, 64, torch.float32, fmt)
    assert pool.key_scale.shape == (3, 4, 4)
    assert pool.entry_nbytes() == 2 * 32 + 2 * 2 * 4 * 2 == pool.nbytes() // 12


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_for_bytes_counts_packed_bytes(fmt):
    per_block = 16 * packed_entry_bytes(KVQuant(fmt), 64)
    pool = QuantizedBlockPool.for_bytes(10 * per_block + per_block - 1, 16, 64, torch.float32, fmt, scratch=True)
    assert pool.num_blocks == 10 and pool.scratch_block == 10
    plain = BlockPool.for_bytes(1 << 20, 16, 64, torch.float32)
    quant = QuantizedBlockPool.for_bytes(1 << 20, 16, 64, torch.float32, fmt)
    assert quant.num_blocks == (1 << 20) // per_block and quant.num_blocks > 3 * plain.num_blocks
    with pytest.raises(InvalidParameterError, match="kv_bytes"):
        QuantizedBlockPool.for_bytes(per_block - 1, 16, 64, torch.float32, fmt)


@pytest.mark.parametrize(("fmt", "steps"), [("int8", 255), ("int4:rotate=0", 15), ("int4", 15)])
def test_write_read_within_half_a_step_and_moves_keep_codes(fmt, steps):
    g = torch.Generator().manual_seed(0)
    pool = QuantizedBlockPool(4, 4, 8, torch.float32, fmt)
    slot = torch.tensor([0, 3, 9, 15])
    keys, values = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g) * 3
    pool.write(slot, keys, values)
    for got, want in ((pool.read_keys(slot), keys), (pool.read_values(slot), values)):
        # one scale per token (per-token keys too), over the entry as quantized: rotated when the pool rotates
        got, want = rotate(got, pool.quant), rotate(want, pool.quant)
        step = (want.amax(-1) - want.amin(-1)) / steps
        assert bool(((got - want).abs() <= step[:, None] / 2 + 1e-3 * want.abs().amax()).all())
    before = pool.read_keys(slot[2:3]).clone()
    pool.positions.view(-1)[9] = 42
    pool.move(torch.tensor([1]), torch.tensor([9]))
    assert torch.equal(pool.read_keys(torch.tensor([1])), before)  # codes and scales moved unchanged
    assert int(pool.positions.view(-1)[1]) == 42
    assert pool.read_keys(slot.view(2, 2)).shape == (2, 2, 8)


def test_bad_kv_quant_and_window_are_refused():
    with pytest.raises(InvalidParameterError, match="kv_quant must be one of"):
        QuantizedBlockPool(4, 4, 8, torch.float32, "int3")
    with pytest.raises(InvalidParameterError, match="residual must be 0"):
        QuantizedBlockPool(4, 4, 8, torch.float32, KVQuant("int8", residual=4))
    # int4's default window is the dense and ragged stores': a pool reads the name as residual=0 and refuses a
    # window asked for, by spec or by a KVQuant left at the default
    assert QuantizedBlockPool(4, 4, 8, torch.float32, "int4").quant == KVQuant("int4", residual=0, sink=0, rotate=True)
    assert pool_kv_quant("int4:group_size=64") == KVQuant("int4", group_size=64, residual=0, sink=0, rotate=True)
    for windowed in ("int4:residual=32", KVQuant("int4")):
        with pytest.raises(InvalidParameterError, match=r"residual must be 0, got 32 \(pass 'int4' or KVQuant"):
            QuantizedBlockPool(4, 4, 8, torch.float32, windowed)
    # the same for a sink (full-precision oldest entries): asked for by spec or by a KVQuant, it is refused
    for sunk in ("int4:sink=1", KVQuant("int4", residual=0, sink=1)):
        with pytest.raises(InvalidParameterError, match=r"sink must be 0, got 1 \(pass 'int4' or KVQuant"):
            QuantizedBlockPool(4, 4, 8, torch.float32, sunk)
    with pytest.raises(InvalidParameterError, match="head_dim must be even"):
        QuantizedBlockPool(4, 4, 7, torch.float32, "int4")
    with pytest.raises(AttributeError, match="read_keys"):
        QuantizedBlockPool(4, 4, 8, torch.float32, "int8").keys  # noqa: B018


def test_block_table_kernels_refuse_kv_quant(monkeypatch):
    """The flash-attention kernels read unquantized blocks; the fused dequantizing Triton kernel needs CUDA (or
    Triton's interpreter, off here): a CPU pool decodes on the gather path (tests/cache/test_triton_paged_quant.py
    runs the kernel)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = dict(device="cpu", dtype=torch.float16, block_size=16, head_dim=64, kv_quant="int8")
    for name in ("flash", "triton"):
        with pytest.raises(InvalidParameterError, match=f"decode_kernel='{name}' cannot be used with kv_quant='int8'"):
            choose_decode_kernel(name, **args)
    auto = choose_decode_kernel("auto", **args)
    refused = dict(auto.refused)
    assert auto.kernel is None and all("kv_quant='int8'" in refused[n] for n in ("vllm_flash_attn", "flash_attn"))
    assert "triton_quant" in refused
    assert choose_decode_kernel("gather", **args).kernel is None


def _fill(pool, seq: PagedSequence, lengths: list[int], g: torch.Generator) -> None:
    """Rows of ``lengths`` entries with random keys/values, positions 0.., random metrics."""
    bs, d = pool.block_size, pool.head_dim
    for row, n in enumerate(lengths):
        blocks = pool.allocate(-(-n // bs))
        seq.set_row(row, blocks, n)
        slot = (torch.tensor(blocks)[:, None] * bs + torch.arange(bs)).reshape(-1)[:n]
        pool.write(slot, torch.randn(n, d, generator=g), torch.randn(n, d, generator=g))
        pool.positions.view(-1)[slot] = torch.arange(n)
        pool.metric.view(-1)[slot] = torch.rand(n, generator=g)
    seq.seen = max(lengths)


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_compression_moves_packed_entries_like_the_plain_pool(fmt):
    """The same metrics evict the same entries; survivors carry their codes unchanged (compared dequantized)."""
    lengths = [23, 17, 30, 9]
    pools = [BlockPool(40, 4, 8, torch.float32), QuantizedBlockPool(40, 4, 8, torch.float32, fmt)]
    seqs = []
    for pool in pools:
        seq = PagedSequence(pool, 2, 2)
        _fill(pool, seq, lengths, torch.Generator().manual_seed(1))
        seqs.append(seq)
    dense_before = seqs[1].gather()
    by_pos = {
        (r, int(p)): dense_before["keys"].reshape(4, -1, 8)[r, i]
        for r in range(4)
        for i, p in enumerate(dense_before["positions"].reshape(4, -1)[r].tolist())
        if p >= 0
    }
    freed = [compress_sequences([s], max_cache_tokens=[8], protected_window=2)[0] for s in seqs]
    assert freed[0] == freed[1] > 0
    a, b = seqs[0].gather(), seqs[1].gather()
    assert torch.equal(a["positions"], b["positions"]) and torch.equal(a["valid"], b["valid"])
    for r in range(4):
        for i, p in enumerate(b["positions"].reshape(4, -1)[r].tolist()):
            if p >= 0:
                assert torch.equal(b["keys"].reshape(4, -1, 8)[r, i], by_pos[(r, p)])
    assert pools[1].num_used == pools[0].num_used


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8", "int4:rotate=0", "int8:rotate=1"])
def test_decode_from_codes_equals_attention_over_dequantized_entries(fmt):
    g = torch.Generator().manual_seed(2)
    pool = QuantizedBlockPool(12, 4, 16, torch.float32, fmt)
    assert pool.per_token_scale
    slot = torch.randperm(48, generator=g)[:30].view(2, 15)  # [rows, S], out of order
    pool.write(slot.reshape(-1), torch.randn(30, 16, generator=g) * 2, torch.randn(30, 16, generator=g))
    query = torch.randn(2, 3, 16, generator=g)  # [rows, M, d]
    keys, values = pool.read_keys(slot), pool.read_values(slot)  # [rows, S, d]
    logits = pool.key_logits(query, slot)
    torch.testing.assert_close(logits, query @ keys.transpose(-1, -2), atol=1e-4, rtol=1e-4)
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(pool.weighted_values(probs, slot), probs @ values, atol=1e-5, rtol=1e-4)
    grouped = KVQuant(pool.quant.name, residual=0, value_group=8, sink=0, rotate=False)
    assert not QuantizedBlockPool(2, 4, 16, torch.float32, grouped).per_token_scale


def test_a_rotated_pool_holds_codes_of_the_rotated_entries_and_narrows_outlier_keys():
    """Keys with a few large channels (as real keys have): the rotated pool's codes are those of ``k R`` quantized
    per token, reads come back in the model's channels, and the error is several times smaller than with the codes
    of ``k`` itself, whose per-token range the outliers set."""
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(64, 64, generator=g)
    keys[:, [5, 40]] = keys[:, [5, 40]] * 20 + 30  # two outlier channels with a large offset
    values = torch.randn(64, 64, generator=g)
    slot = torch.arange(64)
    plain, rotated = (QuantizedBlockPool(16, 4, 64, torch.float32, f) for f in ("int4:rotate=0", "int4"))
    for pool in (plain, rotated):
        pool.write(slot, keys, values)
    reference = QuantizedBlockPool(16, 4, 64, torch.float32, "int4:rotate=0")
    reference.write(slot, keys @ rotation(64), values @ rotation(64))
    assert torch.equal(rotated.key_codes, reference.key_codes)
    assert torch.equal(rotated.value_scale, reference.value_scale)
    torch.testing.assert_close(rotated.read_keys(slot), reference.read_keys(slot) @ rotation(64).T, atol=1e-4, rtol=0)
    err = [float((pool.read_keys(slot) - keys).square().mean()) for pool in (plain, rotated)]
    assert err[1] < err[0] / 4, err
