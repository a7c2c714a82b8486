"""Paged decode attention for KV-Compress's per-head block tables, written in Triton, with the continual metric fused.

KV-Compress (Rehg, 2024, arXiv:2410.00161) gives every (sequence, layer, KV head) its own block table and length
and, during decoding, adds each cached key's squared attention probability (summed over the query heads of its
group) to that key's eviction metric. Upstream flash-attn's paged mode needs blocks of a multiple of 256 tokens and
vLLM's fork is rarely installed, so neither serves KV-Compress's 16-token blocks on a stock torch + triton install;
this kernel does, for any block size.

One program per kernel row (one (sequence, KV head) of one layer) serves the row's ``G`` query heads:

1. it walks the row's block table up to the row's length (read on the device), loads each block's keys and values
   once for all ``G`` heads, and keeps an online softmax in float32 (running max, running sum, rescaled
   accumulator); it writes the output ``[rows, G, d]`` in the query's dtype and the log-sum-exp ``[rows, G]``;
2. with the metric on, a second pass over the same blocks, now that ``lse`` is known, recomputes each key's
   logits, takes ``Σ_g exp(q_g·k·scale − lse_g)²`` and adds it to ``metric`` at the key's slot, skipping keys whose
   position is above ``qpos − buffer`` (when ``buffer > 0``). The keys are read twice, the values once, and nothing
   is gathered in PyTorch.

The metric update is a plain load-add-store: a slot of the pool belongs to exactly one block of one row, and one
program owns that row, so no two programs touch the same slot. The one exception is the scratch block, which every
padding row of a bucketed batch shares; its metric is never read, so a lost update there does not matter.

CUDA graphs: the launch has no host reads (lengths, block ids and query positions are loaded on the device), and
its grid is ``(rows,)``, a Python int fixed for a static batch shape; the first launch compiles, which the graph
runner's eager warm-up does before a capture.

Triton's interpreter (``TRITON_INTERPRET=1``, Triton's own debug mode) runs the same kernel on CPU tensors, which
is how the tests check it on a machine without a GPU. :func:`paged_decode` builds the kernel for the mode in force
at its call (``triton.jit`` reads ``TRITON_INTERPRET`` when it wraps a function), so setting the variable before a
call is enough; the module need not be re-imported.

This module imports ``triton``; :mod:`kvtrim.cache.paged_kernels` imports it only when the Triton kernel is chosen.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..errors import InvalidParameterError
from .paged_kernels import FusedMetric


def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, out_ptr, lse_ptr, metric_ptr, pos_ptr, qpos_ptr,
    stride_qr, stride_qg, stride_tr, stride_or, stride_og, heads, scale, buffer,
    G: tl.constexpr, G_PAD: tl.constexpr, BS: tl.constexpr, BS_PAD: tl.constexpr, D: tl.constexpr,
    D_PAD: tl.constexpr, METRIC: tl.constexpr,
):  # fmt: skip
    """One program per kernel row; see the module docstring. ``*_PAD`` are powers of two >= the true sizes."""
    row = tl.program_id(0)
    offs_g = tl.arange(0, G_PAD)
    offs_s = tl.arange(0, BS_PAD)
    offs_d = tl.arange(0, D_PAD)
    g_ok = offs_g < G
    s_ok = offs_s < BS
    d_ok = offs_d < D
    q_off = row * stride_qr + offs_g[:, None] * stride_qg + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32) * scale
    length = tl.load(len_ptr + row)
    n_blocks = tl.cdiv(length, BS)

    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for j in range(0, n_blocks):
        block = tl.load(table_ptr + row * stride_tr + j).to(tl.int64)
        ok = s_ok & (j * BS + offs_s < length)  # every block visited holds at least one stored key
        kv_off = (block * BS + offs_s)[:, None] * D + offs_d[None, :]
        kv_mask = ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        logits = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G_PAD, BS_PAD]
        logits = tl.where(ok[None, :], logits, float("-inf"))
        m_new = tl.maximum(m, tl.max(logits, axis=1))
        alpha = tl.exp(m - m_new)  # 0 on the first block (m = -inf, m_new finite)
        p = tl.exp(logits - m_new[:, None])
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new

    lse = m + tl.log(l_sum)
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]  # an empty row (never in decode) gives 0, not NaN
    o_off = row * stride_or + offs_g[:, None] * stride_og + offs_d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + row * G + offs_g, lse, mask=g_ok)

    if METRIC:
        qpos = tl.load(qpos_ptr + row // heads)
        for j in range(0, n_blocks):
            block = tl.load(table_ptr + row * stride_tr + j).to(tl.int64)
            ok = s_ok & (j * BS + offs_s < length)
            slot = block * BS + offs_s
            k = tl.load(k_ptr + slot[:, None] * D + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
            logits = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
            p = tl.exp(logits - lse[:, None])
            p = tl.where(g_ok[:, None] & ok[None, :], p, 0.0)  # where, not a product: a masked logit may be inf
            sq = tl.sum(p * p, axis=0)  # [BS_PAD]
            kpos = tl.load(pos_ptr + slot, mask=ok, other=0)
            # buffer 0 counts every stored key (all were written at or before the query's position)
            counted = ok & (kpos <= qpos - buffer)
            # Race-free: this program is the only one holding this row's blocks (module docstring).
            current = tl.load(metric_ptr + slot, mask=counted, other=0.0)
            tl.store(metric_ptr + slot, current + sq, mask=counted)


@functools.cache
def _jitted(interpret: bool):
    """The kernel wrapped by ``triton.jit`` in the mode in force (``interpret`` is the cache key only)."""
    return triton.jit(_paged_decode_kernel)


def interpreter_on() -> bool:
    """Whether Triton's interpreter is on (``TRITON_INTERPRET``, read now)."""
    return bool(triton.knobs.runtime.interpret)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqlens: torch.Tensor,
    block_table: torch.Tensor,
    max_seqlen_k: int,
    scale: float,
    metric: FusedMetric | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode query per kernel row through the row's block table (the ``PagedCall`` of
    :mod:`kvtrim.cache.paged_kernels`), the continual metric fused when ``metric`` is given.

    Args:
        q: ``[B, G, d]``, the ``G`` query heads reading row ``b``'s KV head
        k_cache, v_cache: ``[num_blocks, block_size, 1, d]`` (the pool's keys/values viewed with one KV head)
        seqlens: ``[B]`` int, each row's entries (read on the device)
        block_table: ``[B, W]`` int block ids (entries beyond a row's blocks are never read)
        max_seqlen_k: unused (the lengths bound the loop; kept for the shared calling convention)
        scale: softmax scale applied to ``q·k``
        metric: the fused KV-Compress metric update, or None
    Returns:
        ``(out [B, G, d]`` in ``q``'s dtype, ``lse [B, G]`` float32 log-sum-exp of the scaled logits)
    """
    del max_seqlen_k
    rows, g, d = q.shape
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    keys = k_cache.reshape(num_blocks, block_size, d)
    values = v_cache.reshape(num_blocks, block_size, d)
    if not (keys.is_contiguous() and values.is_contiguous()):
        raise InvalidParameterError("the KV pool must be contiguous [num_blocks, block_size, head_dim]")
    if q.stride(-1) != 1:
        q = q.contiguous()
    seqlens = seqlens.contiguous()
    block_table = block_table.contiguous()
    out = torch.empty(rows, g, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(rows, g, dtype=torch.float32, device=q.device)
    if metric is None:  # unused pointers (METRIC is off): any tensor of the device
        metric_t, pos_t, qpos_t, heads, buffer = lse, seqlens, seqlens, 1, 0
    else:
        metric_t, pos_t = metric.metric, metric.positions
        qpos_t, heads, buffer = metric.qpos.reshape(-1).contiguous(), metric.heads, metric.buffer
        if not (metric_t.is_contiguous() and pos_t.is_contiguous()):
            raise InvalidParameterError("the pool's metric and positions must be contiguous")
    if rows == 0:
        return out, lse
    _jitted(interpreter_on())[(rows,)](
        q, keys, values, block_table, seqlens, out, lse, metric_t, pos_t, qpos_t,
        q.stride(0), q.stride(1), block_table.stride(0), out.stride(0), out.stride(1), heads, float(scale), buffer,
        G=g, G_PAD=_pow2(g), BS=block_size, BS_PAD=_pow2(block_size), D=d, D_PAD=_pow2(d), METRIC=metric is not None,
    )  # fmt: skip
    return out, lse
