"""Pure-torch references of the flash-attention kernels kvtrim can call, written from their documented contracts
(no CUDA needed), so the paged decode backend and the ragged flash decode can be tested on a CPU.

* :func:`flash_attn_with_kvcache`: upstream flash-attn 2's paged mode (``k_cache [num_blocks, page_block_size,
  nheads_k, headdim]``, ``cache_seqlens [batch]`` int32, ``block_table [batch, max_blocks]`` int32, causal mask
  aligned bottom-right, lse ``[batch, nheads, seqlen_q]``; block size a multiple of 256).
* :func:`flash_attn_varlen_func`: vLLM's fork in paged mode (``q [total_q, nheads, headdim]``, ``cu_seqlens_q``,
  ``seqused_k``, ``block_table``; lse ``[nheads, total_q]``; block size a multiple of 16).

* :func:`reference_varlen`: upstream flash-attn 2's ``flash_attn_varlen_func`` without a block table (``q
  [total_q, nheads, headdim]``, ``k/v [total_k, nheads_k, headdim]``, ``cu_seqlens_q/k [batch + 1]`` int32).

All compute in float64 sequence by sequence (a reference, not a fast path) and return the output in ``q``'s dtype
and the log-sum-exp in float32. Arguments the references do not implement must keep their defaults.

The varlen references enforce the shape rules of flash-attn 2's ``mha_varlen_fwd`` (``csrc/flash_attn/flash_api.cpp``
at Dao-AILab/flash-attention@0251105a2fb19d2957484b7f023cd8c115286ced; vLLM's fork keeps the same entry point),
:func:`check_varlen_shapes`. The one that bites decode layouts: with ``max_seqlen_q == 1`` and more query heads than
KV heads (no window, dropout or ALiBi, ``head_size % 8 == 0``), the kernel views ``q`` as ``[batch, nheads_k,
ngroups, d]`` with ``batch = len(cu_seqlens_q) - 1`` and stops reading ``cu_seqlens_q``: sequence ``b``'s query is
row ``b`` of ``q``, so ``total_q`` must equal ``batch`` (every sequence exactly one query), else the view fails.
The dtype rule (fp16/bf16 only) is not enforced here, so the references also run float32 on a CPU; kvtrim checks
the dtype itself before it calls a kernel.
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


def check_varlen_shapes(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, *, paged: bool, window=None, dropout_p=0.0,
    alibi_slopes=None, seqused_k=None, block_table=None,
) -> bool:  # fmt: skip
    """The checks ``mha_varlen_fwd`` makes before launching (raises ``RuntimeError`` with the kernel's message).
    Returns whether the kernel takes its ``seqlen_q == 1`` GQA path (queries read by row, ``cu_seqlens_q`` unused)."""

    def check(ok: bool, message: str) -> None:
        if not ok:
            raise RuntimeError(message)

    check(cu_seqlens_q.dtype == torch.int32, "cu_seqlens_q must have dtype int32")
    check(cu_seqlens_k is None or cu_seqlens_k.dtype == torch.int32, "cu_seqlens_k must have dtype int32")
    check(q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1, "Input tensor must have contiguous last dim")
    check(cu_seqlens_q.is_contiguous(), "cu_seqlens_q must be contiguous")
    batch = cu_seqlens_q.numel() - 1
    total_q, nheads, head_size = q.shape
    nheads_k = k.shape[2] if paged else k.shape[1]
    window = (-1, -1) if window is None else tuple(window)
    swapped = (
        max_seqlen_q == 1 and nheads > nheads_k and window[0] < 0 and window[1] < 0 and dropout_p == 0.0
        and head_size % 8 == 0 and alibi_slopes is None
    )  # fmt: skip
    if swapped:  # q.reshape({batch_size, num_heads_k, ngroups, head_size})
        check(
            total_q * nheads == batch * nheads_k * (nheads // nheads_k),
            f"shape '[{batch}, {nheads_k}, {nheads // nheads_k}, {head_size}]' is invalid for input of size "
            f"{q.numel()}",
        )
    check(batch > 0, "batch size must be positive")
    check(head_size <= 256, "FlashAttention forward only supports head dimension at most 256")
    check(head_size % 8 == 0, "query, key, value, and out_ must have a head_size that is a multiple of 8")
    check(nheads % nheads_k == 0, "Number of heads in key/value must divide number of heads in query")
    check(cu_seqlens_q.shape == (batch + 1,), "cu_seqlens_q must have shape (batch_size + 1)")
    check(cu_seqlens_k is None or cu_seqlens_k.shape == (batch + 1,), "cu_seqlens_k must have shape (batch_size + 1)")
    check(k.shape == v.shape, "key and value must have the same shape")
    check(seqused_k is None or seqused_k.shape == (batch,), "seqused_k must have shape (batch_size)")
    check(block_table is None or block_table.shape[0] == batch, "block_table must have shape (batch_size, max_blocks)")
    return swapped


def reference_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False,
    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
    block_table=None,
):  # fmt: skip
    """Upstream flash-attn 2 ``flash_attn_varlen_func`` (no block table, dropout, window, softcap or ALiBi): sequence
    ``i`` is rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` of ``q`` over rows ``cu_seqlens_k[i]:cu_seqlens_k[i+1]`` of
    ``k``/``v``; a sequence with no key gives zeros. Enforces :func:`check_varlen_shapes`, including its
    ``seqlen_q == 1`` GQA path, where sequence ``b``'s query is row ``b`` whatever ``cu_seqlens_q`` says."""
    assert block_table is None and dropout_p == 0.0 and tuple(window_size) == (-1, -1) and softcap == 0.0
    assert alibi_slopes is None and not return_attn_probs
    swapped = check_varlen_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, paged=False)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(cu_seqlens_q.numel() - 1):
        qa, qb = (b, b + 1) if swapped else (int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]))
        ka, kb = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        assert qb - qa <= max_seqlen_q and kb - ka <= max_seqlen_k and ka <= kb <= k.shape[0]
        if qb > qa and kb > ka:
            out[qa:qb] = _attend_one(q[qa:qb], k[ka:kb], v[ka:kb], scale, causal)[0]
    return out.to(q.dtype)


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
    swapped = check_varlen_shapes(
        q, k, v, cu_seqlens_q, None, max_seqlen_q, paged=True, seqused_k=seqused_k, block_table=block_table
    )
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    assert max_seqlen_k <= block_table.shape[1] * k.shape[1]
    total_q, nh, d = q.shape
    assert nh % k.shape[2] == 0
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    result = torch.empty(total_q, nh, d, dtype=torch.float64)
    lse = torch.empty(nh, total_q, dtype=torch.float64)
    for b in range(cu_seqlens_q.numel() - 1):
        start, end = (b, b + 1) if swapped else (int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]))
        assert end - start <= max_seqlen_q
        length = int(seqused_k[b])
        assert length <= max_seqlen_k
        keys = _paged_rows(k, block_table, b, length)
        values = _paged_rows(v, block_table, b, length)
        result[start:end], lse[:, start:end] = _attend_one(q[start:end], keys, values, scale, causal)
    result = result.to(q.dtype)
    return (result, lse.float()) if return_softmax_lse else result
