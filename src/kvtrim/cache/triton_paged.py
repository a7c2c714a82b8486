"""Paged decode attention for KV-Compress's per-head block tables, written in Triton: split-K (flash-decoding) over
each row, ``tl.dot`` over the query group, the continual metric fused and exact.

KV-Compress (Rehg, 2024, arXiv:2410.00161) gives every (sequence, layer, KV head) its own block table and length
and, during decoding, adds each cached key's squared attention probability (summed over the query heads of its
group) to that key's eviction metric. Upstream flash-attn's paged mode needs blocks of a multiple of 256 tokens and
vLLM's fork is rarely installed, so neither serves KV-Compress's 16-token blocks on a stock torch + triton install;
this kernel does, for any block size.

A kernel row is one (sequence, KV head) of one layer, read by its ``G`` query heads. Two launches per layer:

1. **Partial** (grid ``(rows, splits)``): each program takes a contiguous range of ``chunk`` tokens of its row
   (a *split*), walks it ``BLOCK_N`` tokens per loop step (the tokens' block ids are read from the block table per
   token, so a step spans several pages, or part of one, whatever the block size), computes the logits of the whole
   query group with one ``tl.dot`` (the group padded to 16 rows, ``tl.dot``'s minimum) and ``P·V`` with another,
   and keeps an online softmax in float32 (log2 domain). It writes the split's running max ``m``, sum ``l`` and
   unnormalised accumulator ``acc [G, d]`` (float32). With the metric on it also writes each token's scaled logits
   ``[G]`` (float32) to a scores buffer.
2. **Combine** (grid ``(rows, 1)``, or ``(rows, splits)`` with the metric): every program merges the row's splits
   with log-sum-exp rescaling (``M = max m_s``, ``L = Σ l_s·2^(m_s−M)``, ``lse = M + log2 L``); the split-0 program
   writes the output ``Σ acc_s·2^(m_s−M) / L`` in the query's dtype and ``lse`` (natural log, float32). With the
   metric on, program ``(row, s)`` then reads split ``s``'s stored logits, takes ``Σ_g 2^(2(s_g − lse_g))`` per
   key (the squared probability, exact: the same logits that made ``lse``) and adds it to ``metric`` at the key's
   slot, skipping keys whose position is above ``qpos − buffer`` (when ``buffer > 0``).

Why store the logits rather than re-read the keys for the metric: a split cannot know the row's final ``lse``, so
the probabilities need a second pass. Re-reading ``K`` costs ``d·elt`` bytes per key (256 for bf16, d = 128: half
again the K/V traffic); the logits cost ``4·G`` bytes written and read (16 each for G = 4). Without the metric
(``METRIC`` is a compile-time flag) nothing of it is stored, read or launched.

The metric update is a plain load-add-store: a slot of the pool belongs to exactly one block of one row, and one
program owns each (row, token range), so no two programs touch the same slot. The one exception is the scratch
block, which every padding row of a bucketed batch shares; its metric is never read, so a lost update there does
not matter.

Splits: :func:`split_plan` picks ``(splits, chunk)`` from the number of rows, the longest possible row (the block
table's width times the block size, a host int fixed for a static batch shape) and the device's SM count, aiming at
about ``2 × SMs`` programs with at least 256 tokens each (batch 1 × 32k, 8 KV heads: 32 splits of 1,024 tokens,
256 programs on an H100's 132 SMs; batch 32 × 2k: 2 splits). Tokens are loaded ``BLOCK_N`` at a time with
``(BLOCK_N, num_warps, num_stages)`` autotuned over a few configurations keyed on head_dim, group and block size
(one configuration under the interpreter).

CUDA graphs: no host reads (lengths, block ids and query positions are loaded on the device); the grids and the
partial buffers' shapes depend only on ``(rows, G, d, table width, block size)``, fixed for a static batch shape;
the first launch compiles and autotunes, which the graph runner's eager warm-up does before a capture.

Triton's interpreter (``TRITON_INTERPRET=1``, Triton's own debug mode) runs the same kernels on CPU tensors, which
is how the tests check them on a machine without a GPU. :func:`paged_decode` builds the kernels for the mode in
force at its call (``triton.jit`` reads ``TRITON_INTERPRET`` when it wraps a function), so setting the variable
before a call is enough; the module need not be re-imported.

The host side of a launch (the checks, the output and partial buffers, the split plan, the metric's pointers, the
two launches) is :func:`split_k_decode`, which :mod:`kvtrim.cache.triton_paged_quant` shares with a partial kernel
of its own.

This module imports ``triton``; :mod:`kvtrim.cache.paged_kernels` imports it only when the Triton kernel is chosen.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from ..errors import InvalidParameterError
from .paged_kernels import FusedMetric

LOG2E = 1.4426950408889634
MIN_SPLIT_TOKENS = 256  # below this a split's fixed cost (its partial write, the combine's read) starts to show
CHUNK_ALIGN = 128  # split boundaries on a multiple of every autotuned BLOCK_N
MAX_SPLITS = 64
PROGRAMS_PER_SM = 2
INTERPRETER_SMS = 8  # a nominal SM count for the interpreter (no device to ask)
METRIC_BLOCK = 128  # tokens per loop step of the combine kernel's metric pass


def _partial_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, m_ptr, l_ptr, acc_ptr, score_ptr,
    stride_qr, stride_qg, stride_tr, chunk, score_len, n_splits, scale_log2,
    G: tl.constexpr, G_PAD: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    METRIC: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Program ``(row, split)``: the split's online softmax over tokens ``[split·chunk, min((split+1)·chunk,
    length))``, written as ``m, l [rows, splits, G]`` and ``acc [rows, splits, G, D]`` (float32, log2 domain)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    offs_g = tl.arange(0, G_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    g_ok = offs_g < G
    d_ok = offs_d < D
    q = tl.load(q_ptr + row * stride_qr + offs_g[:, None] * stride_qg + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
    if DOT_F32:
        q = q.to(tl.float32)
    length = tl.load(len_ptr + row)
    start = split * chunk
    end = tl.minimum(start + chunk, length)
    table_row = table_ptr + row.to(tl.int64) * stride_tr
    score_row = score_ptr + (row.to(tl.int64) * G + offs_g[:, None]) * score_len

    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + offs_n
        ok = t < end  # the first token of every step is inside the split: no step is all masked
        block = tl.load(table_row + t // BS, mask=ok, other=0).to(tl.int64)
        kv_off = (block * BS + t % BS)[:, None] * D + offs_d[None, :]
        kv_mask = ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [G_PAD, BLOCK_N]
        s = tl.where(ok[None, :], s, float("-inf"))
        if METRIC:
            tl.store(score_row + t[None, :], s, mask=g_ok[:, None] & ok[None, :])
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)  # 0 on the first step (m = -inf, m_new finite)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        p = p.to(v_ptr.dtype.element_ty)  # P·V in the cache's dtype, as flash attention does
        if DOT_F32:
            p, v = p.to(tl.float32), v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m = m_new

    part = row.to(tl.int64) * n_splits + split
    tl.store(m_ptr + part * G + offs_g, m, mask=g_ok)  # an empty split: -inf, 0 and 0
    tl.store(l_ptr + part * G + offs_g, l_sum, mask=g_ok)
    tl.store(acc_ptr + (part * G + offs_g[:, None]) * D + offs_d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])


def _combine_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, lse_ptr, score_ptr, table_ptr, len_ptr, metric_ptr, pos_ptr, qpos_ptr,
    stride_tr, stride_or, stride_og, chunk, score_len, n_splits, heads, buffer,
    G: tl.constexpr, G_PAD: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    METRIC: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Program ``(row, split)``: the row's lse from every split's ``(m, l)``; split 0 writes the output and lse; with
    ``METRIC``, the squared probabilities of split ``split``'s tokens added to the metric (module docstring)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    g_ok = offs_g < G
    d_ok = offs_d < D
    parts = row.to(tl.int64) * n_splits

    big_m = tl.full([G_PAD], float("-inf"), tl.float32)
    for s in range(0, n_splits):
        big_m = tl.maximum(big_m, tl.load(m_ptr + (parts + s) * G + offs_g, mask=g_ok, other=float("-inf")))
    big_m = tl.where(big_m == float("-inf"), 0.0, big_m)  # an empty row: every weight 2^(-inf) = 0, not NaN
    total = tl.zeros([G_PAD], tl.float32)
    for s in range(0, n_splits):
        m_s = tl.load(m_ptr + (parts + s) * G + offs_g, mask=g_ok, other=float("-inf"))
        total += tl.load(l_ptr + (parts + s) * G + offs_g, mask=g_ok, other=0.0) * tl.exp2(m_s - big_m)
    lse2 = tl.where(total > 0, big_m + tl.log2(tl.where(total > 0, total, 1.0)), float("-inf"))  # empty row: -inf

    if split == 0:
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        for s in range(0, n_splits):
            w = tl.exp2(tl.load(m_ptr + (parts + s) * G + offs_g, mask=g_ok, other=float("-inf")) - big_m)
            a_off = ((parts + s) * G + offs_g[:, None]) * D + offs_d[None, :]
            acc += tl.load(acc_ptr + a_off, mask=g_ok[:, None] & d_ok[None, :], other=0.0) * w[:, None]
        out = acc / tl.where(total > 0, total, 1.0)[:, None]  # an empty row (never in decode) gives 0, not NaN
        o_off = row * stride_or + offs_g[:, None] * stride_og + offs_d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
        tl.store(lse_ptr + row * G + offs_g, lse2 * 0.6931471805599453, mask=g_ok)  # × ln 2: natural log

    if METRIC:
        length = tl.load(len_ptr + row)
        start = split * chunk
        end = tl.minimum(start + chunk, length)
        qpos = tl.load(qpos_ptr + row // heads)
        offs_n = tl.arange(0, BLOCK_M)
        table_row = table_ptr + row.to(tl.int64) * stride_tr
        score_row = score_ptr + (row.to(tl.int64) * G + offs_g[:, None]) * score_len
        for t0 in range(start, end, BLOCK_M):
            t = t0 + offs_n
            ok = t < end
            s2 = tl.load(score_row + t[None, :], mask=g_ok[:, None] & ok[None, :], other=float("-inf"))
            p = tl.exp2(s2 - tl.where(g_ok, lse2, 0.0)[:, None])  # padding heads: -inf - 0, not -inf - -inf
            p = tl.where(g_ok[:, None] & ok[None, :], p, 0.0)  # where, not a product (see the gather path)
            sq = tl.sum(p * p, axis=0)  # [BLOCK_M]
            slot = tl.load(table_row + t // BS, mask=ok, other=0).to(tl.int64) * BS + t % BS
            kpos = tl.load(pos_ptr + slot, mask=ok, other=0)
            # buffer 0 counts every stored key (all were written at or before the query's position)
            counted = ok & (kpos <= qpos - buffer)
            # Race-free: this program is the only one holding these tokens of this row (module docstring).
            current = tl.load(metric_ptr + slot, mask=counted, other=0.0)
            tl.store(metric_ptr + slot, current + sq, mask=counted)


# ---------------------------------------------------------------------------------------------------- configs
# (BLOCK_N, num_warps, num_stages): a handful around flash-decoding's usual tiles; pruned per shape below.
CONFIGS = ((32, 4, 2), (64, 4, 2), (64, 4, 3), (128, 4, 2), (64, 8, 3), (128, 8, 2))
INTERPRETER_CONFIG = (128, 4, 1)


def prune_tiles(configs, wide: bool) -> list:
    """The configurations a launch tunes over: under the interpreter the one :data:`INTERPRETER_CONFIG` (nothing to
    tune); otherwise those of :data:`CONFIGS`, without the 128-token tiles where ``wide`` (the kernel's
    temporaries and pipeline buffers grow too large at the shape)."""
    if triton.knobs.runtime.interpret:
        return [c for c in configs if (c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) == INTERPRETER_CONFIG]
    return [
        c for c in configs
        if (c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in CONFIGS and not (c.kwargs["BLOCK_N"] > 64 and wide)
    ]  # fmt: skip


def _prune(configs, named_args, **kwargs):
    """:func:`prune_tiles`, wide at ``head_dim > 128``, a padded group above 16, or float32 KV (for sm_90, bf16,
    G = 4: 128 tokens × head_dim 128 take 168 registers with 4 warps, × head_dim 256 take 224 and 140 KiB of
    shared memory; 64 tokens × 128 take 71)."""
    wide = kwargs["D_PAD"] > 128 or kwargs["G_PAD"] > 16 or named_args["k_ptr"].element_size() > 2
    return prune_tiles(configs, wide)


def jit_autotuned(kernel, key: list[str], prune) -> tuple:
    """``(jit, autotuned)``: a partial kernel wrapped in the mode in force, and the same tuned over the tiles of
    :data:`CONFIGS` (and :data:`INTERPRETER_CONFIG`) that ``prune`` keeps, per value of the arguments ``key``."""
    plain = triton.jit(kernel)
    configs = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=st) for n, w, st in (*CONFIGS, INTERPRETER_CONFIG)]
    return plain, triton.autotune(configs, key=key, prune_configs_by={"early_config_prune": prune})(plain)


@functools.cache
def _kernels(interpret: bool):
    """``(partial jit, partial autotuned, combine jit)`` wrapped in the mode in force (``interpret`` is the cache
    key only)."""
    partial, tuned = jit_autotuned(_partial_kernel, ["D_PAD", "G_PAD", "BS", "METRIC"], _prune)
    return partial, tuned, triton.jit(_combine_kernel)


def interpreter_on() -> bool:
    """Whether Triton's interpreter is on (``TRITON_INTERPRET``, read now)."""
    return bool(triton.knobs.runtime.interpret)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_sms(device: torch.device) -> int:
    """The SM count the split plan targets: the CUDA device's, or :data:`INTERPRETER_SMS` elsewhere."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return INTERPRETER_SMS


def split_plan(rows: int, max_tokens: int, sms: int, num_splits: int | None = None) -> tuple[int, int]:
    """``(splits, chunk)``: how many programs share each row and how many tokens each takes (the last may be short).

    Args:
        rows: kernel rows of the launch; max_tokens: the longest a row can be (table width × block size)
        sms: the device's SM count; num_splits: force this many splits (tests, benchmarks), else the heuristic:
            about ``PROGRAMS_PER_SM × sms`` programs, no split under ``MIN_SPLIT_TOKENS`` tokens, at most
            ``MAX_SPLITS``, boundaries on multiples of ``CHUNK_ALIGN``
    """
    max_tokens = max(int(max_tokens), 1)
    if num_splits is not None:
        if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
            raise InvalidParameterError(f"num_splits must be a positive integer, got {num_splits!r}")
        chunk = math.ceil(max_tokens / num_splits)
        return math.ceil(max_tokens / chunk), chunk
    wanted = math.ceil(PROGRAMS_PER_SM * sms / max(rows, 1))
    splits = max(1, min(wanted, math.ceil(max_tokens / MIN_SPLIT_TOKENS), MAX_SPLITS))
    chunk = math.ceil(math.ceil(max_tokens / splits) / CHUNK_ALIGN) * CHUNK_ALIGN
    return math.ceil(max_tokens / chunk), chunk


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqlens: torch.Tensor,
    block_table: torch.Tensor,
    max_seqlen_k: int,
    scale: float,
    metric: FusedMetric | None = None,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode query per kernel row through the row's block table (the ``PagedCall`` of
    :mod:`kvtrim.cache.paged_kernels`), the continual metric fused when ``metric`` is given.

    Args:
        q: ``[B, G, d]``, the ``G`` query heads reading row ``b``'s KV head
        k_cache, v_cache: ``[num_blocks, block_size, 1, d]`` (the pool's keys/values viewed with one KV head)
        seqlens: ``[B]`` int, each row's entries (read on the device; at most ``W × block_size``)
        block_table: ``[B, W]`` int block ids (entries beyond a row's blocks are never read)
        max_seqlen_k: unused: the split plan uses ``W × block_size``, which bounds every row by construction
            (kept for the shared calling convention)
        scale: softmax scale applied to ``q·k``
        metric: the fused KV-Compress metric update, or None
        num_splits: force the number of splits per row (default: :func:`split_plan`'s heuristic)
        block_n: force tokens per loop step (a power of two >= 16; default: autotuned)
    Returns:
        ``(out [B, G, d]`` in ``q``'s dtype, ``lse [B, G]`` float32 log-sum-exp of the scaled logits)
    """
    del max_seqlen_k
    _, _, d = q.shape
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    keys = k_cache.reshape(num_blocks, block_size, d)
    values = v_cache.reshape(num_blocks, block_size, d)
    if not (keys.is_contiguous() and values.is_contiguous()):
        raise InvalidParameterError("the KV pool must be contiguous [num_blocks, block_size, head_dim]")
    return split_k_decode(
        q, keys.dtype, (keys, values), seqlens, block_table, block_size, scale, metric,
        lambda interpret: _kernels(interpret)[:2], dict(D=d, D_PAD=max(16, _pow2(d))),
        num_splits=num_splits, block_n=block_n,
    )  # fmt: skip


def split_k_decode(
    q: torch.Tensor,
    dtype: torch.dtype,
    cache_args: tuple[torch.Tensor, ...],
    seqlens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    scale: float,
    metric: FusedMetric | None,
    partial_kernels: Callable[[bool], tuple],
    consts: dict,
    *,
    num_splits: int | None,
    block_n: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The host side of a split-K paged decode, whatever the pool's entries: the tile check, the output, the split
    plan and the partial buffers, the metric's pointers, the partial kernel's launch (autotuned unless ``block_n``
    forces the tile) and the combine kernel's (module docstring).

    Args:
        q: ``[B, G, d]``, converted to ``dtype`` (the dtype of the dot products and of the output)
        cache_args: the partial kernel's arguments between ``q`` and the block table (the pool's tensors)
        seqlens, block_table, scale, metric, num_splits, block_n: as :func:`paged_decode`
        block_size: tokens per block of the pool
        partial_kernels: ``interpret -> (partial jit, partial autotuned)``, the partial kernel in the mode in force;
            its arguments are ``q``, ``cache_args``, then those of :func:`_partial_kernel` from ``table_ptr`` on
        consts: the partial kernel's own compile-time constants (all but ``G, G_PAD, BS, METRIC, PRECISION,
            DOT_F32`` and ``BLOCK_N``)
    Returns:
        ``(out [B, G, d]`` in ``dtype``, ``lse [B, G]`` float32)
    """
    rows, g, d = q.shape
    if block_n is not None and (block_n < 16 or block_n & (block_n - 1)):
        raise InvalidParameterError(f"block_n must be a power of two of at least 16, got {block_n!r}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    q = q.to(dtype)
    seqlens = seqlens.contiguous()
    block_table = block_table.contiguous()
    device = q.device
    out = torch.empty(rows, g, d, dtype=q.dtype, device=device)
    lse = torch.empty(rows, g, dtype=torch.float32, device=device)
    if rows == 0:
        return out, lse
    max_tokens = block_table.shape[1] * block_size
    splits, chunk = split_plan(rows, max_tokens, device_sms(device), num_splits)
    m_part = torch.empty(rows, splits, g, dtype=torch.float32, device=device)
    l_part = torch.empty_like(m_part)
    acc_part = torch.empty(rows, splits, g, d, dtype=torch.float32, device=device)
    if metric is None:  # unused pointers (METRIC is off): any tensor of the device
        scores, metric_t, pos_t, qpos_t, heads, buffer = lse, lse, seqlens, seqlens, 1, 0
    else:
        scores = torch.empty(rows, g, max_tokens, dtype=torch.float32, device=device)
        metric_t, pos_t = metric.metric, metric.positions
        qpos_t, heads, buffer = metric.qpos.reshape(-1).contiguous(), metric.heads, metric.buffer
        if not (metric_t.is_contiguous() and pos_t.is_contiguous()):
            raise InvalidParameterError("the pool's metric and positions must be contiguous")
    interpret = interpreter_on()
    # Triton's interpreter multiplies bfloat16 operands of tl.dot as their raw 16-bit integers (it holds bfloat16 as
    # uint16 and calls numpy's matmul on those): there the operands are widened to float32 first, which is what a
    # GPU's bf16 MMA computes (exact products, float32 sums).
    bf16_upcast = interpret and q.dtype == torch.bfloat16
    partial, tuned = partial_kernels(interpret)
    combine = _kernels(interpret)[2]
    args = (
        q, *cache_args, block_table, seqlens, m_part, l_part, acc_part, scores,
        q.stride(0), q.stride(1), block_table.stride(0), chunk, max_tokens, splits, float(scale) * LOG2E,
    )  # fmt: skip
    consts = dict(
        G=g, G_PAD=max(16, _pow2(g)), BS=block_size, **consts, METRIC=metric is not None,
        PRECISION="ieee" if q.dtype == torch.float32 or bf16_upcast else "tf32", DOT_F32=bf16_upcast,
    )  # fmt: skip
    if block_n is None:
        tuned[(rows, splits)](*args, **consts)
    else:
        partial[(rows, splits)](*args, **consts, BLOCK_N=block_n, num_warps=4)
    combine[(rows, splits if metric is not None else 1)](
        m_part, l_part, acc_part, out, lse, scores, block_table, seqlens, metric_t, pos_t, qpos_t,
        block_table.stride(0), out.stride(0), out.stride(1), chunk, max_tokens, splits, heads, buffer,
        G=g, G_PAD=_pow2(g), BS=block_size, D=d, D_PAD=max(16, _pow2(d)), METRIC=metric is not None,
        BLOCK_M=METRIC_BLOCK,
    )  # fmt: skip
    return out, lse
