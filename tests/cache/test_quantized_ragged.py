"""QuantizedRaggedStore: per-head counts of int8/int4 entries, checked on hand-made tensors against the padded
quantized dense store (which holds the same codes for the live slots, plus padding)."""

from __future__ import annotations

import math

import pytest
import torch

from kvtrim.cache.dense import INVALID, DenseStore
from kvtrim.cache.quant import KVQuant
from kvtrim.cache.quantized_dense import QuantizedDenseStore
from kvtrim.cache.quantized_ragged import QuantizedRaggedStore
from kvtrim.cache.store import KVStore

B, H, N, D = 2, 3, 40, 16


def _source(fmt: KVQuant, seed: int = 0) -> QuantizedDenseStore:
    """A quantized dense store fed ``N`` tokens 7 at a time (its window flushed in groups)."""
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(B, H, N, D, generator=g), torch.randn(B, H, N, D, generator=g)
    keys[..., 3] += 6.0  # an outlier channel, as real keys have
    store = QuantizedDenseStore.empty(B, H, D, torch.float32, "cpu", fmt)
    for s in range(0, N, 7):
        e = min(s + 7, N)
        store.append(keys[:, :, s:e], values[:, :, s:e], torch.arange(s, e).expand(B, e - s), padded=False)
    return store


def _selection(counts: torch.Tensor, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``counts[b, h]`` kept slots per row, chosen at random and ascending, kept ones first, in
    ``[B, H, max(counts)]``."""
    g = torch.Generator().manual_seed(seed)
    k = int(counts.max())
    idx = torch.stack([torch.randperm(N, generator=g)[:k] for _ in range(B * H)]).view(B, H, k)
    mask = torch.arange(k) < counts[..., None]
    idx = torch.where(mask, idx, N)  # unkept columns sort last
    idx = idx.sort(-1).values.clamp(max=N - 1)
    return idx, mask


COUNTS = torch.tensor([[16, 5, 9], [1, 16, 12]])  # the longest row holds exactly two groups of 8


def _pair(name: str, residual: int = 0, counts: torch.Tensor = COUNTS):
    fmt = KVQuant(name, group_size=8, residual=residual, sink=0)
    src = _source(fmt)
    idx, mask = _selection(counts)
    ragged = QuantizedRaggedStore.from_selection(src, idx, mask)
    dense = src.copy()
    dense.keep(idx, mask)
    return fmt, ragged, dense, idx, mask


def _expected_bytes(fmt: KVQuant, counts, tail_slots: int = 0, tail_q: int = 0):
    per_entry = 2 * D * fmt.bits // 8 + 4 * D // fmt.value_group_for(D)
    kept = sum(n * per_entry + math.ceil(n / fmt.group_size) * 4 * D for n in counts.reshape(-1).tolist())
    tail = B * H * (tail_q * (2 * D * fmt.bits // 8 + 4 * D // fmt.value_group_for(D)) + tail_q // 8 * 4 * D)
    return kept + tail + B * H * tail_slots * 2 * D * 4


def test_it_is_a_kv_store():
    assert isinstance(_pair("int4")[1], KVStore)


@pytest.mark.parametrize("name", ["int8", "int4", "fp8"])
def test_bytes_are_the_kept_entries_codes_and_their_row_groups(name):
    fmt, ragged, dense, *_ = _pair(name)
    assert ragged.entries() == int(COUNTS.sum()) and torch.equal(ragged.entries_per_head(), COUNTS)
    assert ragged.nbytes() == _expected_bytes(fmt, COUNTS)
    assert ragged.nbytes() < dense.nbytes()  # the dense store pads every row to 16 entries


@pytest.mark.parametrize("name", ["int8", "int4", "fp8"])
def test_live_entries_and_attention_match_the_padded_dense_store(name):
    """Same groups (a row's kept entries from column 0), same codes: the live slots dequantize identically."""
    _, ragged, dense, _, mask = _pair(name)
    keys, values = ragged.dequantized()
    live = mask
    assert torch.equal(keys[:, :, :16][live], dense.keys[live])
    assert torch.equal(values[:, :, :16][live], dense.values[live])
    assert torch.equal(ragged.padded_positions()[:, :, :16][live], dense.positions[live])
    query = torch.randn(B, 2 * H, 1, D)
    got = ragged.attend(query, torch.full((B, 1), N), 0.25)
    want = dense.attend(query, torch.full((B, 1), N), 0.25)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["int8", "int4", "fp8"])
def test_decoding_appends_flush_like_the_dense_store(name):
    fmt, ragged, dense, *_ = _pair(name)
    g = torch.Generator().manual_seed(3)
    for step in range(11):
        k, v = torch.randn(B, H, 1, D, generator=g), torch.randn(B, H, 1, D, generator=g)
        pos = torch.full((B, 1), N + step)
        ragged.append(k, v, pos, padded=False)
        dense.append(k, v, pos, padded=False)
        query = torch.randn(B, 2 * H, 1, D, generator=g)
        torch.testing.assert_close(ragged.attend(query, pos, 0.3), dense.attend(query, pos, 0.3), rtol=1e-5, atol=1e-6)
    assert ragged.tail.quantized_length == 8 and ragged.tail.window_length == 3
    assert ragged.nbytes() == _expected_bytes(fmt, COUNTS, tail_slots=3, tail_q=8)
    assert torch.equal(ragged.latest_positions(), torch.full((B,), N + 10))


def test_a_chunk_sees_only_entries_not_after_its_own_position():
    _, ragged, dense, *_ = _pair("int8")
    k, v = torch.randn(B, H, 4, D), torch.randn(B, H, 4, D)
    pos = torch.tensor([[N, N + 1, N + 2, N + 3], [INVALID, N, N + 1, N + 2]])  # row 1 left-padded
    for store in (ragged, dense):
        store.append(k, v, pos, padded=True)
    query = torch.randn(B, 2 * H, 4, D)
    got, want = ragged.attend(query, pos, 0.3), dense.attend(query, pos, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_residual_keeps_each_rows_newest_kept_entries_in_full_precision():
    fmt, ragged, _, idx, _ = _pair("int4", residual=3)
    per_row = (COUNTS - 3).clamp(min=0)
    assert torch.equal(ragged.length.view(B, H), per_row)
    assert ragged.tail.length == 3 and ragged.tail.quantized_length == 0
    assert ragged.entries() == int(COUNTS.sum())
    assert ragged.nbytes() == _expected_bytes(fmt, per_row, tail_slots=3)
    # the tail holds the exact (dequantized source) entries of each row's last kept slots, row (1, 0) padded
    src_keys = _source(fmt).keys
    tail_pos = ragged.tail.positions
    assert (tail_pos[1, 0] == INVALID).sum() == 2
    last = idx[0, 0, COUNTS[0, 0] - 1]
    torch.testing.assert_close(ragged.tail.keys[0, 0, -1], src_keys[0, 0, last])


def test_truncate_drop_last_copy_and_select_batch():
    _, ragged, dense, *_ = _pair("int8")
    mark = ragged.mark()
    ragged.append(torch.randn(B, H, 2, D), torch.randn(B, H, 2, D), torch.tensor([[N, N + 1]] * B), padded=False)
    copy = ragged.copy()
    ragged.truncate_to(mark)
    assert ragged.entries() == int(COUNTS.sum()) and copy.entries() == int(COUNTS.sum()) + 2 * B * H
    copy.drop_last(3)  # the two appended columns, then one kept entry per row
    assert torch.equal(copy.entries_per_head(), (COUNTS - 1).clamp(min=0))
    query = torch.randn(2, 2 * H, 1, D)
    ragged.select_batch(torch.tensor([1, 1]))
    dense.select_batch(torch.tensor([1, 1]))
    assert torch.equal(ragged.entries_per_head(), COUNTS[[1, 1]])
    pos = torch.full((2, 1), N)
    torch.testing.assert_close(ragged.attend(query, pos, 0.3), dense.attend(query, pos, 0.3), rtol=1e-5, atol=1e-6)


def test_to_dense_gives_the_entries_back_for_scoring():
    _, ragged, dense, _, mask = _pair("int8")
    back = ragged.to_dense()
    assert isinstance(back, QuantizedDenseStore)
    live = back.positions >= 0
    assert int(live.sum()) == int(COUNTS.sum())
    # keys quantized again in the same groups: within a step of the stored ones (int8 steps are ~1/255 of a range)
    torch.testing.assert_close(back.keys[:, :, :16][mask], dense.keys[mask], rtol=0, atol=0.05)
    torch.testing.assert_close(back.values[:, :, :16][mask], dense.values[mask], rtol=0, atol=0.05)


@pytest.mark.parametrize("name", ["int8", "int4", "fp8"])
def test_kept_keys_are_quantized_once_from_the_prefills_float_keys(name):
    """From a store that still holds its prefill's float keys (``from_dense(..., keep_source=True)``), every row's
    kept key groups hold its kept float keys quantized in one pass: the padded dense store's keys from the same
    source, and closer to the float keys than keys regrouped from their codes."""
    fmt = KVQuant(name, group_size=8, residual=0, sink=0)
    g = torch.Generator().manual_seed(5)
    keys, values = torch.randn(B, H, N, D, generator=g), torch.randn(B, H, N, D, generator=g)
    keys[..., 3] += 6.0
    prefill = DenseStore(keys, values, torch.arange(N).expand(B, H, N).clone(), N)
    idx, mask = _selection(COUNTS)
    source = QuantizedDenseStore.from_dense(prefill, fmt, keep_source=True)
    once = QuantizedRaggedStore.from_selection(source, idx, mask)
    twice = QuantizedRaggedStore.from_selection(QuantizedDenseStore.from_dense(prefill, fmt), idx, mask)
    dense = QuantizedDenseStore.from_dense(prefill, fmt, keep_source=True)
    dense.keep(idx, mask)
    got, want = once.dequantized()[0][:, :, :16][mask], dense.keys[mask]
    assert torch.equal(got, want)
    kept = keys.gather(2, idx[..., None].expand(-1, -1, -1, D))[mask]
    err_once, err_twice = (got - kept).norm(), (twice.dequantized()[0][:, :, :16][mask] - kept).norm()
    assert err_once < err_twice, (float(err_once), float(err_twice))
    assert torch.equal(once.dequantized()[1], twice.dequantized()[1])  # values move as codes either way
