"""Paged decode attention through a block-table kernel (kvtrim.cache.paged_kernels), tested on a CPU.

The CUDA kernels cannot run here: pure-torch references of their documented contracts (tests/paged_kernel_reference.py)
are injected through the kernel lookup, and the device/dtype checks are opened for float32 on CPU through the
module's two check functions. The references themselves are checked against dense SDPA first.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import paged_kernel_reference as ref
from kvtrim.cache import paged_kernels
from kvtrim.cache.paged import BlockPool, PagedBatchCache, PagedSequence
from kvtrim.errors import InvalidParameterError
from kvtrim.selection.block_eviction import apply_evictions, schedule_evictions

torch.set_num_threads(1)

FAKES = {"vllm_flash_attn": 16, "flash_attn": 256}  # fake kernel -> the block size its tests use


def use_fake_kernels(monkeypatch, *names: str) -> None:
    """Make ``names`` the importable kernels and let them run float32 on the CPU (test-only seam)."""
    fork = ref.flash_attn_varlen_func if "vllm_flash_attn" in names else None
    upstream = ref.flash_attn_with_kvcache if "flash_attn" in names else None
    monkeypatch.setattr(paged_kernels, "_load_vllm_fork", lambda: fork)
    monkeypatch.setattr(paged_kernels, "_load_flash_attn", lambda: upstream)
    monkeypatch.setattr(paged_kernels, "_device_supported", lambda device: True)
    monkeypatch.setattr(paged_kernels, "_dtype_supported", lambda dtype: True)


# ---------------------------------------------------------------------------------------------------- references
def _dense(q, keys, values, scale, causal=False):
    """SDPA of ``q [sq, nh, d]`` over ``keys/values [L, hk, d]`` (GQA), bottom-right causal if asked."""
    sq, length = q.shape[0], keys.shape[0]
    mask = None
    if causal:
        mask = torch.arange(length)[None, :] <= length - sq + torch.arange(sq)[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        attn_mask=mask, scale=scale, enable_gqa=True,
    )  # fmt: skip
    group = q.shape[1] // keys.shape[1]
    logits = torch.einsum("qhd,khd->hqk", q, keys.repeat_interleave(group, 1)) * scale
    if causal:
        logits = logits.masked_fill(~mask, float("-inf"))
    return out[0].transpose(0, 1), torch.logsumexp(logits, -1)


@pytest.mark.parametrize("name", list(FAKES))
def test_reference_kernels_equal_dense_attention(name):
    g = torch.Generator().manual_seed(0)
    bs, nh, hk, d = FAKES[name], 4, 2, 8
    k_cache = torch.randn(5, bs, hk, d, generator=g)
    v_cache = torch.randn(5, bs, hk, d, generator=g)
    table = torch.tensor([[3, 1, 4], [0, 2, 2]], dtype=torch.int32)  # the second row's 3rd entry is never read
    seqlens = torch.tensor([2 * bs + 3, bs - 5], dtype=torch.int32)
    scale = 0.3
    dense_keys = [torch.cat([k_cache[3], k_cache[1], k_cache[4][:3]]), k_cache[0][: bs - 5]]
    dense_values = [torch.cat([v_cache[3], v_cache[1], v_cache[4][:3]]), v_cache[0][: bs - 5]]
    for sq, causal in ((1, False), (3, True)):
        q = torch.randn(2, sq, nh, d, generator=g)
        if name == "flash_attn":
            out, lse = ref.flash_attn_with_kvcache(
                q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, softmax_scale=scale, causal=causal,
                return_softmax_lse=True,
            )  # fmt: skip
            lse = lse.transpose(1, 2)  # [B, nh, sq] -> [B, sq, nh]
        else:
            cu = torch.arange(3, dtype=torch.int32) * sq
            out, lse = ref.flash_attn_varlen_func(
                q.reshape(2 * sq, nh, d), k_cache, v_cache, max_seqlen_q=sq, cu_seqlens_q=cu,
                max_seqlen_k=3 * bs, seqused_k=seqlens, softmax_scale=scale, causal=causal, block_table=table,
                return_softmax_lse=True,
            )  # fmt: skip
            out, lse = out.view(2, sq, nh, d), lse.T.reshape(2, sq, nh)
        for b in range(2):
            want_out, want_lse = _dense(q[b], dense_keys[b], dense_values[b], scale, causal)
            torch.testing.assert_close(out[b], want_out, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse[b], want_lse.T, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------- the backend
def _config(layers=2, heads=4, kv_heads=2, head_dim=8):
    return SimpleNamespace(
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        hidden_size=heads * head_dim,
    )  # fmt: skip


def _forward(cache: PagedBatchCache, rows: int, q_len: int, g: torch.Generator, positions=None):
    """One 'forward' through every layer with random q/k/v; returns per layer (q, out)."""
    cfg = _config()
    outs = []
    for layer in cache.layers:
        q = torch.randn(rows, cfg.num_attention_heads, q_len, cfg.head_dim, generator=g)
        k = torch.randn(rows, cache.kv_heads, q_len, cfg.head_dim, generator=g)
        v = torch.randn(rows, cache.kv_heads, q_len, cfg.head_dim, generator=g)
        cache.update(k, v, layer.layer_idx)
        outs.append((q, layer.attend(None, q, positions, None, cfg.head_dim**-0.5)))
    return outs


def _uneven_batch(seed: int, block_size: int, lengths: tuple[int, ...]):
    """Prefilled sequences with random evictions per (layer, head) and a random metric already in the pool."""
    cfg, g = _config(), torch.Generator().manual_seed(seed)
    blocks = sum(2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (t // block_size + 2) for t in lengths)
    pool = BlockPool(blocks, block_size, cfg.head_dim, torch.float32, scratch=True)
    seqs = []
    for t in lengths:
        seq = PagedSequence(pool, cfg.num_hidden_layers, cfg.num_key_value_heads)
        _forward(PagedBatchCache(cfg, pool, [seq]), 1, t, g)
        plan = schedule_evictions(seq, blocks_to_evict=0, protected_window=0)
        for r in range(seq.num_rows):
            n = int(seq.row_lengths()[r])
            k = int(torch.randint(0, n // 2, (1,), generator=g))  # up to half of a row
            plan.evicted[r] = torch.randperm(n - 1, generator=g)[:k].sort().values
        apply_evictions(seq, plan)
        seqs.append(seq)
    pool.metric.copy_(torch.rand(pool.metric.shape, generator=g))
    return cfg, pool, seqs, g


def _decode(kernel: str, seed: int, block_size: int, lengths, *, accumulate: bool, buffer: int, pad: int = 0):
    cfg, pool, seqs, g = _uneven_batch(seed, block_size, lengths)
    lens = torch.stack([s.lengths() for s in seqs])
    positions = torch.tensor([[s.seen] for s in seqs] + [[0]] * pad)
    cache = PagedBatchCache(
        cfg, pool, seqs, accumulate_decode_metric=accumulate, buffer=buffer, bucketed=pad > 0, decode_kernel=kernel
    )
    outs = _forward(cache, len(seqs) + pad, 1, g, positions)
    return cache, [out[: len(seqs)] for _, out in outs], pool, lens


@pytest.mark.parametrize("name", list(FAKES))
@pytest.mark.parametrize(("accumulate", "buffer", "pad"), [(False, 0, 0), (True, 0, 0), (True, 3, 0), (True, 2, 2)])
def test_kernel_decode_equals_gather_path(monkeypatch, name, accumulate, buffer, pad):
    use_fake_kernels(monkeypatch, name)
    bs = FAKES[name]
    lengths = (2 * bs + 5, bs + 9, 7) if bs == 16 else (bs + 40, 30)
    gather_cache, want, gather_pool, lens = _decode("gather", 4, bs, lengths, accumulate=accumulate, buffer=buffer,
                                                    pad=pad)  # fmt: skip
    cache, got, pool, _ = _decode("flash", 4, bs, lengths, accumulate=accumulate, buffer=buffer, pad=pad)
    assert gather_cache.decode_kernel_name == "gather" and cache.decode_kernel_name == name
    assert len(set(lens.flatten().tolist())) > 3  # heads and sequences really hold different counts
    assert int(lens.max()) > bs  # some rows span several blocks
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool.metric, gather_pool.metric, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(pool.keys, gather_pool.keys, atol=0, rtol=0)  # the same entries were written
    if accumulate:
        assert not torch.equal(pool.metric, _uneven_batch(4, bs, lengths)[1].metric)  # the metric did move


def test_kernel_is_called_once_per_layer_and_prefill_stays_on_gather(monkeypatch):
    use_fake_kernels(monkeypatch, "vllm_flash_attn")
    calls = []
    fake = ref.flash_attn_varlen_func
    counted = lambda *a, **kw: calls.append(1) or fake(*a, **kw)  # noqa: E731
    monkeypatch.setattr(paged_kernels, "_load_vllm_fork", lambda: counted)
    cfg, pool, seqs, g = _uneven_batch(5, 16, (20, 33))
    prefill = PagedBatchCache(cfg, pool, seqs, decode_kernel="flash")
    assert calls == [1]  # the one test call that chose the kernel (cached: not repeated below)
    calls.clear()
    _forward(prefill, 2, 3, g, torch.tensor([[s.seen + i for i in range(3)] for s in seqs]))
    assert not calls  # several queries per sequence: gather path
    positions = torch.tensor([[s.seen] for s in seqs])
    _forward(PagedBatchCache(cfg, pool, seqs, decode_kernel="flash"), 2, 1, g, positions)
    assert len(calls) == cfg.num_hidden_layers


# ---------------------------------------------------------------------------------------------------- selection
def test_auto_on_cpu_is_gather_and_flash_on_cpu_raises():
    cfg = _config()
    pool = BlockPool(8, 16, cfg.head_dim, torch.float32)
    seq = PagedSequence(pool, cfg.num_hidden_layers, cfg.num_key_value_heads)
    assert PagedBatchCache(cfg, pool, [seq], decode_kernel="auto").decode_kernel_name == "gather"
    assert PagedBatchCache(cfg, pool, [seq]).decode_kernel_name == "gather"  # the default
    with pytest.raises(InvalidParameterError, match=r"decode_kernel='flash'.*CUDA device.*cpu"):
        PagedBatchCache(cfg, pool, [seq], decode_kernel="flash")
    with pytest.raises(InvalidParameterError, match="decode_kernel must be one of auto, gather, flash"):
        PagedBatchCache(cfg, pool, [seq], decode_kernel="paged")


def test_flash_names_each_unmet_condition(monkeypatch):
    resolve = paged_kernels.resolve_decode_kernel
    monkeypatch.setattr(paged_kernels, "_device_supported", lambda device: True)  # dtype check stays strict
    monkeypatch.setattr(paged_kernels, "_load_vllm_fork", lambda: ref.flash_attn_varlen_func)
    monkeypatch.setattr(paged_kernels, "_load_flash_attn", lambda: None)
    with pytest.raises(InvalidParameterError, match=r"float16 or bfloat16.*float32"):
        resolve("flash", device="cpu", dtype=torch.float32, block_size=16, head_dim=64)
    assert resolve("auto", device="cpu", dtype=torch.float32, block_size=16, head_dim=64) is None
    assert resolve("flash", device="cpu", dtype=torch.bfloat16, block_size=16, head_dim=64).name == "vllm_flash_attn"
    with pytest.raises(InvalidParameterError, match="head_dim a multiple of 8 and at most 256, got 12"):
        resolve("flash", device="cpu", dtype=torch.float16, block_size=16, head_dim=12)
    with pytest.raises(InvalidParameterError, match=r"block_size=8 is not allowed.*vllm_flash_attn needs .* of 16"):
        resolve("flash", device="cpu", dtype=torch.float16, block_size=8, head_dim=64)
    # upstream flash-attn only: KV-Compress's block size 16 is refused (paged mode needs multiples of 256)
    monkeypatch.setattr(paged_kernels, "_load_vllm_fork", lambda: None)
    monkeypatch.setattr(paged_kernels, "_load_flash_attn", lambda: ref.flash_attn_with_kvcache)
    with pytest.raises(InvalidParameterError, match=r"block_size=16 is not allowed.*flash_attn needs .* of 256"):
        resolve("flash", device="cpu", dtype=torch.float16, block_size=16, head_dim=64)
    assert resolve("auto", device="cpu", dtype=torch.float16, block_size=16, head_dim=64) is None
    assert resolve("auto", device="cpu", dtype=torch.float16, block_size=512, head_dim=64).name == "flash_attn"
    # both: the fork comes first
    monkeypatch.setattr(paged_kernels, "_load_vllm_fork", lambda: ref.flash_attn_varlen_func)
    assert resolve("auto", device="cpu", dtype=torch.float16, block_size=256, head_dim=64).name == "vllm_flash_attn"
    monkeypatch.setattr(paged_kernels, "_load_vllm_fork", lambda: None)
    monkeypatch.setattr(paged_kernels, "_load_flash_attn", lambda: None)
    with pytest.raises(InvalidParameterError, match=r"neither vLLM's flash-attention fork .* is importable"):
        resolve("flash", device="cpu", dtype=torch.float16, block_size=16, head_dim=64)


def test_flash_error_leaves_the_pool_unchanged():
    cfg = _config()
    pool = BlockPool(8, 16, cfg.head_dim, torch.float32)
    seq = PagedSequence(pool, cfg.num_hidden_layers, cfg.num_key_value_heads)
    with pytest.raises(InvalidParameterError):
        PagedBatchCache(cfg, pool, [seq], decode_kernel="flash")
    assert pool.num_free == 8 and seq.entries() == 0
