"""The sink of the quantized stores: a row's oldest entries held in the model's dtype, outside every key group."""

from __future__ import annotations

import pytest
import torch

from kvtrim.cache.dense import INVALID
from kvtrim.cache.quant import KVQuant, resolve_kv_quant
from kvtrim.cache.quantized_block_pool import pool_kv_quant
from kvtrim.cache.quantized_dense import QuantizedDenseStore
from kvtrim.cache.quantized_ragged import QuantizedRaggedStore
from kvtrim.errors import InvalidParameterError

B, H, N, D = 2, 3, 40, 16


def _fed(fmt: KVQuant, seed: int = 0, step: int = 7):
    """A store fed ``N`` tokens ``step`` at a time whose first token has outlier keys (an attention sink's)."""
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(B, H, N, D, generator=g), torch.randn(B, H, N, D, generator=g)
    keys[:, :, 0] *= 30.0
    store = QuantizedDenseStore.empty(B, H, D, torch.float32, "cpu", fmt)
    for s in range(0, N, step):
        e = min(s + step, N)
        store.append(keys[:, :, s:e], values[:, :, s:e], torch.arange(s, e).expand(B, e - s), padded=False)
    return store, keys, values


@pytest.mark.parametrize("name", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("step", [1, 7, N])
def test_the_sink_holds_the_oldest_entries_exactly_and_out_of_the_key_groups(name, step):
    fmt = KVQuant(name, group_size=8, residual=0, sink=2, rotate=False)
    store, keys, values = _fed(fmt, step=step)
    assert (store.sink_length, store.quantized_length, store.window_length) == (2, 32, 6)
    k, v = store.dequantized()
    assert torch.equal(k[:, :, :2], keys[:, :, :2]) and torch.equal(v[:, :, :2], values[:, :, :2])
    # the first key group starts after the sink: its range is the next 8 tokens', not widened by the outlier
    lo, hi = keys[:, :, 2:10].amin(2), keys[:, :, 2:10].amax(2)
    if name != "fp8":
        torch.testing.assert_close(store._ks[:, :, 0].float(), ((hi - lo) / (2**fmt.bits - 1)), rtol=2e-3, atol=1e-5)
    without = _fed(KVQuant(name, group_size=8, residual=0, sink=0, rotate=False), step=step)[0]
    err_sink = (k[:, :, 2:10] - keys[:, :, 2:10]).abs().max()
    err_none = (without.keys[:, :, 2:10] - keys[:, :, 2:10]).abs().max()
    assert err_sink < err_none / (4 if name != "fp8" else 1)  # fp8's error is relative: the outlier costs less
    # bytes: the codes and scales of 32 quantized entries, the window and the sink in float32
    fmt_bytes = 32 * (2 * D * fmt.bits // 8 + 4) + 4 * 4 * D
    assert store.nbytes() == B * H * (fmt_bytes + (6 + 2) * 2 * D * 4)


def test_a_short_store_fills_the_sink_before_anything_else():
    fmt = KVQuant("int4", group_size=8, residual=0, sink=3, rotate=False)
    store = QuantizedDenseStore.empty(1, 1, D, torch.float32, "cpu", fmt)
    keys = torch.randn(1, 1, 12, D)
    store.append(keys[:, :, :2], keys[:, :, :2], torch.arange(2)[None], padded=False)
    assert (store.sink_length, store.quantized_length, store.window_length) == (2, 0, 0)
    store.append(keys[:, :, 2:12], keys[:, :, 2:12], torch.arange(2, 12)[None], padded=False)
    assert (store.sink_length, store.quantized_length, store.window_length) == (3, 8, 1)
    assert torch.equal(store.keys[:, :, :3], keys[:, :, :3])
    store.truncate(2)
    assert (store.sink_length, store.quantized_length, store.window_length) == (2, 0, 0)
    assert torch.equal(store.keys, keys[:, :, :2])


@pytest.mark.parametrize("residual", [0, 3])
def test_compaction_puts_the_oldest_kept_entries_in_the_sink(residual):
    fmt = KVQuant("int8", group_size=8, residual=residual, sink=2)
    store = _fed(fmt)[0]
    idx = torch.tensor([1, 5, 6, 9, 12, 20, 21, 22, 23, 30, 31, 33, 34, 38, 39]).expand(B, H, -1)
    before = store.keys
    store.keep(idx)
    assert (store.sink_length, store.window_length) == (2, residual)
    assert store.quantized_length == 15 - 2 - residual
    # token 1 was quantized before (its dequantized value is what the sink now holds), token 5 too
    torch.testing.assert_close(store.keys[:, :, :2], before[:, :, [1, 5]], rtol=0, atol=0)
    assert torch.equal(store.positions[0, 0], idx[0, 0])


COUNTS = torch.tensor([[16, 1, 9], [0, 2, 12]])  # rows shorter than the sink, one empty


def _selection(counts: torch.Tensor, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = int(counts.max())
    idx = torch.stack([torch.randperm(N, generator=g)[:k] for _ in range(B * H)]).view(B, H, k)
    mask = torch.arange(k) < counts[..., None]
    idx = torch.where(mask, idx, N).sort(-1).values.clamp(max=N - 1)
    return idx, mask


@pytest.mark.parametrize("name", ["int8", "int4", "fp8"])
def test_ragged_rows_keep_their_own_sink_and_match_the_padded_dense_store(name):
    residual = 0  # with a window the padded dense store's window is its last columns, padding included
    fmt = KVQuant(name, group_size=8, residual=residual, sink=2, rotate=False)
    src = _fed(fmt)[0]
    idx, mask = _selection(COUNTS)
    ragged = QuantizedRaggedStore.from_selection(src, idx, mask)
    dense = src.copy()
    dense.keep(idx, mask)
    assert ragged.sink_width == 2 and torch.equal(ragged.entries_per_head(), COUNTS)
    n_sink = COUNTS.clamp(max=2)
    assert torch.equal(ragged.length.view(B, H), (COUNTS - n_sink - residual).clamp(min=0))
    # every row's live entries, in order, are the padded dense store's (same sink, same key groups)
    keys, values = ragged.dequantized()
    pos = ragged.padded_positions()
    for b in range(B):
        for h in range(H):
            live, want = pos[b, h] >= 0, dense.positions[b, h] >= 0
            assert torch.equal(pos[b, h][live], dense.positions[b, h][want])
            assert torch.equal(keys[b, h][live], dense.keys[b, h][want])
            assert torch.equal(values[b, h][live], dense.values[b, h][want])
            # the sink entries are the source's, untouched
            s = int(n_sink[b, h])
            assert torch.equal(keys[b, h][live][:s], src.keys[b, h, idx[b, h, :s]])
    query = torch.randn(B, 2 * H, 1, D)
    rows_with_entries = COUNTS > 0
    got = ragged.attend(query, torch.full((B, 1), N), 0.25)
    want = dense.attend(query, torch.full((B, 1), N), 0.25)
    sel = rows_with_entries.repeat_interleave(2, dim=1)  # [B, q_heads]
    torch.testing.assert_close(got[:, 0][sel], want[:, 0][sel], rtol=1e-5, atol=1e-6)
    # bytes: kept codes and row groups, the tail's window, and the sink's 2 columns per row in float32
    per_entry = 2 * D * fmt.bits // 8 + 4
    kept = sum(n * per_entry + -(-n // 8) * 4 * D for n in ragged.length.tolist())
    tail_w = min(residual, int(COUNTS.max()) - 2)
    assert ragged.nbytes() == kept + B * H * (2 + tail_w) * 2 * D * 4


def test_ragged_rows_with_a_window_hold_sink_kept_part_and_tail_without_overlap():
    fmt = KVQuant("int4", group_size=8, residual=3, sink=2, rotate=False)
    src = _fed(fmt)[0]
    idx, mask = _selection(COUNTS)
    ragged = QuantizedRaggedStore.from_selection(src, idx, mask)
    n_sink = COUNTS.clamp(max=2)
    n_tail = (COUNTS - n_sink).clamp(max=3)
    assert torch.equal(ragged.entries_per_head(), COUNTS)
    assert torch.equal(ragged.length.view(B, H), COUNTS - n_sink - n_tail)
    assert torch.equal((ragged.tail.positions >= 0).sum(-1), n_tail)
    keys = ragged.dequantized()[0]
    pos = ragged.padded_positions()
    for b in range(B):
        for h in range(H):
            n = int(COUNTS[b, h])
            live = pos[b, h] >= 0
            assert torch.equal(pos[b, h][live], idx[b, h, :n])  # every kept entry once, oldest first
            # sink and tail entries are the source's exactly; the kept part within int4 steps
            exact = torch.cat([torch.arange(int(n_sink[b, h])), torch.arange(n - int(n_tail[b, h]), n)])
            assert torch.equal(keys[b, h][live][exact], src.keys[b, h, idx[b, h, exact]])


def test_ragged_sink_survives_copy_select_batch_pruning_and_rollback():
    fmt = KVQuant("int4", group_size=8, residual=0, sink=2, rotate=False)
    src = _fed(fmt)[0]
    idx, mask = _selection(COUNTS)
    ragged = QuantizedRaggedStore.from_selection(src, idx, mask)
    ragged.append(torch.randn(B, H, 3, D), torch.randn(B, H, 3, D), torch.arange(N, N + 3).expand(B, 3), padded=False)
    copy = ragged.copy()
    copy.select_batch(torch.tensor([1, 0]))
    assert torch.equal(copy.entries_per_head(), (COUNTS + 3).flip(0))
    pruned = ragged.with_key_channels(torch.arange(D)[::2].expand(B, H, -1).contiguous())
    torch.testing.assert_close(pruned.dequantized()[0], ragged.dequantized()[0][..., ::2], rtol=0, atol=0)
    rolled = ragged.copy()
    rolled.drop_last(3 + 8)  # the appended columns, then 8 kept entries per row, then the sink's newest
    assert torch.equal(rolled.entries_per_head(), (COUNTS - 8).clamp(min=0))
    assert torch.equal(rolled.sink_width and (rolled._spos >= 0).sum(-1), (COUNTS - 8).clamp(min=0, max=2))
    assert (rolled.padded_positions() == INVALID).sum() > (ragged.padded_positions() == INVALID).sum()


def test_sink_is_a_setting_of_every_format_and_the_pool_refuses_it():
    assert resolve_kv_quant("int8:sink=4") == KVQuant("int8", sink=4)
    assert KVQuant("int8", sink=4).spec == "int8:group_size=64,residual=0,sink=4,rotate=0"
    assert resolve_kv_quant(KVQuant("int4", sink=1, rotate=False).spec) == KVQuant("int4", sink=1, rotate=False)
    with pytest.raises(InvalidParameterError, match="sink must be an integer >= 0"):
        KVQuant("int4", sink=-1)
    assert KVQuant("int4").full_precision == ("residual", 32) and KVQuant("int8", sink=2).full_precision == ("sink", 2)
    assert KVQuant("int4", residual=0).full_precision == ("sink", 1)  # int4's default sink
    assert KVQuant("int4", residual=0, sink=0).full_precision is None
    assert pool_kv_quant("int4").sink == 0  # a pool reads a name without a sink, whatever the default
    with pytest.raises(InvalidParameterError, match=r"KVQuant\.sink must be 0, got 1"):
        pool_kv_quant("int4:sink=1")
    # a record written before the setting existed meant none
    assert resolve_kv_quant("int4:group_size=32,residual=32", default_sink=0).sink == 0
