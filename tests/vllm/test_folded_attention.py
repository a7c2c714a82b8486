"""Folded attention on vLLM's CPU kernels: equal head lengths give vLLM's own result, ragged ones a reference's."""

from __future__ import annotations

import numpy as np
import pytest
import vllm_helpers  # noqa: F401  (sets vLLM environment variables before vLLM is imported)

pytest.importorskip("vllm.entrypoints")

import torch
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from kvtrim.vllm.folded_attention import (
    default_subpage_slots,
    default_subpage_table,
    folded_attention,
    folded_cache_write,
)
from kvtrim.vllm.subpages import RequestSubPages
from vllm import _custom_ops as ops

KV_HEADS, GROUP, DIM = 3, 3, 64  # SmolLM2's attention shape


def _cache(num_blocks: int, block_size: int) -> torch.Tensor:
    return torch.zeros(num_blocks, KV_HEADS, block_size, 2 * DIM)


def _vllm_write(key, value, kv_cache, slots, isa):
    nb, h, bs, _ = kv_cache.shape
    k_cache, v_cache = kv_cache.view(nb, h, 2 * bs, DIM).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slots, isa)


def _vllm_attention(query, kv_cache, qsl, seq_lens, block_table, scale, isa):
    from vllm import envs

    nb, h, bs, _ = kv_cache.shape
    k_cache, v_cache = kv_cache.view(nb, h, 2 * bs, DIM).chunk(2, dim=2)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=seq_lens.numel(),
        num_heads=query.shape[1],
        num_kv_heads=h,
        head_dim=DIM,
        seq_lens=seq_lens,
        dtype=query.dtype,
        query_start_loc=qsl,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
    )
    out = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query,
        key_cache=k_cache,
        value_cache=v_cache,
        output=out,
        query_start_loc=qsl,
        seq_lens=seq_lens,
        scale=scale,
        causal=True,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=block_table,
        softcap=0.0,
        scheduler_metadata=meta,
        s_aux=None,
    )
    return out


@pytest.mark.parametrize("block_size", [32, 128])
@pytest.mark.parametrize("q_lens", [[1, 40, 7, 1], [1, 1, 1, 1]], ids=["mixed", "decode"])
def test_equal_head_lengths_give_vllms_own_kernel_result(block_size, q_lens):
    """Mixed steps fold the query rows by gathering; decoding steps (one row per request) without a gather."""
    torch.manual_seed(0)
    isa = _get_attn_isa(torch.float32, block_size, DIM)
    seq_lens = torch.tensor([50, 300, 7, 129], dtype=torch.int32)  # decode, chunk, whole prefill, decode
    q_lens = torch.tensor(q_lens)
    qsl = torch.zeros(5, dtype=torch.int32)
    qsl[1:] = q_lens.cumsum(0)
    per_req = [-(-int(s) // block_size) for s in seq_lens]
    ids = torch.randperm(sum(per_req) + 5)[: sum(per_req)] + 1
    table = torch.zeros(4, max(per_req), dtype=torch.int32)
    slots = []
    start = 0
    for r, n in enumerate(per_req):
        table[r, :n] = ids[start : start + n].to(torch.int32)
        start += n
        pos = torch.arange(int(seq_lens[r]))
        slots.append(table[r, pos // block_size].long() * block_size + pos % block_size)
    slots = torch.cat(slots)
    keys, values = torch.randn(slots.numel(), KV_HEADS, DIM), torch.randn(slots.numel(), KV_HEADS, DIM)
    ours, theirs = _cache(int(ids.max()) + 1, block_size), _cache(int(ids.max()) + 1, block_size)
    _vllm_write(keys, values, theirs, slots, isa)
    folded_cache_write(keys, values, ours, default_subpage_slots(slots, KV_HEADS, block_size), isa)
    assert torch.equal(ours, theirs)  # one-head writes land where vLLM's multi-head writes do

    # a view into a wider row, as vLLM's query is (split from the fused QKV projection)
    qkv = torch.randn(int(qsl[-1]), (KV_HEADS * GROUP + 2 * KV_HEADS) * DIM)
    query = qkv[:, : KV_HEADS * GROUP * DIM].view(-1, KV_HEADS * GROUP, DIM)
    expected = _vllm_attention(query.contiguous(), theirs, qsl, seq_lens, table, 0.125, isa)
    got = torch.empty_like(query)
    folded_attention(
        query, ours, got, qsl, seq_lens.repeat_interleave(KV_HEADS), default_subpage_table(table, KV_HEADS), 0.125, isa
    )
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def _reference(query, keys, values, qsl, scale):
    """Gather-then-SDPA: per (request, head) its own keys/values ``[len, D]``, causal on the last query rows."""
    out = torch.empty_like(query)
    for r, per_head in enumerate(zip(keys, values, strict=True)):
        qs, qe = int(qsl[r]), int(qsl[r + 1])
        for h, (k, v) in enumerate(zip(*per_head, strict=True)):
            q = query[qs:qe, h * GROUP : (h + 1) * GROUP].transpose(0, 1)  # [G, n, D]
            n, length = qe - qs, k.shape[0]
            mask = torch.arange(length).view(1, -1) <= (length - n + torch.arange(n)).view(-1, 1)
            o = torch.nn.functional.scaled_dot_product_attention(
                q, k.expand(GROUP, -1, -1), v.expand(GROUP, -1, -1), attn_mask=mask, scale=scale
            )
            out[qs:qe, h * GROUP : (h + 1) * GROUP] = o.transpose(0, 1)
    return out


@pytest.mark.parametrize("block_size", [32, 128])
def test_ragged_head_lengths_equal_a_gather_then_sdpa_reference(block_size):
    """Heads of one request hold different counts in their own sub-pages (the allocator's), then decode."""
    torch.manual_seed(1)
    rng = np.random.default_rng(1)
    isa = _get_attn_isa(torch.float32, block_size, DIM)
    budgets, q_lens = [40, 200, 9], [1, 3, 1]
    cache = _cache(64, block_size)
    free_blocks = iter(rng.permutation(np.arange(1, 64)).tolist())
    keys, values, lengths, tables = [], [], [], []
    for budget, n in zip(budgets, q_lens, strict=True):
        counts = rng.multinomial(KV_HEADS * budget, np.ones(KV_HEADS) / KV_HEADS)
        held = -(-(budget + block_size - 1 + n) // block_size)
        pages = RequestSubPages(1, KV_HEADS, block_size, [next(free_blocks) for _ in range(held)])
        placed = pages.place(0, counts)
        new = pages.append(0, n)  # this step's tokens: [n, H]
        k = [torch.randn(int(c) + n, DIM) for c in counts]
        v = [torch.randn(int(c) + n, DIM) for c in counts]
        for h in range(KV_HEADS):  # kept entries, one head at a time, through the one-head write
            slots = torch.full((int(counts[h]), KV_HEADS), -1, dtype=torch.long)
            slots[:, h] = torch.from_numpy(placed[h])
            kk = torch.zeros(int(counts[h]), KV_HEADS, DIM)
            vv = torch.zeros_like(kk)
            kk[:, h], vv[:, h] = k[h][: counts[h]], v[h][: counts[h]]
            folded_cache_write(kk, vv, cache, slots, isa)
        step_k = torch.stack([k[h][counts[h] :] for h in range(KV_HEADS)], dim=1)  # [n, H, D]
        step_v = torch.stack([v[h][counts[h] :] for h in range(KV_HEADS)], dim=1)
        folded_cache_write(step_k, step_v, cache, torch.from_numpy(new), isa)
        pages.check()
        keys.append(k)
        values.append(v)
        lengths += pages.lengths[0].tolist()
        tables += pages.table(0)
    width = max(len(t) for t in tables)
    table = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    qsl = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32)
    query = torch.randn(int(qsl[-1]), KV_HEADS * GROUP, DIM)
    got = torch.empty_like(query)
    folded_attention(query, cache, got, qsl, torch.tensor(lengths, dtype=torch.int32), table, 0.125, isa)
    torch.testing.assert_close(got, _reference(query, keys, values, qsl, 0.125), rtol=1e-4, atol=1e-5)
