"""Entries quantized in a rotated basis (``KVQuant.rotate``): the rotation, the codes, and attention that rotates
the query and the output instead of the stored entries."""

from __future__ import annotations

import pytest
import torch

from kvtrim.cache.quant import (
    KVQuant,
    dequantize_keys,
    dequantize_values,
    quantize_keys,
    quantize_values,
    resolve_kv_quant,
    rotate,
    rotation,
)
from kvtrim.cache.quantized_block_pool import pool_kv_quant
from kvtrim.cache.quantized_dense import QuantizedDenseStore
from kvtrim.cache.quantized_ragged import QuantizedRaggedStore
from kvtrim.cache.triton_paged_quant import check_format
from kvtrim.errors import InvalidParameterError

B, H, N, D = 2, 3, 40, 16


@pytest.mark.parametrize("d", [2, 16, 64, 80, 96, 128])
def test_rotation_is_orthogonal_fixed_and_spreads_every_channel(d):
    r = rotation(d)
    torch.testing.assert_close(r @ r.T, torch.eye(d), rtol=0, atol=1e-6)
    assert torch.equal(r, rotation(d))
    block = d & -d  # each channel is spread over the channels of its Hadamard block, equally
    assert torch.allclose(r.abs()[r != 0], torch.full((), block**-0.5)) and int((r != 0).sum()) == d * block
    x = torch.randn(5, d)
    torch.testing.assert_close(rotate(rotate(x, KVQuant("int4", rotate=True)), KVQuant("int4", rotate=True),
                                      inverse=True), x, rtol=0, atol=1e-5)  # fmt: skip


def test_rotate_is_a_setting_in_specs_on_by_default_for_int4_alone():
    assert KVQuant("int4").rotate and not KVQuant("int8").rotate and not KVQuant("fp8").rotate
    fmt = resolve_kv_quant("int4:group_size=32,sink=0")
    assert fmt.rotate is True and fmt.spec == "int4:group_size=32,residual=32,sink=0,rotate=1"
    assert resolve_kv_quant(fmt.spec) == fmt
    assert KVQuant("int8").spec == "int8:group_size=64,residual=0,sink=0,rotate=0"  # every spec names it
    assert resolve_kv_quant("int4:rotate=0") == KVQuant("int4", rotate=False)
    assert resolve_kv_quant(KVQuant("int4", rotate=False).spec) == KVQuant("int4", rotate=False)
    with pytest.raises(InvalidParameterError, match="rotate must be 0 or 1"):
        resolve_kv_quant("int4:rotate=2")
    # a paged pool and its fused kernel keep the format's default and take either setting
    assert pool_kv_quant("int4").rotate and not pool_kv_quant("int8").rotate
    assert pool_kv_quant("int8:rotate=1").rotate and not pool_kv_quant("int4:rotate=0").rotate
    assert check_format("int4") == pool_kv_quant("int4") and check_format("int8:rotate=1").rotate


@pytest.mark.parametrize("name", ["int8", "int4", "fp8"])
def test_codes_hold_the_rotated_entries_and_dequantize_to_the_models_channels(name):
    """Outlier channels (as keys have): the rotated codes describe ``x @ R``, and the entries come back in the
    model's channels with less error than without rotation."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, H, 64, D, generator=g)
    x[..., 3] *= 20.0
    x[..., 11] += 8.0
    plain, rot = KVQuant(name, group_size=32, rotate=False), KVQuant(name, group_size=32, rotate=True)
    for quantize, dequantize in ((quantize_keys, dequantize_keys), (quantize_values, dequantize_values)):
        codes = quantize(x, rot)
        same = quantize(x @ rotation(D), plain)  # quantizing the rotated entries without the setting
        assert all(torch.equal(a, b) for a, b in zip(codes, same, strict=True))
        held = dequantize(*codes, rot, torch.float32, rotated=True)
        torch.testing.assert_close(held, dequantize(*same, plain, torch.float32))
        back = dequantize(*codes, rot, torch.float32)
        torch.testing.assert_close(back, held @ rotation(D).T, rtol=0, atol=1e-5)
        err_rot = (back - x).norm() / x.norm()
        err_plain = (dequantize(*quantize(x, plain), plain, torch.float32) - x).norm() / x.norm()
        if name != "fp8":  # fp8's error is relative to each element: outliers cost it little
            assert err_rot < err_plain


def _fed(fmt: KVQuant, seed: int = 0, step: int = 7):
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(B, H, N, D, generator=g), torch.randn(B, H, N, D, generator=g)
    keys[..., 5] *= 10.0
    store = QuantizedDenseStore.empty(B, H, D, torch.float32, "cpu", fmt)
    for s in range(0, N, step):
        e = min(s + step, N)
        store.append(keys[:, :, s:e], values[:, :, s:e], torch.arange(s, e).expand(B, e - s), padded=False)
    return store, keys, values


def _reference(query, keys, values, scaling, mask=None):
    """``[batch, q, q_heads, d]`` attention over model-channel entries ``[batch, kv_heads, n, d]``."""
    rep = query.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
    logits = (query @ k.transpose(-1, -2)) * scaling
    if mask is not None:
        logits = logits.masked_fill(~mask.repeat_interleave(rep, 1), float("-inf"))
    return (logits.softmax(-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("sink", [0, 2])
def test_dense_attention_over_rotated_entries_is_attention_over_their_model_channels(name, sink):
    """The store attends with the rotated query over entries as they are held (quantized part rotated, the
    sink and the window rotated for the call) and rotates the output back: what attention over the dequantized
    entries in the model's channels (``keys`` / ``values``, what scoring reads) gives."""
    fmt = KVQuant(name, group_size=8, residual=3, sink=sink, rotate=True)
    store = _fed(fmt)[0]
    assert store.quantized_length > 0 and store.window_length >= 3
    keys, values = store.keys, store.values
    query = torch.randn(B, 2 * H, 1, D)
    got = store.attend(query, torch.full((B, 1), N), 0.25)
    torch.testing.assert_close(got, _reference(query, keys, values, 0.25), rtol=1e-5, atol=1e-5)
    # a chunk of queries, causal over the stored positions
    chunk = torch.randn(B, 2 * H, 4, D)
    qpos = torch.arange(N - 4, N).expand(B, 4)
    mask = store.positions[:, :, None, :] <= qpos[:, None, :, None]
    got = store.attend(chunk, qpos, 0.25)
    torch.testing.assert_close(got, _reference(chunk, keys, values, 0.25, mask), rtol=1e-5, atol=1e-5)


def test_compaction_and_truncation_keep_rotated_entries_consistent():
    fmt = KVQuant("int4", group_size=8, residual=3, rotate=True)
    store, keys, _ = _fed(fmt)
    idx = torch.tensor([0, 3, 5, 9, 12, 20, 21, 22, 23, 30, 31, 33, 34, 38, 39]).expand(B, H, -1)
    before, old_nq = store.values, store.quantized_length
    store.keep(idx)
    # kept values that were quantized move with their codes: exactly the entries held before
    moved = int((idx[0, 0] < old_nq).sum())
    assert moved == 11
    want = before.gather(2, idx[..., :moved, None].expand(-1, -1, -1, D))
    torch.testing.assert_close(store.values[:, :, :moved], want, rtol=0, atol=1e-5)
    # kept keys are quantized again in the rotated basis, close to the model's keys
    kept = keys.gather(2, idx[..., None].expand(-1, -1, -1, D))
    assert ((store.keys - kept).norm() / kept.norm()) < 0.1
    query = torch.randn(B, 2 * H, 1, D)
    got = store.attend(query, torch.full((B, 1), N), 0.25)
    torch.testing.assert_close(got, _reference(query, store.keys, store.values, 0.25), rtol=1e-5, atol=1e-5)
    store.truncate(10)
    assert store.length == 10
    torch.testing.assert_close(store.attend(query, torch.full((B, 1), N), 0.25),
                               _reference(query, store.keys, store.values, 0.25), rtol=1e-5, atol=1e-5)  # fmt: skip


def test_ragged_attention_over_rotated_entries_matches_the_padded_dense_store():
    fmt = KVQuant("int4", group_size=8, residual=0, sink=1, rotate=True)
    src = _fed(fmt)[0]
    counts = torch.tensor([[16, 1, 9], [3, 2, 12]])
    g = torch.Generator().manual_seed(1)
    k = int(counts.max())
    idx = torch.stack([torch.randperm(N, generator=g)[:k] for _ in range(B * H)]).view(B, H, k)
    mask = torch.arange(k) < counts[..., None]
    idx = torch.where(mask, idx, N).sort(-1).values.clamp(max=N - 1)
    ragged = QuantizedRaggedStore.from_selection(src, idx, mask)
    ragged.append(torch.randn(B, H, 2, D), torch.randn(B, H, 2, D), torch.arange(N, N + 2).expand(B, 2), padded=False)
    keys, values = ragged.dequantized()
    live = (ragged.padded_positions() >= 0)[:, :, None, :]
    query = torch.randn(B, 2 * H, 1, D)
    got = ragged.attend(query, torch.full((B, 1), N + 2), 0.25)
    torch.testing.assert_close(got, _reference(query, keys, values, 0.25, live), rtol=1e-5, atol=1e-5)
    # scoring reads the model's channels: the padded dense copy holds the same entries
    dense = ragged.to_dense()
    assert dense.kv_quant.rotate
    # key channel pruning holds the kept channels of the model's keys, unrotated (values stay rotated)
    channels = torch.arange(D)[::2].expand(B, H, -1).contiguous()
    for store in (ragged, src):
        pruned = store.with_key_channels(channels)
        assert pruned.kv_quant.rotate and not pruned.key_format.rotate and pruned.key_dim == D // 2


def test_bytes_do_not_change_with_rotation():
    a = _fed(KVQuant("int4", group_size=8, residual=3, rotate=False))[0]
    b = _fed(KVQuant("int4", group_size=8, residual=3, rotate=True))[0]
    assert a.nbytes() == b.nbytes() and a.quantized_length == b.quantized_length
