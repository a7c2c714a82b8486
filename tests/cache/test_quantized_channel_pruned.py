"""Channel-pruned keys (ThinK) held quantized: pruning moves codes and per-channel scales unchanged, attention equals
a dequantize-then-prune reference (and full attention on exactly representable inputs), bytes come from the packed
tensors, appends quantize over the kept channels; rotated keys are pruned in the model's channels."""

from __future__ import annotations

import math

import pytest
import torch

from kvtrim.cache.channel_pruned import ChannelPrunedStore, gather_channels
from kvtrim.cache.dense import DenseStore
from kvtrim.cache.quant import KVQuant, pack_codes, packed_width, take_code_channels, unpack_codes
from kvtrim.cache.quantized_dense import QuantizedDenseStore
from kvtrim.cache.quantized_ragged import QuantizedRaggedStore

B, H, N, D, G = 2, 2, 27, 16, 8  # 3 whole key groups of 8 and a window of 3
FORMATS = ("int8", "int4", "fp8")


def _float_entries(seed: int = 0, n: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(B, H, n, D, generator=g), torch.randn(B, H, n, D, generator=g)
    keys[..., 5] += 6.0  # an outlier channel, as real keys have
    return keys, values


def _exact_entries(name: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries every format holds without error: small integers on a grid whose every key group and channel, and
    every value token, reaches the ends of the format's range (so scale 1 and zero point 0 come out exactly)."""
    g = torch.Generator().manual_seed(seed)
    top = {"int8": 255, "int4": 15, "fp8": 448}[name]
    grid = torch.arange(17.0) if name == "fp8" else torch.arange(top + 1.0)  # integers up to 16 are e4m3 numbers
    pick = grid[torch.randint(len(grid), (2, B, H, N, D), generator=g)]
    keys, values = pick[0], pick[1]
    keys[:, :, 0::G], keys[:, :, 1::G] = 0.0, float(top)  # every group of every channel spans [0, top]
    values[..., 0], values[..., 1] = 0.0, float(top)  # every token spans [0, top]
    return keys, values


def _quantized(keys: torch.Tensor, values: torch.Tensor, fmt: KVQuant) -> QuantizedDenseStore:
    """A quantized dense store fed the entries 5 tokens at a time (its window flushed in whole groups)."""
    store = QuantizedDenseStore.empty(B, H, D, keys.dtype, "cpu", fmt, key_dim=keys.shape[-1])
    for s in range(0, keys.shape[2], 5):
        e = min(s + 5, keys.shape[2])
        store.append(keys[:, :, s:e], values[:, :, s:e], torch.arange(s, e).expand(B, e - s), padded=False)
    return store


def _channels(kept: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(D, generator=g)[:kept].sort().values for _ in range(B * H)]).view(B, H, kept)


def test_take_code_channels_moves_codes_unchanged_for_odd_counts():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(16, (3, 4, 16), generator=g)
    index = torch.stack([torch.randperm(16, generator=g)[:7] for _ in range(12)]).view(3, 4, 7)
    packed = take_code_channels(pack_codes(codes, 4), index, 4, 16)
    assert packed.shape == (3, 4, packed_width(7, 4)) == (3, 4, 4)
    assert torch.equal(unpack_codes(packed, 4, 7), codes.gather(-1, index).to(torch.uint8))
    assert torch.equal(packed[..., -1] >> 4, torch.zeros(3, 4, dtype=torch.uint8))  # the unused high nibble


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("kept", [9, 10])  # odd: int4 codes end with a half byte
def test_pruning_quantized_keys_equals_quantizing_pruned_keys(name, kept):
    """A key scale belongs to one channel, so prune(quantize(k)) and quantize(prune(k)) hold the same codes and
    scales, before and after appends that flush whole groups."""
    fmt = KVQuant(name, group_size=G, residual=0, sink=0, rotate=False)
    keys, values = _float_entries()
    channels = _channels(kept)
    pruned = ChannelPrunedStore.prune(_quantized(keys[:, :, :20], values[:, :, :20], fmt), channels)
    reference = _quantized(gather_channels(keys[:, :, :20], channels), values[:, :, :20], fmt)
    for s in range(20, N, 3):  # decoding-style appends: the window fills and flushes over the kept channels
        e = min(s + 3, N)
        pos = torch.arange(s, e).expand(B, e - s)
        pruned.append(keys[:, :, s:e], values[:, :, s:e], pos, padded=False)
        reference.append(gather_channels(keys[:, :, s:e], channels), values[:, :, s:e], pos, padded=False)
    inner = pruned.inner
    assert isinstance(inner, QuantizedDenseStore) and inner.key_dim == kept and pruned.kv_quant == fmt
    assert inner.quantized_length == reference.quantized_length == 24
    for mine, theirs in zip(inner._tensors(), reference._tensors(), strict=True):
        assert torch.equal(mine, theirs)
    assert torch.equal(pruned.keys, gather_channels(_quantized(keys, values, fmt).keys, channels))


@pytest.mark.parametrize("name", FORMATS)
def test_attention_equals_dequantize_then_prune(name):
    fmt = KVQuant(name, group_size=G, residual=0, sink=0, rotate=False)
    keys, values = _float_entries()
    store = _quantized(keys, values, fmt)
    channels = _channels(11)
    dequantized = DenseStore(store.keys, store.values, store.positions.clone(), store.length)
    reference = ChannelPrunedStore.prune(dequantized, channels)
    pruned = ChannelPrunedStore.prune(store.copy(), channels)
    query = torch.randn(B, 2 * H, 1, D, generator=torch.Generator().manual_seed(3))
    qpos = torch.full((B, 1), N)
    got = pruned.attend(query, qpos, 0.25)
    torch.testing.assert_close(got, reference.attend(query, qpos, 0.25))
    chunk = torch.randn(B, 2 * H, 4, D, generator=torch.Generator().manual_seed(4))
    cpos = torch.arange(N - 4, N).expand(B, 4)  # a chunk sees the entries at or before its own positions
    torch.testing.assert_close(pruned.attend(chunk, cpos, 0.25), reference.attend(chunk, cpos, 0.25))


@pytest.mark.parametrize("name", FORMATS)
def test_exact_entries_with_every_channel_kept_equal_full_attention(name):
    fmt = KVQuant(name, group_size=G, residual=0, sink=0, rotate=False)
    keys, values = _exact_entries(name)
    store = _quantized(keys, values, fmt)
    assert torch.equal(store.keys, keys) and torch.equal(store.values, values)  # no quantization error
    every = torch.arange(D).expand(B, H, D).contiguous()
    pruned = ChannelPrunedStore.prune(store, every)
    query = torch.randn(B, 2 * H, 1, D, generator=torch.Generator().manual_seed(5)) * 0.01
    qpos = torch.full((B, 1), N)
    full = DenseStore(keys, values, torch.arange(N).expand(B, H, N).clone(), N)
    torch.testing.assert_close(pruned.attend(query, qpos, 0.25), full.attend(query, qpos, 0.25, fresh_causal=False))
    # and with channels pruned, the float pruned store's attention on the same exact entries
    channels = _channels(7)
    exact = ChannelPrunedStore.prune(_quantized(keys, values, fmt), channels)
    assert torch.equal(exact.keys, gather_channels(keys, channels))
    torch.testing.assert_close(
        exact.attend(query, qpos, 0.25), ChannelPrunedStore.prune(full, channels).attend(query, qpos, 0.25)
    )


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("kept", [9, 12])
def test_bytes_are_kept_channels_of_packed_codes_plus_scales(name, kept):
    fmt = KVQuant(name, group_size=G, residual=0, sink=0, rotate=False)
    keys, values = _float_entries()
    pruned = ChannelPrunedStore.prune(_quantized(keys, values, fmt), _channels(kept))
    nq, w, bits = 24, N - 24, fmt.bits
    per_head = (
        nq * packed_width(kept, bits)  # key codes over the kept channels
        + nq // G * kept * 4  # per-channel key scale + zero point (float16), kept channels only
        + nq * D * bits // 8  # value codes, every channel
        + nq * 4  # per-token value scale + zero point
        + w * (kept + D) * 4  # the float32 window: pruned keys, full values
    )
    assert pruned.nbytes() == B * H * per_head
    unpruned = _quantized(keys, values, fmt).nbytes()
    assert unpruned - pruned.nbytes() == B * H * (
        nq * (packed_width(D, bits) - packed_width(kept, bits)) + nq // G * (D - kept) * 4 + w * (D - kept) * 4
    )


COUNTS = torch.tensor([[16, 5], [1, 11]])


def _selection(counts: torch.Tensor, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = int(counts.max())
    idx = torch.stack([torch.randperm(N, generator=g)[:k] for _ in range(B * H)]).view(B, H, k)
    mask = torch.arange(k) < counts[..., None]
    return torch.where(mask, idx, N).sort(-1).values.clamp(max=N - 1), mask


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("residual", [0, 2])
def test_ragged_rows_prune_their_own_channels(name, residual):
    fmt = KVQuant(name, group_size=G, residual=residual, sink=0, rotate=False)
    keys, values = _float_entries()
    idx, mask = _selection(COUNTS)
    ragged = QuantizedRaggedStore.from_selection(_quantized(keys, values, fmt), idx, mask)
    channels = _channels(9)
    pruned = ChannelPrunedStore.prune(ragged, channels)
    assert isinstance(pruned.inner, QuantizedRaggedStore) and pruned.inner.key_dim == 9
    live = ragged.padded_positions() >= 0
    full_k, full_v = ragged.dequantized()
    got_k, got_v = pruned.inner.dequantized()
    assert torch.equal(got_k[live], gather_channels(full_k, channels)[live])
    assert torch.equal(got_v[live], full_v[live])
    # attention against the dequantize-then-prune reference, then a decoding step appended to both
    reference = ChannelPrunedStore.prune(
        DenseStore(full_k, full_v, ragged.padded_positions(), full_k.shape[2]), channels
    )
    query = torch.randn(B, 2 * H, 1, D, generator=torch.Generator().manual_seed(6))
    qpos = torch.full((B, 1), N)
    torch.testing.assert_close(pruned.attend(query, qpos, 0.25), reference.attend(query, qpos, 0.25))
    # bytes: every row's kept entries with its own partial last key group, over the kept channels
    tail_w = min(residual, int(COUNTS.max()))
    n_kept = (COUNTS - tail_w).clamp(min=0)
    per_entry = packed_width(9, fmt.bits) + D * fmt.bits // 8 + 4
    kept_bytes = sum(n * per_entry + math.ceil(n / G) * 4 * 9 for n in n_kept.reshape(-1).tolist())
    assert pruned.nbytes() == kept_bytes + B * H * tail_w * (9 + D) * 4


def test_ragged_appends_after_pruning_keep_the_channels():
    fmt = KVQuant("int4", group_size=G, residual=0, sink=0, rotate=False)
    keys, values = _float_entries(n=N + G)
    idx, mask = _selection(COUNTS)
    channels = _channels(9)
    pruned = ChannelPrunedStore.prune(
        QuantizedRaggedStore.from_selection(_quantized(keys[:, :, :N], values[:, :, :N], fmt), idx, mask), channels
    )
    for t in range(N, N + G):  # one whole group: the tail quantizes it over the kept channels
        pruned.append(keys[:, :, t : t + 1], values[:, :, t : t + 1], torch.full((B, 1), t), padded=False)
    tail = pruned.inner.tail
    assert tail.quantized_length == G and tail.key_dim == 9
    reference = _quantized(gather_channels(keys[:, :, N:], channels), values[:, :, N:], fmt)
    assert torch.equal(tail.keys, reference.keys)


# ---------------------------------------------------------------------------------------------- rotated entries
def _scatter(pruned_keys: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
    """``[.., n, d_kept]`` keys placed on ``channels`` of a ``[.., n, D]`` tensor (zeros elsewhere)."""
    out = pruned_keys.new_zeros(*pruned_keys.shape[:-1], D)
    return out.scatter(3, channels[:, :, None, :].expand(-1, -1, pruned_keys.shape[2], -1), pruned_keys)


def test_rotated_keys_are_pruned_in_the_models_channels_and_values_stay_rotated():
    """int4's default rotates keys and values; pruning keeps the model's key channels, quantized again unrotated in
    the same key groups, and keeps the values' rotated codes; attention reads both in their own basis."""
    fmt = KVQuant("int4", group_size=G, residual=0, sink=0)
    assert fmt.rotate
    keys, values = _float_entries(n=N + G)
    store = _quantized(keys[:, :, :N], values[:, :, :N], fmt)
    channels = _channels(9)
    pruned = ChannelPrunedStore.prune(store, channels)
    inner = pruned.inner
    assert isinstance(inner, QuantizedDenseStore) and inner.kv_quant == fmt and pruned.kv_quant == fmt
    assert not inner.key_format.rotate and store.key_format.rotate
    plain = KVQuant("int4", group_size=G, residual=0, sink=0, rotate=False)
    reference = _quantized(gather_channels(store.keys, channels), store.values, plain)  # quantize(prune(keys))
    torch.testing.assert_close(inner.keys, reference.keys, rtol=0, atol=1e-5)
    assert torch.equal(inner._vc, store._vc) and torch.equal(pruned.values, store.values)  # values untouched
    assert (inner.keys - gather_channels(keys[:, :, :N], channels)).abs().max() < 0.8  # within int4's steps here
    # attention: pruned keys in the model's channels with the query's kept channels, the output rotated back
    floats = ChannelPrunedStore.prune(DenseStore(_scatter(inner.keys, channels), inner.values,
                                                 torch.arange(N).expand(B, H, N).clone(), N), channels)  # fmt: skip
    query = torch.randn(B, 2 * H, 1, D, generator=torch.Generator().manual_seed(7))
    qpos = torch.full((B, 1), N)
    torch.testing.assert_close(pruned.attend(query, qpos, 0.25), floats.attend(query, qpos, 0.25), rtol=1e-4, atol=1e-5)
    # appends after pruning quantize whole groups over the kept channels, unrotated
    for t in range(N, N + G):
        pruned.append(keys[:, :, t : t + 1], values[:, :, t : t + 1], torch.full((B, 1), t), padded=False)
    assert inner.quantized_length == 32 and inner.key_dim == 9
    fresh = _quantized(gather_channels(keys[:, :, 24 : N + G], channels), values[:, :, 24 : N + G], plain)
    torch.testing.assert_close(inner.keys[:, :, 24:32], fresh.keys[:, :, :8], rtol=0, atol=1e-6)


def test_rotated_keys_with_their_float_source_are_pruned_from_it_once():
    """While a store holds the float keys it was quantized from, pruning quantizes their kept channels once."""
    fmt = KVQuant("int4", group_size=G, residual=3, sink=0)
    keys, values = _float_entries()
    dense = DenseStore(keys, values, torch.arange(N).expand(B, H, N).clone(), N)
    store = QuantizedDenseStore.from_dense(dense, fmt, keep_source=True)
    assert store.source_keys is not None and store.quantized_length == 24
    channels = _channels(9)
    pruned = ChannelPrunedStore.prune(store, channels)
    plain = KVQuant("int4", group_size=G, residual=3, sink=0, rotate=False)
    reference = QuantizedDenseStore.from_dense(DenseStore(gather_channels(keys, channels), values, dense.positions, N),
                                               plain)  # fmt: skip
    for mine, theirs in zip(pruned.inner._tensors()[:3], reference._tensors()[:3], strict=True):
        assert torch.equal(mine, theirs)


def test_rotated_ragged_rows_prune_the_models_channels():
    fmt = KVQuant("int4", group_size=G, residual=2, sink=1)
    keys, values = _float_entries()
    idx, mask = _selection(COUNTS)
    ragged = QuantizedRaggedStore.from_selection(_quantized(keys, values, fmt), idx, mask)
    channels = _channels(9)
    pruned = ChannelPrunedStore.prune(ragged, channels)
    inner = pruned.inner
    assert isinstance(inner, QuantizedRaggedStore) and not inner.key_format.rotate and inner.kv_quant.rotate
    live = ragged.padded_positions() >= 0
    full_k, full_v = ragged.dequantized()
    got_k, got_v = inner.dequantized()
    assert torch.equal(got_v[live], full_v[live])
    assert (got_k[live] - gather_channels(full_k, channels)[live]).abs().max() < 0.5  # one more int4 rounding
    floats = ChannelPrunedStore.prune(DenseStore(_scatter(got_k, channels), got_v, ragged.padded_positions(),
                                                 got_k.shape[2]), channels)  # fmt: skip
    query = torch.randn(B, 2 * H, 1, D, generator=torch.Generator().manual_seed(8))
    qpos = torch.full((B, 1), N)
    torch.testing.assert_close(pruned.attend(query, qpos, 0.25), floats.attend(query, qpos, 0.25), rtol=1e-4, atol=1e-5)
    # the bytes of unrotated pruned keys: the same layout as an unrotated store's
    plain = QuantizedRaggedStore.from_selection(
        _quantized(keys, values, KVQuant("int4", group_size=G, residual=2, sink=1, rotate=False)), idx, mask
    )
    assert pruned.nbytes() == ChannelPrunedStore.prune(plain, channels).nbytes()
