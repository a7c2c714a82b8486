"""QuantizedDenseStore: entries held as int8/int4 codes + scales with a full-precision window."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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


def _expected_bytes(fmt: KVQuant, b, h, nq, w, d, dtype_bytes=4, groups=None):
    """Bytes of ``nq`` quantized entries in ``groups`` key groups (default: whole groups only) and ``w`` in the
    window."""
    codes = 2 * b * h * nq * d * fmt.bits // 8
    key_scales = b * h * (nq // fmt.group_size if groups is None else groups) * d * 2 * 2
    value_scales = b * h * nq * (d // fmt.value_group_for(d)) * 2 * 2
    return codes + key_scales + value_scales + 2 * b * h * w * d * dtype_bytes


@pytest.mark.parametrize("name", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("residual", [0, 3])
def test_window_flushes_whole_groups_and_bytes_are_exact(name, residual):
    fmt = KVQuant(name, group_size=8, residual=residual, value_group=8, sink=0, rotate=False)
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


@pytest.mark.parametrize(
    ("spec", "residual"), [("int4:group_size=32,sink=0", 32), ("int4:group_size=32,residual=0,sink=0", 0)]
)
def test_a_32_entry_window_keeps_the_newest_32_to_63_entries_in_full_precision(spec, residual):
    """int4's default window (``DEFAULT_RESIDUAL``, KIVI's R = 32, here with KIVI's groups of 32): after a prefill and
    after every decoding step, the newest 32 to 63 entries are held exactly as appended and everything older in
    whole quantized groups; ``residual=0`` quantizes every full group (the window holds ``length % 32``)."""
    fmt = resolve_kv_quant(spec)
    assert (fmt.group_size, fmt.residual, fmt.sink) == (32, residual, 0)
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
    fmt = KVQuant("int4", group_size=8, residual=0, sink=0, rotate=False)
    store, _, _ = _filled(fmt, n=30)
    ref = DenseStore(store.keys.clone(), store.values.clone(), store.positions.clone(), store.length)
    q = torch.randn(2, 4, 1, 16)
    qpos = torch.full((2, 1), 30)
    assert torch.allclose(store.attend(q, qpos, 0.25, False), ref.attend(q, qpos, 0.25, False), atol=1e-6)
    q3 = torch.randn(2, 4, 3, 16)
    qpos3 = torch.tensor([[10, 20, 29]]).expand(2, 3)
    assert torch.allclose(store.attend(q3, qpos3, 0.25, False), ref.attend(q3, qpos3, 0.25, False), atol=1e-6)


def test_prefill_into_an_empty_store_attends_over_full_precision_entries():
    fmt = KVQuant("int4", group_size=8, residual=0, sink=0, rotate=False)
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
    fmt = KVQuant(name, group_size=8, residual=0, sink=0, rotate=False)
    store, _, _ = _filled(fmt, n=43)  # 40 quantized + 3 in the window
    before_k, before_v = store.dequantized()
    old_vc, old_vs = store._vc.clone(), store._vs.clone()
    g = torch.Generator().manual_seed(3)
    idx = torch.stack([torch.randperm(43, generator=g)[:20].sort().values for _ in range(4)]).view(2, 2, 20)
    idx[..., -1] = 42  # the newest entry survives (from the window)
    idx = idx.sort(-1).values
    store.keep(idx)
    # 20 kept, residual 0: two whole key groups of 8 and one partial group of 4, nothing in full precision
    assert (store.length, store.quantized_length, store.window_length) == (20, 20, 0)
    assert store.partial_group == (16, 4) and store._ks.shape[2] == 3
    # values quantized before keep the very same codes and scales
    from_q = idx < 40
    moved_vc = torch.gather(old_vc, 2, idx.clamp(max=39)[..., None].expand(-1, -1, -1, old_vc.shape[-1]))
    moved_vs = torch.gather(old_vs, 2, idx.clamp(max=39)[..., None].expand(-1, -1, -1, 1))
    assert torch.equal(store._vc[from_q], moved_vc[from_q]) and torch.equal(store._vs[from_q], moved_vs[from_q])
    k, v = store.dequantized()
    gather = lambda t: torch.gather(t, 2, idx[..., None].expand(-1, -1, -1, 16))  # noqa: E731
    assert torch.allclose(v[from_q], gather(before_v)[from_q], atol=1e-3)
    _assert_keys_within_their_groups(store, k, gather(before_k))
    assert torch.equal(store.positions, idx)
    assert store.nbytes() == _expected_bytes(fmt, 2, 2, 20, 0, 16, groups=3)
    store.keep(torch.arange(16).expand(2, 2, 16))  # whole groups only: no partial group
    assert store.partial_group == (0, 0)
    assert store.window_length == 0 and store.nbytes() == _expected_bytes(fmt, 2, 2, 16, 0, 16)


def _group_steps(store: QuantizedDenseStore) -> torch.Tensor:
    """``[batch, kv_heads, nq, key_dim]``: the scale of each quantized key's own group (the partial one included)."""
    g = store.kv_quant.group_size
    start, size = store.partial_group
    sizes = [g] * (store._ks.shape[2])
    if size:
        sizes[start // g] = size
    return store._ks.float().repeat_interleave(torch.tensor(sizes, dtype=torch.long), dim=2)


def _assert_keys_within_their_groups(store: QuantizedDenseStore, got: torch.Tensor, want: torch.Tensor) -> None:
    """Quantized keys within half a step of their group (its scale); fp8: within 2^-4 of each element (3 mantissa
    bits), or half a subnormal step (2^-10 of the scale) near zero. The window exactly."""
    nq = store.quantized_length
    step = _group_steps(store)
    err = (got[:, :, :nq] - want[:, :, :nq]).abs()
    bound = want[:, :, :nq].abs() * 2**-4 + step * 2**-10 if store.kv_quant.is_float else step / 2
    assert (err <= bound * 1.01 + 1e-3).all()
    assert torch.equal(got[:, :, nq:], want[:, :, nq:])


@pytest.mark.parametrize("name", ["int8", "int4", "fp8"])
@pytest.mark.parametrize(("kept", "residual"), [(21, 0), (21, 3), (24, 0), (27, 3), (2, 3)])
def test_compaction_quantizes_all_but_the_newest_residual_entries(name, kept, residual):
    """After keep(), exactly ``min(residual, kept)`` entries stay in full precision: the rest are whole key groups
    and at most one partial group with its own scales. Appends then quantize whole groups after the partial one,
    leaving the entries already quantized untouched, and attention reads what :attr:`keys` shows."""
    fmt = KVQuant(name, group_size=8, residual=residual, value_group=8, sink=0, rotate=False)
    store, _, _ = _filled(fmt, n=50, seed=5)
    before_k, _ = store.dequantized()
    g = torch.Generator().manual_seed(9)
    idx = torch.stack([torch.randperm(50, generator=g)[:kept].sort().values for _ in range(4)]).view(2, 2, kept)
    store.keep(idx)
    nq = max(kept - residual, 0)
    whole, partial = nq // 8 * 8, nq % 8
    assert (store.quantized_length, store.window_length) == (nq, kept - nq)
    assert store.partial_group == ((whole, partial) if partial else (0, 0))
    groups = whole // 8 + (partial > 0)
    assert store.nbytes() == _expected_bytes(fmt, 2, 2, nq, kept - nq, 16, groups=groups)
    k_after, _ = store.dequantized()
    _assert_keys_within_their_groups(store, k_after, torch.gather(before_k, 2, idx[..., None].expand(-1, -1, -1, 16)))
    # decoding: 20 appended tokens; whole groups leave the window after the partial group
    new_k, new_v = _kv(2, 2, 20, 16, seed=6)
    for t in range(20):
        pos = torch.full((2, 1), 50 + t)
        store.append(new_k[:, :, t : t + 1], new_v[:, :, t : t + 1], pos, padded=False)
        w = store.window_length
        assert residual <= w < residual + 8 or store.length < residual + 8
        assert store.partial_group == ((whole, partial) if partial else (0, 0))
    n_after = store.quantized_length
    assert (n_after - nq) % 8 == 0
    assert store.nbytes() == _expected_bytes(
        fmt, 2, 2, n_after, store.length - n_after, 16, groups=groups + (n_after - nq) // 8
    )
    k_end, v_end = store.dequantized()
    assert torch.equal(k_end[:, :, :nq], k_after[:, :, :nq])  # the compacted, quantized keys are untouched
    q = torch.randn(2, 4, 1, 16)
    qpos = torch.full((2, 1), 70)
    ref = DenseStore(k_end.clone(), v_end.clone(), store.positions.clone(), store.length)
    assert torch.allclose(store.attend(q, qpos, 0.25, False), ref.attend(q, qpos, 0.25, False), atol=1e-6)


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


@pytest.mark.parametrize("to", [39, 37, 35, 31, 29, 27, 22, 21, 18, 16, 10, 0])
@pytest.mark.parametrize("residual", [0, 2])
def test_truncate_across_the_partial_group(to, residual):
    """A compacted store (two whole groups of 8, a partial group of 5, then two whole groups appended after it, and
    ``residual`` entries in the window): truncating keeps every group that ends at or before ``to - residual``,
    returns the rest to the window, and forgets the partial group once its end is cut."""
    fmt = KVQuant("int8", group_size=8, residual=residual)
    store, _, _ = _filled(fmt, n=40)
    store.keep(torch.arange(21 + residual).expand(2, 2, -1))
    extra_k, extra_v = _kv(2, 2, 25, 16, seed=2)
    store.append(extra_k[:, :, :16], extra_v[:, :, :16], torch.arange(40, 56).expand(2, -1), padded=False)
    assert (store.partial_group, store.quantized_length, store.length) == ((16, 5), 37, 37 + residual)
    if to > store.length:
        return
    before = store.keys
    store.truncate(to)
    bounds = (0, 8, 16, 21, 29, 37)
    nq = 37 if to >= 37 else max(b for b in bounds if b <= max(to - residual, 0))
    assert (store.length, store.quantized_length) == (to, nq)
    assert store.partial_group == ((16, 5) if nq >= 21 else (0, 0))
    assert torch.allclose(store.keys, before[:, :, :to])
    groups = nq // 8 + (nq >= 21)
    assert store.nbytes() == _expected_bytes(fmt, 2, 2, nq, to - nq, 16, groups=groups)
    store.append(extra_k[:, :, 16:], extra_v[:, :, 16:], torch.arange(to, to + 9).expand(2, -1), padded=False)
    assert torch.allclose(store.keys[:, :, :nq], before[:, :, :nq]) and store.length == to + 9


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
    fmt = KVQuant("int4", group_size=8, residual=0, sink=0, rotate=False)
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
    fmt = KVQuant("int4", group_size=8, residual=0, sink=0, rotate=False)
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
    ("spec", "nq", "window", "sink"),
    [
        ("int4", 4063, 32, 1),  # the default: 62 whole groups of 64 and one of 31, the window, a one-entry sink
        ("int4:group_size=32,sink=0", 4064, 32, 0),  # groups of 32 (148 B per quantized entry), the window
        ("int4:group_size=32,residual=0,sink=0", 4096, 0, 0),
        ("int4:sink=0", 4064, 32, 0),  # 63 whole groups of 64 and a partial group of 32
        ("int4:residual=0,sink=0", 4096, 0, 0),
    ],
)
def test_bytes_after_keeping_an_eighth_of_a_long_context_against_1_28(spec, nq, window, sink):
    """Bytes held after a compaction to 1/8 of 32,768 float16 entries (head_dim 128), from the tensors: int4's
    default (key groups of 64, a 32-entry float16 window and a one-entry sink) holds 1/28.63 of the float16 full
    cache; key groups of 32 (148 B per quantized entry) stay above 1/28 (1/27.15 with the window); groups of 64
    without the sink 1/28.65, without the window and the sink 1/29.26. docs/quantization.md states these
    fractions (rotation changes no byte)."""
    fmt = resolve_kv_quant(spec)
    n, kept, d = LONG_CONTEXT, LONG_KEPT, LONG_HEAD_DIM
    keys, values = (x.half() for x in _kv(1, 1, n, d, seed=7))
    store = QuantizedDenseStore.empty(1, 1, d, torch.float16, "cpu", fmt)
    store.append(keys, values, torch.arange(n)[None], padded=False)
    g = torch.Generator().manual_seed(8)
    store.keep(torch.randperm(n, generator=g)[:kept].sort().values.view(1, 1, kept))
    assert (store.quantized_length, store.window_length, store.sink_length) == (nq, window, sink)
    held = store.nbytes()
    groups = -(-nq // fmt.group_size)
    assert held == _expected_bytes(fmt, 1, 1, nq, window + sink, d, dtype_bytes=2, groups=groups)
    if nq % fmt.group_size == 0:
        assert held == nq * fmt.entry_bytes(d) + (window + sink) * 2 * d * 2
    full_fp16 = n * 2 * d * 2
    meets = fmt.group_size == 64
    assert (held * 28 <= full_fp16) == meets, full_fp16 / held


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(1, 19)),
        st.tuples(st.just("keep"), st.floats(0.0, 1.0)),
        st.tuples(st.just("truncate"), st.floats(0.0, 1.0)),
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=60, deadline=None)
@given(
    ops=_OPS, residual=st.integers(0, 10), name=st.sampled_from(["int8", "int4", "fp8"]), seed=st.integers(0, 99),
    sink=st.integers(0, 3),
)  # fmt: skip
def test_any_sequence_of_appends_compactions_and_truncations_keeps_the_layout(ops, residual, name, seed, sink):
    """Whatever ran before: the sink holds the oldest ``min(sink, length)`` entries exactly; the key scales cover the
    quantized part in whole groups plus at most one partial group; the window holds less than ``residual +
    group_size`` entries (exactly ``residual`` right after a compaction of at least ``sink + residual``); the bytes
    are the codes, the scales, the window and the sink; attention reads what ``keys`` shows; entries already
    quantized keep their values across appends."""
    fmt = KVQuant(name, group_size=8, residual=residual, value_group=8, sink=sink, rotate=False)
    store, _, _ = _filled(fmt, b=1, h=2, n=30, seed=seed)
    g = torch.Generator().manual_seed(seed)
    for op, arg in ops:
        n, nq = store.length, store.sink_length + store.quantized_length
        before = store.keys
        if op == "append":
            k, v = _kv(1, 2, arg, 16, seed=seed + n)
            store.append(k, v, torch.arange(n, n + arg)[None], padded=False)
            assert torch.equal(store.keys[:, :, :nq], before[:, :, :nq])
        elif op == "keep":
            kept = round(arg * n)
            idx = torch.stack([torch.randperm(n, generator=g)[:kept].sort().values for _ in range(2)])[None]
            store.keep(idx)
            assert store.window_length == min(residual, max(kept - sink, 0))
            assert torch.equal(store.keys[:, :, : store.sink_length], before.gather(2, idx[..., None].expand(
                -1, -1, -1, 16))[:, :, : store.sink_length])  # fmt: skip
        else:
            store.truncate(round(arg * n))
            assert torch.allclose(store.keys, before[:, :, : store.length])
        start, size = store.partial_group
        ns, nq, w = store.sink_length, store.quantized_length, store.window_length
        assert ns == min(sink, store.length) and ns + nq + w == store.length and w < residual + 8
        assert nq == 0 or ns == sink  # nothing is quantized before the sink is full
        assert (0 < size < 8 and start % 8 == 0 and (nq - start - size) % 8 == 0) or (size == 0 and nq % 8 == 0)
        groups = nq // 8 + (size > 0)
        assert store._ks.shape[2] == groups == store._groups_before(nq)
        assert store.nbytes() == _expected_bytes(fmt, 1, 2, nq, w + ns, 16, groups=groups)
        if store.length:
            q = torch.randn(1, 4, 1, 16, generator=g)
            qpos = torch.full((1, 1), 1000)
            ref = DenseStore(store.keys.clone(), store.values.clone(), store.positions.clone(), store.length)
            assert torch.allclose(store.attend(q, qpos, 0.25, False), ref.attend(q, qpos, 0.25, False), atol=1e-5)


@pytest.mark.parametrize("name", ["int8", "int4", "fp8"])
def test_compaction_quantizes_kept_keys_once_from_the_prefills_float_keys(name):
    """A store made from an unquantized prefill with ``keep_source`` regroups its kept keys from the float keys:
    each kept key group holds exactly the codes of its float keys quantized in one pass, closer to them than
    keys regrouped from their codes; values move as codes either way."""
    fmt = KVQuant(name, group_size=8, residual=2, sink=1, rotate=False)
    b, h, n, d = 2, 2, 40, 16
    keys, values = _kv(b, h, n, d, seed=3)
    keys[..., 5] += 4.0  # an outlier channel
    dense = DenseStore(keys, values, torch.arange(n).expand(b, h, n).clone(), n)
    once = QuantizedDenseStore.from_dense(dense, fmt, keep_source=True)
    twice = QuantizedDenseStore.from_dense(dense, fmt)
    assert once.source_keys is not None and once.source_keys.data_ptr() == keys.data_ptr()  # a reference
    assert twice.source_keys is None
    assert once.nbytes() == twice.nbytes()  # the prefill's keys are its owner's bytes
    assert torch.equal(once.keys, twice.keys)  # scoring sees the same keys
    g = torch.Generator().manual_seed(1)
    k = 21
    idx = torch.stack([torch.randperm(n, generator=g)[:k].sort().values for _ in range(b * h)]).view(b, h, k)
    once.keep(idx)
    twice.keep(idx)
    assert once.source_keys is None  # dropped once used
    kept = keys.gather(2, idx[..., None].expand(-1, -1, -1, d))
    # 21 kept: 1 in the sink, 16 in two whole groups, a partial group of 2, 2 in the window
    assert (once.sink_length, once.quantized_length, once.window_length) == (1, 18, 2)
    kc, ks, kz = quantize_keys(kept[:, :, 1:17], fmt)
    whole = dequantize_keys(kc, ks, kz, fmt, torch.float32)
    pc, ps, pz = quantize_keys(kept[:, :, 17:19], fmt, group_size=2)
    partial = dequantize_keys(pc, ps, pz, fmt, torch.float32)
    assert torch.equal(once.keys, torch.cat([kept[:, :, :1], whole, partial, kept[:, :, 19:]], dim=2))
    assert torch.equal(once.values, twice.values)
    err_once, err_twice = (once.keys - kept).norm(), (twice.keys - kept).norm()
    assert err_once < err_twice, (float(err_once), float(err_twice))


def test_the_source_keys_go_with_any_other_change_of_the_slots():
    fmt = KVQuant("int4", group_size=8, residual=0, sink=0, rotate=False)
    keys, values = _kv(2, 2, 20, 16)
    dense = DenseStore(keys, values, torch.arange(20).expand(2, 2, 20).clone(), 20)

    def made():
        return QuantizedDenseStore.from_dense(dense, fmt, keep_source=True)

    twin = made().copy()
    assert twin.source_keys is not None  # a copy holds the same entries, made from the same keys
    appended = made()
    appended.append(keys[:, :, :1], values[:, :, :1], torch.full((2, 1), 20), padded=False)
    truncated = made()
    truncated.truncate(12)
    selected = made()
    selected.select_batch(torch.tensor([1, 0]))
    assert appended.source_keys is None and truncated.source_keys is None and selected.source_keys is None


@pytest.mark.parametrize(
    ("fmt", "n"),
    [
        (KVQuant("int4", group_size=8, residual=3, sink=1, rotate=False), 37),  # sink, quantized part, window
        (KVQuant("int8", group_size=8, residual=0, sink=0), 32),  # quantized part only
        (KVQuant("int8", group_size=8, residual=0, sink=0), 5),  # window only
        (KVQuant("fp8", group_size=8, residual=4, sink=2), 30),
    ],
)
def test_values_alone_equal_the_values_of_both(fmt, n):
    """``dequantized_values`` (what ``values`` and a compaction from the float keys read) is ``dequantized()``'s
    values, in every layout of the store, and leaves the keys alone."""
    store, _, values = _filled(fmt, n=n)
    got = store.dequantized_values()
    assert torch.equal(got, store.dequantized()[1]) and torch.equal(store.values, got)
    assert got.shape == values.shape
