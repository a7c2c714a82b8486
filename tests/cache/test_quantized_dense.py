"""QuantizedDenseStore: entries held as int8/int4 codes + scales with a full-precision window."""

from __future__ import annotations

import pytest
import torch

from kvtrim.cache.dense import INVALID, DenseStore
from kvtrim.cache.quant import KVQuant, dequantize_keys, quantize_keys, resolve_kv_quant
from kvtrim.cache.quantized_dense import QuantizedDenseStore
from kvtrim.cache.store import KVStore


def _kv(b, h, n, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, n, d, generator=g), torch.randn(b, h, n, d, generator=g)


def _filled(fmt, b=2, h=2, n=37, d=16, seed=0, step=5):
    """A store fed ``n`` tokens, ``step`` at a time, and the full-precision entries it was fed."""
    keys, values = _kv(b, h, n, d, seed)
    store = QuantizedDenseStore.empty(b, h, d, torch.float32, "cpu", fmt)
    for s in range(0, n, step):
        e = min(s + step, n)
        store.append(keys[:, :, s:e], values[:, :, s:e], torch.arange(s, e).expand(b, e - s), padded=False)
    return store, keys, values


def _expected_bytes(fmt: KVQuant, b, h, nq, w, d, dtype_bytes=4):
    codes = 2 * b * h * nq * d * fmt.bits // 8
    key_scales = b * h * (nq // fmt.group_size) * d * 2 * 2
    value_scales = b * h * nq * (d // fmt.value_group_for(d)) * 2 * 2
    return codes + key_scales + value_scales + 2 * b * h * w * d * dtype_bytes


@pytest.mark.parametrize("name", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("residual", [0, 3])
def test_window_flushes_whole_groups_and_bytes_are_exact(name, residual):
    fmt = KVQuant(name, group_size=8, residual=residual, value_group=8)
    store, keys, values = _filled(fmt)
    assert isinstance(store, KVStore)
    # 37 entries: whole groups of 8 leave the window while it holds residual + 8 or more
    nq = (37 - residual) // 8 * 8
    assert (store.quantized_length, store.window_length, store.length) == (nq, 37 - nq, 37)
    assert store.nbytes() == _expected_bytes(fmt, 2, 2, nq, 37 - nq, 16)
    assert store.entries() == 2 * 2 * 37
    # the window is held exactly; the quantized part within its steps
    k, v = store.dequantized()
    assert torch.equal(k[:, :, nq:], keys[:, :, nq:]) and torch.equal(v[:, :, nq:], values[:, :, nq:])
    tol = 0.02 if name == "int8" else 0.5
    assert (k - keys).abs().max() < tol and (v - values).abs().max() < tol
    assert (k[:, :, :nq] - keys[:, :, :nq]).abs().max() > 0  # really quantized


@pytest.mark.parametrize(("spec", "residual"), [("int4", 32), ("int4:residual=0", 0)])
def test_int4_default_keeps_its_newest_32_to_63_entries_in_full_precision(spec, residual):
    """int4's default window (``DEFAULT_RESIDUAL``, KIVI's R = 32 with groups of 32): after a prefill and after
    every decoding step, the newest 32 to 63 entries are held exactly as appended and everything older in whole
    quantized groups; ``int4:residual=0`` quantizes every full group (the window holds ``length % 32``)."""
    fmt = resolve_kv_quant(spec)
    assert (fmt.group_size, fmt.residual) == (32, residual)
    b, h, d, prefill, steps = 1, 2, 16, 100, 70
    keys, values = _kv(b, h, prefill + steps, d, seed=4)
    store = QuantizedDenseStore.empty(b, h, d, torch.float32, "cpu", fmt)
    store.append(keys[:, :, :prefill], values[:, :, :prefill], torch.arange(prefill)[None], padded=False)
    for n in range(prefill, prefill + steps + 1):
        if n > prefill:  # one decoding step
            store.append(keys[:, :, n - 1 : n], values[:, :, n - 1 : n], torch.tensor([[n - 1]]), padded=False)
        nq, w = store.quantized_length, store.window_length
        assert (nq + w, nq % 32) == (n, 0)
        assert 32 <= w <= 63 if residual else w == n % 32
        k, v = store.dequantized()
        assert torch.equal(k[:, :, nq:], keys[:, :, nq:n]) and torch.equal(v[:, :, nq:], values[:, :, nq:n])
        assert (k[:, :, :nq] != keys[:, :, :nq]).any() and (v[:, :, :nq] != values[:, :, :nq]).any()
        assert store.nbytes() == _expected_bytes(fmt, b, h, nq, w, d)


def test_key_scales_are_per_channel_per_group_of_tokens():
    fmt = KVQuant("int8", group_size=8)
    store, keys, _ = _filled(fmt, n=16)
    assert store._ks.shape == (2, 2, 2, 16)  # [batch, kv_heads, groups, head_dim]
    assert store._vs.shape == (2, 2, 16, 1)  # one scale per token (value_group = head_dim)
    ref = dequantize_keys(*quantize_keys(keys, fmt), fmt, torch.float32)
    assert torch.equal(store.keys, ref)


def test_attention_reads_the_dequantized_entries():
    fmt = KVQuant("int4", group_size=8, residual=0)
    store, _, _ = _filled(fmt, n=30)
    ref = DenseStore(store.keys.clone(), store.values.clone(), store.positions.clone(), store.length)
    q = torch.randn(2, 4, 1, 16)
    qpos = torch.full((2, 1), 30)
    assert torch.allclose(store.attend(q, qpos, 0.25, False), ref.attend(q, qpos, 0.25, False), atol=1e-6)
    q3 = torch.randn(2, 4, 3, 16)
    qpos3 = torch.tensor([[10, 20, 29]]).expand(2, 3)
    assert torch.allclose(store.attend(q3, qpos3, 0.25, False), ref.attend(q3, qpos3, 0.25, False), atol=1e-6)


def test_prefill_into_an_empty_store_attends_over_full_precision_entries():
    fmt = KVQuant("int4", group_size=8, residual=0)
    keys, values = _kv(1, 2, 16, 16)
    store = QuantizedDenseStore.empty(1, 2, 16, torch.float32, "cpu", fmt)
    store.append(keys, values, torch.arange(16)[None], padded=False)
    assert store.window_length == 0  # everything is quantized ...
    q = torch.randn(1, 4, 16, 16)
    out = store.attend(q, torch.arange(16)[None], 0.25, fresh_causal=True)
    full = DenseStore(keys, values, torch.arange(16).expand(1, 2, 16), 16)
    ref = full.attend(q, torch.arange(16)[None], 0.25, fresh_causal=True)
    assert torch.allclose(out, ref, atol=1e-6)  # ... but the prefill itself saw the full-precision entries


@pytest.mark.parametrize("name", ["int8", "int4", "fp8"])
def test_keep_moves_value_codes_and_regroups_keys(name):
    fmt = KVQuant(name, group_size=8, residual=0)
    store, _, _ = _filled(fmt, n=43)  # 40 quantized + 3 in the window
    before_k, before_v = store.dequantized()
    old_vc, old_vs = store._vc.clone(), store._vs.clone()
    g = torch.Generator().manual_seed(3)
    idx = torch.stack([torch.randperm(43, generator=g)[:20].sort().values for _ in range(4)]).view(2, 2, 20)
    idx[..., -1] = 42  # the newest entry survives (from the window)
    idx = idx.sort(-1).values
    store.keep(idx)
    assert (store.length, store.quantized_length, store.window_length) == (20, 16, 4)
    # values quantized before keep the very same codes and scales
    src = idx[:, :, :16]
    from_q = src < 40
    moved_vc = torch.gather(old_vc, 2, src.clamp(max=39)[..., None].expand(-1, -1, -1, old_vc.shape[-1]))
    moved_vs = torch.gather(old_vs, 2, src.clamp(max=39)[..., None].expand(-1, -1, -1, 1))
    assert torch.equal(store._vc[from_q], moved_vc[from_q]) and torch.equal(store._vs[from_q], moved_vs[from_q])
    k, v = store.dequantized()
    gather = lambda t: torch.gather(t, 2, idx[..., None].expand(-1, -1, -1, 16))  # noqa: E731
    assert torch.allclose(v[:, :, :16][from_q], gather(before_v)[:, :, :16][from_q], atol=1e-3)
    # regrouped keys: within half a step of their new group (the scales of the store's key groups); fp8: within
    # 2^-4 of each element (3 mantissa bits), or half a subnormal step (2^-9 of the scale) near zero
    step = store._ks.float().repeat_interleave(8, dim=2)
    want = gather(before_k)[:, :, :16]
    err = (k[:, :, :16] - want).abs()
    bound = want.abs() * 2**-4 + step * 2**-10 if fmt.is_float else step / 2
    assert (err <= bound * 1.01 + 1e-3).all()
    assert torch.equal(store.positions, idx)
    assert store.nbytes() == _expected_bytes(fmt, 2, 2, 16, 4, 16)
    store.keep(torch.arange(16).expand(2, 2, 16))  # whole groups only: the window empties
    assert store.window_length == 0 and store.nbytes() == _expected_bytes(fmt, 2, 2, 16, 0, 16)


def test_keep_mask_empties_slots_and_stats_follow():
    fmt = KVQuant("int8", group_size=4)
    store, _, _ = _filled(fmt, b=1, h=2, n=12)
    store.stat("acc")[:] = torch.arange(12, dtype=torch.float32)
    idx = torch.tensor([[[0, 5, 9, 11], [1, 2, 3, 4]]])
    mask = torch.tensor([[[True, True, True, True], [True, True, False, False]]])
    store.keep(idx, mask)
    assert store.positions.tolist() == [[[0, 5, 9, 11], [1, 2, INVALID, INVALID]]]
    assert store.stat("acc").tolist() == [[[0, 5, 9, 11], [1, 2, 3, 4]]]
    assert store.entries_per_head().tolist() == [[4, 2]] and not store.all_valid


@pytest.mark.parametrize("to", [37, 30, 16, 5, 0])
def test_truncate_returns_straddling_groups_to_the_window(to):
    fmt = KVQuant("int8", group_size=8)
    store, keys, _ = _filled(fmt, n=37)
    before = store.keys
    mark = store.mark()
    store.truncate(to)
    assert store.length == to and store.quantized_length == to // 8 * 8
    assert torch.allclose(store.keys, before[:, :, :to])
    assert store.nbytes() == _expected_bytes(fmt, 2, 2, to // 8 * 8, to - to // 8 * 8, 16)
    store.append(keys[:, :, :3], keys[:, :, :3], torch.arange(to, to + 3).expand(2, 3), padded=False)
    assert store.length == to + 3 and store.positions[0, 0, -1].item() == to + 2
    with pytest.raises(ValueError, match="cannot truncate"):
        store.truncate(mark + 10)


def test_copy_select_batch_and_from_dense():
    fmt = KVQuant("int4", group_size=8, residual=0)
    store, keys, values = _filled(fmt, n=20)
    twin = store.copy()
    store.append(keys[:, :, :1], values[:, :, :1], torch.full((2, 1), 20), padded=False)
    assert twin.length == 20 and store.length == 21
    twin.select_batch(torch.tensor([1, 1, 0]))
    assert twin.batch_size == 3 and torch.equal(twin.keys[0], twin.keys[1])
    dense = DenseStore(keys, values, torch.arange(20).expand(2, 2, 20).clone(), 20)
    q = QuantizedDenseStore.from_dense(dense, fmt)
    assert torch.equal(q.keys, _filled(fmt, n=20)[0].keys) and torch.equal(dense.keys, keys)


def test_padding_slots_do_not_change_the_quantized_keys_of_real_tokens():
    fmt = KVQuant("int4", group_size=8, residual=0)
    keys, values = _kv(1, 1, 16, 16)
    wild = keys.clone()
    wild[:, :, :3] = 1e4  # left padding with wild keys
    positions = torch.arange(-3, 13).clamp(min=-1)[None]
    stores = []
    for k in (keys, wild):
        store = QuantizedDenseStore.empty(1, 1, 16, torch.float32, "cpu", fmt)
        store.append(k, values, positions, padded=True)
        stores.append(store)
    assert stores[0].quantized_length == 16
    assert torch.equal(stores[0].keys[:, :, 3:], stores[1].keys[:, :, 3:])


# SnapKV-like 1/8 of a 32,768-token context in one KV head of Llama-3.1-8B's shape (head_dim 128, float16): every
# head of every layer holds the same, so the fraction of the float16 full cache is the model's.
LONG_CONTEXT, LONG_KEPT, LONG_HEAD_DIM = 32768, 4096, 128


@pytest.mark.parametrize(
    ("spec", "nq", "window"),
    [
        ("int4", 4064, 32),  # the default: groups of 32, a 32-entry window
        ("int4:group_size=64", 4032, 64),
        ("int4:group_size=64,residual=0", 4096, 0),
        ("int4:residual=0", 4096, 0),
    ],
)
def test_bytes_after_keeping_an_eighth_of_a_long_context_against_1_28(spec, nq, window):
    """Bytes held after a compaction to 1/8 of 32,768 float16 entries (head_dim 128), from the tensors: int4's
    default (key groups of 32 at 148 B per quantized entry, plus a 32-entry float16 window) holds 1/27.15 of the
    float16 full cache, above 1/28; key groups of 64 reach 1/28 (1/28.09 with the default window, 1/29.26
    without). docs/quantization.md states these fractions."""
    fmt = resolve_kv_quant(spec)
    n, kept, d = LONG_CONTEXT, LONG_KEPT, LONG_HEAD_DIM
    keys, values = (x.half() for x in _kv(1, 1, n, d, seed=7))
    store = QuantizedDenseStore.empty(1, 1, d, torch.float16, "cpu", fmt)
    store.append(keys, values, torch.arange(n)[None], padded=False)
    g = torch.Generator().manual_seed(8)
    store.keep(torch.randperm(n, generator=g)[:kept].sort().values.view(1, 1, kept))
    assert (store.quantized_length, store.window_length) == (nq, window)
    held = store.nbytes()
    assert held == _expected_bytes(fmt, 1, 1, nq, window, d, dtype_bytes=2)
    assert held == nq * fmt.entry_bytes(d) + window * 2 * d * 2
    full_fp16 = n * 2 * d * 2
    meets = fmt.group_size == 64
    assert (held * 28 <= full_fp16) == meets, full_fp16 / held
