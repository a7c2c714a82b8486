"""Paged decode attention over a :class:`~kvtrim.cache.quantized_block_pool.QuantizedBlockPool`'s packed entries,
written in Triton: the codes and their scales are read straight from the pool's tensors inside the attention loop
and used in registers (no dequantized copy of the cache is made, not even of one layer).

The same split-K (flash-decoding) plan as :mod:`kvtrim.cache.triton_paged` (KV-Compress's per-head block tables,
Rehg, 2024, arXiv:2410.00161; the per-token packed entries of KIVI, Liu et al., 2024, arXiv:2402.02750, without its
per-channel keys, see the pool's docstring): a partial kernel per ``(row, split)`` writes the split's online softmax
``m, l, acc``, and :mod:`kvtrim.cache.triton_paged`'s combine kernel merges the splits, writes the output and lse,
and adds the continual metric from the stored logits; the launch is its
:func:`~kvtrim.cache.triton_paged.split_k_decode`. Only the partial kernel differs: where the float kernel loads
a ``[BLOCK_N, head_dim]`` tile of keys, this one loads the tile's codes and the entries' float16 scales and zero
points.

**One scale per entry (the pool's default): the scales are folded out of the tile.** An entry is
``k = zero + scale · code`` with one ``(scale, zero)`` per token, so for query head ``g`` and token ``n``

* ``q_g · k_n = scale_n · (q_g · code_n) + zero_n · Σ_c q_g,c``: the dot reads the codes themselves (small integers,
  or e4m3 values, each exact in float16 and bfloat16), and the scale and zero point are applied to the
  ``[G, BLOCK_N]`` logits, not to the ``[BLOCK_N, head_dim]`` tile;
* ``Σ_n p_g,n · v_n = (p · scale) · code + Σ_n p_g,n · zero_n``: the probabilities are scaled per token before the
  ``P·V`` dot, and the zero points add one number per query head, carried through the online softmax like ``l``.

Per element of the tile only the code's conversion (and the even / odd split below) is left: no multiply-add, no
mask. The logits are those of the
exactly dequantized keys (float32 arithmetic; the gather path rounds them to the pool's dtype first), and
``P · scale`` is rounded to the pool's dtype for the dot as the float kernel rounds ``P`` (in a float16 pool a
product below 2^-14 keeps fewer bits: a subnormal, the terms that contribute least). **With value groups**
(``groups > 1``) each channel group has its own scale, and the tile is dequantized in registers,
``k = zero + scale · code`` in float32, then rounded to the pool's dtype as
:meth:`~kvtrim.cache.quantized_block_pool.QuantizedBlockPool.read_keys` returns it.

No host reads: lengths, block ids and positions are loaded on the device; the grid and buffers depend on the shapes
only (CUDA graphs capture it as they capture the float kernel). Checked on CPU under Triton's interpreter
(``TRITON_INTERPRET=1``, tests/cache/test_triton_paged_quant.py) against attention over the dequantized entries,
built for sm_90 with Triton's bundled ``ptxas`` (tests/cache/test_triton_paged_quant_compile.py: tensor-core dots,
no register spills), and run and timed on an H100 and an H200 (docs/gpu-check.md).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..errors import InvalidParameterError
from .paged_kernels import FusedMetric, PackedKV
from .quant import KVQuant, resolve_pool_kv_quant, rotate
from .triton_paged import _pow2, interpreter_on, jit_autotuned, prune_tiles, split_k_decode

__all__ = ["QUANT_FORMATS", "interpreter_on", "paged_decode_quant"]

QUANT_FORMATS = ("int8", "int4", "fp8")  # the packed formats the kernel reads (KVQuant.name)
_FMT_CODE = {"int8": 0, "int4": 1, "fp8": 2}
# the device functions the kernels call, bound per mode by _bind_device_functions
_fp8 = _fp8n = _affine = _codes = _entries = _bf16 = None


def _fp8_to_float(b):
    """uint8 float8 e4m3 bit patterns -> float32 with integer operations (exact; the NaN pattern never occurs in the
    pool), for devices without e4m3 conversion instructions (before sm_89)."""
    b = b.to(tl.int32)
    exp = (b >> 3) & 15
    man = b & 7
    normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)  # 2^(exp-7) · (1 + man/8)
    mag = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)  # subnormal: man · 2^-9
    # The sign goes in as a bit: compiled for a GPU, ``-mag`` turned the -0 pattern into +0.
    sign = (b >> 7).to(tl.uint32) << 31
    return (mag.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


def _fp8_native(b):
    """uint8 float8 e4m3 bit patterns -> float32 by the hardware's conversion (sm_89 and later; Triton's interpreter
    converts them too)."""
    return b.to(tl.float8e4nv, bitcast=True).to(tl.float32)


def _round_to_bf16(x):
    """float32 -> the nearest bfloat16 value (ties to even), still float32. The interpreter's float32 -> bfloat16
    cast truncates where a GPU rounds to nearest; this is what the GPU computes."""
    b = x.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.to(tl.float32, bitcast=True)


def _group_affine(scale_ptr, zero_ptr, slot, mask, ch, GROUPS: tl.constexpr, VG: tl.constexpr):
    """``(scale, zero)`` float32 ``[BLOCK_N, len(ch)]`` of channels ``ch`` of the entries at ``slot`` (value groups:
    ``GROUPS > 1``)."""
    s_off = slot[:, None] * GROUPS + (ch // VG)[None, :]
    scale = tl.load(scale_ptr + s_off, mask=mask, other=0.0).to(tl.float32)
    zero = tl.load(zero_ptr + s_off, mask=mask, other=0.0).to(tl.float32)
    return scale, zero


def _load_codes(codes_ptr, slot, ok, FMT: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                HALF_PAD: tl.constexpr, BLOCK_N: tl.constexpr, NATIVE_FP8: tl.constexpr):  # fmt: skip
    """The codes of the entries at ``slot [BLOCK_N]`` as float32 numbers ``(even, odd)`` ``[BLOCK_N, HALF_PAD]``
    (channel ``2h`` and ``2h + 1`` at column ``h``; 0 where masked): small integers or e4m3 values, each exact in
    float16 and bfloat16."""
    offs_h = tl.arange(0, HALF_PAD)
    if FMT == 1:  # int4: byte h holds channels 2h (low nibble) and 2h + 1 (high nibble)
        byte = tl.load(codes_ptr + slot[:, None] * HALF + offs_h[None, :], mask=ok[:, None] & (offs_h * 2 < D)[None, :],
                       other=0).to(tl.int32)  # fmt: skip
        even, odd = (byte & 15).to(tl.float32), (byte >> 4).to(tl.float32)
    else:  # one byte per channel: the entry's row of bytes in one contiguous load, then split even / odd
        offs_c = tl.arange(0, 2 * HALF_PAD)
        byte = tl.load(codes_ptr + slot[:, None] * D + offs_c[None, :], mask=ok[:, None] & (offs_c < D)[None, :],
                       other=0)  # fmt: skip
        code = (_fp8n(byte) if NATIVE_FP8 else _fp8(byte)) if FMT == 2 else byte.to(tl.float32)
        even, odd = tl.split(tl.reshape(code, [BLOCK_N, HALF_PAD, 2]))
    return even, odd


def _load_entries(codes_ptr, scale_ptr, zero_ptr, slot, ok, FMT: tl.constexpr, D: tl.constexpr,
                  GROUPS: tl.constexpr, VG: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                  BLOCK_N: tl.constexpr, NATIVE_FP8: tl.constexpr):  # fmt: skip
    """The entries at ``slot [BLOCK_N]`` dequantized (``zero + scale · code`` per channel), as float32 ``(even, odd)``
    channels ``[BLOCK_N, HALF_PAD]`` (0 where masked): the path for value groups (``GROUPS > 1``)."""
    offs_h = tl.arange(0, HALF_PAD)
    even_mask = ok[:, None] & (offs_h * 2 < D)[None, :]
    odd_mask = ok[:, None] & (offs_h * 2 + 1 < D)[None, :]
    even, odd = _codes(codes_ptr, slot, ok, FMT, D, HALF, HALF_PAD, BLOCK_N, NATIVE_FP8)
    scale, zero = _affine(scale_ptr, zero_ptr, slot, even_mask, offs_h * 2, GROUPS, VG)
    even = tl.where(even_mask, even * scale + zero, 0.0)
    # with an odd value_group (int8, fp8) channel 2h + 1 may sit in another group than 2h
    scale, zero = _affine(scale_ptr, zero_ptr, slot, odd_mask, offs_h * 2 + 1, GROUPS, VG)
    odd = tl.where(odd_mask, odd * scale + zero, 0.0)
    return even, odd


def _quant_partial_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, table_ptr, len_ptr, m_ptr, l_ptr, acc_ptr, score_ptr,
    stride_qr, stride_qg, stride_tr, chunk, score_len, n_splits, scale_log2,
    G: tl.constexpr, G_PAD: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    HALF_PAD: tl.constexpr, FMT: tl.constexpr, GROUPS: tl.constexpr, VG: tl.constexpr, NATIVE_FP8: tl.constexpr,
    METRIC: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Program ``(row, split)``: the split's online softmax over the packed entries of tokens ``[split·chunk,
    min((split+1)·chunk, length))``, written as the float kernel's ``m, l [rows, splits, G]`` and ``acc [rows,
    splits, G, D]`` (float32, log2 domain); with ``METRIC`` the scaled logits to ``score``.

    With one scale per entry (``GROUPS == 1``) the scale and zero point are folded out of the tile: the dots read
    the codes themselves, the logits are ``scale · (q · code) + zero · Σq`` per entry, and ``P·V`` is
    ``(P · scale) · code`` plus ``Σ P · zero`` per query head (module docstring)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    offs_g = tl.arange(0, G_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, HALF_PAD)
    g_ok = offs_g < G
    even_ok = offs_h * 2 < D
    odd_ok = offs_h * 2 + 1 < D
    q_row = q_ptr + row * stride_qr + offs_g[:, None] * stride_qg
    q_even = tl.load(q_row + offs_h[None, :] * 2, mask=g_ok[:, None] & even_ok[None, :], other=0.0)
    q_odd = tl.load(q_row + offs_h[None, :] * 2 + 1, mask=g_ok[:, None] & odd_ok[None, :], other=0.0)
    kv_ty = q_ptr.dtype.element_ty  # the pool's dtype: the dots' operands are in it
    q_sum = tl.sum(q_even.to(tl.float32), axis=1) + tl.sum(q_odd.to(tl.float32), axis=1)  # [G_PAD]
    if DOT_F32:
        q_even, q_odd = q_even.to(tl.float32), q_odd.to(tl.float32)
    length = tl.load(len_ptr + row)
    start = split * chunk
    end = tl.minimum(start + chunk, length)
    table_row = table_ptr + row.to(tl.int64) * stride_tr
    score_row = score_ptr + (row.to(tl.int64) * G + offs_g[:, None]) * score_len

    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l_sum = tl.zeros([G_PAD], tl.float32)
    acc_even = tl.zeros([G_PAD, HALF_PAD], tl.float32)
    acc_odd = tl.zeros([G_PAD, HALF_PAD], tl.float32)
    acc_zero = tl.zeros([G_PAD], tl.float32)  # Σ P · zero of the values (GROUPS == 1)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + offs_n
        ok = t < end
        slot = tl.load(table_row + t // BS, mask=ok, other=0).to(tl.int64) * BS + t % BS
        if GROUPS == 1:  # the codes themselves (exact in the pool's dtype); scale and zero point per entry
            k_even, k_odd = _codes(kc_ptr, slot, ok, FMT, D, HALF, HALF_PAD, BLOCK_N, NATIVE_FP8)
            k_scale = tl.load(ks_ptr + slot, mask=ok, other=0.0).to(tl.float32)
            k_zero = tl.load(kz_ptr + slot, mask=ok, other=0.0).to(tl.float32)
        else:  # dequantized per channel group
            k_even, k_odd = _entries(kc_ptr, ks_ptr, kz_ptr, slot, ok, FMT, D, GROUPS, VG, HALF, HALF_PAD, BLOCK_N,
                                     NATIVE_FP8)  # fmt: skip
        if DOT_F32:  # bfloat16 values held in float32 (the interpreter's bf16 dot), rounded as a GPU rounds
            k_even, k_odd = _bf16(k_even), _bf16(k_odd)
        else:  # rounded to the pool's dtype, as read_keys returns them
            k_even, k_odd = k_even.to(kv_ty), k_odd.to(kv_ty)
        s = tl.dot(q_even, tl.trans(k_even), input_precision=PRECISION)
        s = s + tl.dot(q_odd, tl.trans(k_odd), input_precision=PRECISION)  # [G_PAD, BLOCK_N]
        if GROUPS == 1:
            s = s * k_scale[None, :] + q_sum[:, None] * k_zero[None, :]
        s = tl.where(ok[None, :], s * scale_log2, float("-inf"))
        if METRIC:
            tl.store(score_row + t[None, :], s, mask=g_ok[:, None] & ok[None, :])
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        if GROUPS == 1:  # (P · scale) · code, and Σ P · zero per query head
            v_even, v_odd = _codes(vc_ptr, slot, ok, FMT, D, HALF, HALF_PAD, BLOCK_N, NATIVE_FP8)
            v_scale = tl.load(vs_ptr + slot, mask=ok, other=0.0).to(tl.float32)
            v_zero = tl.load(vz_ptr + slot, mask=ok, other=0.0).to(tl.float32)
            acc_zero = acc_zero * alpha + tl.sum(p * v_zero[None, :], axis=1)
            p = p * v_scale[None, :]
        else:
            v_even, v_odd = _entries(vc_ptr, vs_ptr, vz_ptr, slot, ok, FMT, D, GROUPS, VG, HALF, HALF_PAD, BLOCK_N,
                                     NATIVE_FP8)  # fmt: skip
        if DOT_F32:
            p, v_even, v_odd = _bf16(p), _bf16(v_even), _bf16(v_odd)
        else:  # P·V in the pool's dtype, as the float kernel does
            p, v_even, v_odd = p.to(kv_ty), v_even.to(kv_ty), v_odd.to(kv_ty)
        acc_even = acc_even * alpha[:, None] + tl.dot(p, v_even, input_precision=PRECISION)
        acc_odd = acc_odd * alpha[:, None] + tl.dot(p, v_odd, input_precision=PRECISION)
        m = m_new

    if GROUPS == 1:
        acc_even += acc_zero[:, None]
        acc_odd += acc_zero[:, None]
    part = row.to(tl.int64) * n_splits + split
    tl.store(m_ptr + part * G + offs_g, m, mask=g_ok)
    tl.store(l_ptr + part * G + offs_g, l_sum, mask=g_ok)
    a_row = acc_ptr + (part * G + offs_g[:, None]) * D
    tl.store(a_row + offs_h[None, :] * 2, acc_even, mask=g_ok[:, None] & even_ok[None, :])
    tl.store(a_row + offs_h[None, :] * 2 + 1, acc_odd, mask=g_ok[:, None] & odd_ok[None, :])


def _prune(configs, named_args, **kwargs):
    """:func:`~kvtrim.cache.triton_paged.prune_tiles`, wide where the dequantized float32 temporaries grow too large
    (``head_dim > 128``, a padded group above 16, or a float32 pool)."""
    wide = kwargs["HALF_PAD"] > 64 or kwargs["G_PAD"] > 16 or named_args["q_ptr"].element_size() > 2
    return prune_tiles(configs, wide)


@functools.cache
def _device_functions(interpret: bool) -> dict:
    """The kernel's device functions wrapped in the mode in force (``interpret`` is the cache key only)."""
    return {"_fp8": triton.jit(_fp8_to_float), "_fp8n": triton.jit(_fp8_native), "_affine": triton.jit(_group_affine),
            "_codes": triton.jit(_load_codes), "_entries": triton.jit(_load_entries),
            "_bf16": triton.jit(_round_to_bf16)}  # fmt: skip


def _bind_device_functions(interpret: bool) -> None:
    """Point the names the kernels call (``_fp8``, ``_fp8n``, ``_affine``, ``_codes``, ``_entries``, ``_bf16``) at the
    device functions of this mode: ``triton.jit`` picks interpreted or compiled when it wraps, and a kernel of one
    mode cannot call a function of the other."""
    globals().update(_device_functions(interpret))


@functools.cache
def _partial(interpret: bool):
    """``(partial jit, partial autotuned)`` wrapped in the mode in force (``interpret`` is the cache key only)."""
    return jit_autotuned(_quant_partial_kernel, ["HALF_PAD", "G_PAD", "BS", "METRIC", "FMT", "GROUPS"], _prune)


def _bound_partial(interpret: bool):
    """:func:`_partial`, with the device functions it calls bound to the same mode."""
    _bind_device_functions(interpret)
    return _partial(interpret)


def native_fp8(device: torch.device) -> bool:
    """Whether the kernel decodes fp8 codes with the device's e4m3 conversion: CUDA from compute capability 8.9 on,
    and Triton's interpreter (a CPU tensor); older GPUs take the integer decoder. A property of the device, read
    once per device (no tensor is read)."""
    if device.type != "cuda":
        return True
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (8, 9)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def check_format(kv_quant: str | KVQuant) -> KVQuant:
    """``kv_quant`` as a :class:`KVQuant` the kernel reads, or :class:`InvalidParameterError` naming the formats."""
    fmt = resolve_pool_kv_quant(kv_quant)  # a pool's: no window, no sink
    if fmt is None or fmt.name not in QUANT_FORMATS:
        raise InvalidParameterError(
            f"the fused dequantizing Triton kernel reads kv_quant {', '.join(QUANT_FORMATS)}; got "
            f"{None if fmt is None else fmt.name!r}"
        )
    if fmt.full_precision:
        field, value = fmt.full_precision
        raise InvalidParameterError(f"the fused dequantizing Triton kernel reads no full-precision entries; "
                                    f"KVQuant.{field} must be 0, got {value}")  # fmt: skip
    return fmt


def paged_decode_quant(
    q: torch.Tensor,
    keys: PackedKV,
    values: PackedKV,
    seqlens: torch.Tensor,
    block_table: torch.Tensor,
    max_seqlen_k: int,
    scale: float,
    metric: FusedMetric | None = None,
    *,
    kv_quant: str | KVQuant,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode query per kernel row over packed entries, dequantized in registers (module docstring).

    Args:
        q: ``[B, G, d]`` in the pool's dtype (keys and values are dequantized to it), the ``G`` query heads of row
            ``b``'s KV head
        keys, values: the pool's packed tensors: codes ``[num_blocks, block_size, d · bits / 8]`` uint8, scale and
            zero ``[num_blocks, block_size, groups]`` float16, contiguous
        seqlens, block_table, max_seqlen_k, scale, metric, num_splits, block_n: as
            :func:`kvtrim.cache.triton_paged.paged_decode`
        kv_quant: the pool's format (``"int8"``, ``"int4"``, ``"fp8"`` or a :class:`KVQuant` with ``residual`` 0)
    Returns:
        ``(out [B, G, d]`` in ``q``'s dtype, ``lse [B, G]`` float32 log-sum-exp of the scaled logits)
    """
    del max_seqlen_k
    fmt = check_format(kv_quant)
    _, _, d = q.shape
    fmt.check_head_dim(d)
    num_blocks, block_size = keys.codes.shape[:2]
    groups = d // fmt.value_group_for(d)
    for name, side in (("keys", keys), ("values", values)):
        if side.codes.dtype != torch.uint8 or tuple(side.codes.shape) != (num_blocks, block_size, d * fmt.bits // 8):
            raise InvalidParameterError(
                f"{name}: codes must be uint8 [num_blocks, block_size, {d * fmt.bits // 8}] for kv_quant="
                f"{fmt.name!r} at head_dim {d}, got {side.codes.dtype} {tuple(side.codes.shape)}"
            )
        for part in (side.scale, side.zero):
            if tuple(part.shape) != (num_blocks, block_size, groups):
                raise InvalidParameterError(
                    f"{name}: scales and zero points must be [num_blocks, block_size, {groups}], got "
                    f"{tuple(part.shape)}"
                )
        if not all(t.is_contiguous() for t in (side.codes, side.scale, side.zero)):
            raise InvalidParameterError(f"{name}: the pool's codes, scales and zero points must be contiguous")
    half = (d + 1) // 2
    consts = dict(D=d, HALF=half, HALF_PAD=max(16, _pow2(half)), FMT=_FMT_CODE[fmt.name], GROUPS=groups, VG=d // groups,
                  NATIVE_FP8=native_fp8(q.device))  # fmt: skip
    # Rotated entries (KVQuant.rotate): the kernel reads them as held, with the query rotated before and the output
    # rotated back after (q . k = (q R) . (k R), p . V = (p . V R) R^T); the lse is unchanged.
    out, lse = split_k_decode(
        rotate(q, fmt), q.dtype, (keys.codes, keys.scale, keys.zero, values.codes, values.scale, values.zero), seqlens,
        block_table, block_size, scale, metric, _bound_partial, consts, num_splits=num_splits, block_n=block_n,
    )  # fmt: skip
    return rotate(out, fmt, inverse=True), lse
