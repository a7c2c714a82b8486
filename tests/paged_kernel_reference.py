"""Pure-torch references of the two block-table attention kernels kvtrim can call, written from their documented
contracts (no CUDA needed), so the paged decode backend can be tested on a CPU.

* :func:`flash_attn_with_kvcache`: upstream flash-attn 2's paged mode (``k_cache [num_blocks, page_block_size,
  nheads_k, headdim]``, ``cache_seqlens [batch]`` int32, ``block_table [batch, max_blocks]`` int32, causal mask
  aligned bottom-right, lse ``[batch, nheads, seqlen_q]``; block size a multiple of 256).
* :func:`flash_attn_varlen_func`: vLLM's fork in paged mode (``q [total_q, nheads, headdim]``, ``cu_seqlens_q``,
  ``seqused_k``, ``block_table``; lse ``[nheads, total_q]``; block size a multiple of 16).

Both compute in float64 sequence by sequence (a reference, not a fast path) and return the output in ``q``'s dtype
and the log-sum-exp in float32. Arguments the references do not implement must keep their defaults.
"""

from __future__ import annotations

import torch


def _attend_one(q, keys, values, scale: float, causal: bool):
    """``q [sq, nh, d]`` over ``keys/values [L, hk, d]``; returns (out [sq, nh, d] float64, lse [nh, sq])."""
    sq, nh, _ = q.shape
    group = nh // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)  # query head h reads KV head h // group
    v = values.double().repeat_interleave(group, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if causal:  # bottom-right: query i sees keys j <= L - sq + i
        length = keys.shape[0]
        j = torch.arange(length)[None, :]
        i = torch.arange(sq)[:, None]
        logits = logits.masked_fill(j > length - sq + i, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    out = torch.einsum("hqk,khd->qhd", torch.exp(logits - lse[..., None]), v)
    return out, lse


def _paged_rows(cache: torch.Tensor, block_table: torch.Tensor, b: int, length: int) -> torch.Tensor:
    """The first ``length`` entries of sequence ``b``: ``[length, nheads_k, d]`` read through its block table."""
    return cache[block_table[b].long()].flatten(0, 1)[:length]


def flash_attn_with_kvcache(
    q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
    cache_leftpad=None, block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
):  # fmt: skip
    """Upstream flash-attn 2 ``flash_attn_with_kvcache`` in paged mode (no new k/v, rotary, window or softcap)."""
    assert k is None and v is None and rotary_cos is None and cache_batch_idx is None and cache_leftpad is None
    assert tuple(window_size) == (-1, -1) and softcap == 0.0 and alibi_slopes is None
    assert block_table is not None and block_table.dtype == torch.int32 and cache_seqlens.dtype == torch.int32
    assert k_cache.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    batch, sq, nh, d = q.shape
    assert nh % k_cache.shape[2] == 0
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    out = torch.empty(batch, sq, nh, d, dtype=torch.float64)
    lse = torch.empty(batch, nh, sq, dtype=torch.float64)
    for b in range(batch):
        length = int(cache_seqlens[b])
        keys = _paged_rows(k_cache, block_table, b, length)
        values = _paged_rows(v_cache, block_table, b, length)
        out[b], lse[b] = _attend_one(q[b], keys, values, scale, causal)
    out = out.to(q.dtype)
    return (out, lse.float()) if return_softmax_lse else out


def flash_attn_varlen_func(
    q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=None, seqused_k=None, q_v=None, dropout_p=0.0,
    softmax_scale=None, causal=False, window_size=None, softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False, block_table=None, return_softmax_lse=False, out=None, **fa3_only,
):  # fmt: skip
    """vLLM's fork ``vllm_flash_attn.flash_attn_varlen_func`` in paged mode (``block_table`` with ``seqused_k``)."""
    assert block_table is not None and seqused_k is not None and cu_seqlens_k is None
    assert dropout_p == 0.0 and window_size is None and softcap == 0.0 and alibi_slopes is None and out is None
    assert block_table.dtype == torch.int32 and seqused_k.dtype == torch.int32 and cu_seqlens_q.dtype == torch.int32
    assert k.shape[1] % 16 == 0, "Paged KV cache block size must be divisible by 16"
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    assert max_seqlen_k <= block_table.shape[1] * k.shape[1]
    total_q, nh, d = q.shape
    assert nh % k.shape[2] == 0
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    result = torch.empty(total_q, nh, d, dtype=torch.float64)
    lse = torch.empty(nh, total_q, dtype=torch.float64)
    for b in range(cu_seqlens_q.numel() - 1):
        start, end = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        assert end - start <= max_seqlen_q
        length = int(seqused_k[b])
        assert length <= max_seqlen_k
        keys = _paged_rows(k, block_table, b, length)
        values = _paged_rows(v, block_table, b, length)
        result[start:end], lse[:, start:end] = _attend_one(q[start:end], keys, values, scale, causal)
    result = result.to(q.dtype)
    return (result, lse.float()) if return_softmax_lse else result
