"""Paged decode attention through a block-table attention kernel: one kernel call per layer for the whole batch.

KV-Compress (Rehg, 2024, arXiv:2410.00161) gives every (sequence, layer, KV head) its own block table and length.
A block-table attention kernel (flash-attention's paged mode) serves a batch of *sequences*, each with one block
table and one length shared by its KV heads. The mapping used here makes every (sequence, KV head) one kernel
sequence with a single KV head:

* the pool ``keys/values [num_blocks, block_size, head_dim]`` is viewed as ``[num_blocks, block_size, 1, head_dim]``
  (``nheads_k = 1``, no copy);
* the queries ``[n, q_heads, 1, d]`` become ``n * kv_heads`` sequences of one token with ``G = q_heads / kv_heads``
  query heads each (the kernel's GQA: all ``G`` heads read the one KV head);
* ``block_table = table[slots, layer rows, :width]`` as ``[n * kv_heads, width]`` int32 and
  ``cache_seqlens`` = the lengths after this step's write, ``[n * kv_heads]`` int32.

One decode step (one query per sequence) needs no causal mask: the new token is the newest entry of every row and
every entry a row keeps was written at a position at or before it (eviction only removes entries), so the visible
keys are exactly the first ``length`` logical slots. Prefill (several queries, packed chunks) stays on the gather +
SDPA path of :mod:`kvtrim.cache.paged`.

Kernels, looked up in this order (the first importable one that allows the pool's block size is used):

1. vLLM's fork of flash-attention, ``vllm.vllm_flash_attn.flash_attn_varlen_func`` (shipped in vLLM's CUDA wheels):
   paged mode with ``block_table`` and ``seqused_k``, block size a multiple of 16 (``csrc/flash_attn/flash_api.cpp``,
   ``mha_varlen_fwd``: "Paged KV cache block size must be divisible by 16"; ``vllm_flash_attn/flash_attn_interface.py``
   at vllm-project/flash-attention@617264c1c7955c9e84817654ebeedff069f3c5f1). Its ``flash_attn_with_kvcache`` binding
   was removed in 58e0626a ("Remove bindings for flash_attn_with_kvcache (#107)"), so the varlen entry point is
   the one current vLLM wheels carry; it is called with its default ``fa_version=2``. ``q [total_q, nheads, d]``,
   ``cu_seqlens_q [batch + 1]`` int32, ``seqused_k [batch]`` int32, ``softmax_lse [nheads, total_q]``.
2. Upstream flash-attn 2, ``flash_attn.flash_attn_with_kvcache``: ``k_cache [num_blocks, page_block_size, nheads_k,
   headdim]``, ``cache_seqlens [batch]`` int32, ``block_table [batch, max_num_blocks_per_seq]`` int32,
   ``softmax_scale``, ``causal``, ``return_softmax_lse`` (lse ``[batch, nheads, seqlen]``); paged mode needs a block
   size that is a multiple of 256 (``mha_fwd_kvcache`` in ``csrc/flash_attn/flash_api.cpp``: "Paged KV cache block
   size must be divisible by 256"; Dao-AILab/flash-attention@0251105a2fb19d2957484b7f023cd8c115286ced, interface at
   005300258a22e5fc6be621063c3d5704e82b89d9).

Both need CUDA, fp16/bf16 and ``head_dim`` a multiple of 8 and at most 256.

3. kvtrim's own Triton kernel, :mod:`kvtrim.cache.triton_paged` (``decode_kernel="triton"``; imported only when it
   is chosen or ``"auto"`` meets a CUDA pool): any block size, fp16/bf16/fp32, ``head_dim`` at most 256, the
   continual metric fused into the same launch. It needs the ``triton`` package and a CUDA device; on a CPU it
   runs only under Triton's interpreter (``TRITON_INTERPRET=1``, Triton's debug mode, which the tests use), and
   only when asked for by name.

4. kvtrim's fused dequantizing Triton kernel, :mod:`kvtrim.cache.triton_paged_quant` (``"triton_quant"``), for a
   :class:`~kvtrim.cache.quantized_block_pool.QuantizedBlockPool` only (``kv_quant`` int8, int4 or fp8): it reads the
   pool's codes, scales and zero points and dequantizes them in registers inside the attention loop; the same
   split-K plan, conditions and fused metric as the Triton kernel. ``decode_kernel="triton"`` or ``"auto"`` on a
   quantized CUDA pool picks it; the flash-attention kernels read unquantized blocks and refuse ``kv_quant``.

``"auto"`` tries vLLM's fork, then the Triton kernel, then upstream flash-attn. The fork is vLLM's own tuned decode
kernel for 16-token pages. The Triton kernel comes before upstream flash-attn because it serves every block size
(upstream needs multiples of 256, which KV-Compress's small blocks never are) and fuses the metric (with the
flash-attention kernels the metric is a second pass in PyTorch that gathers every cached key of the layer).
"flash" keeps meaning the flash-attention kernels only.

An import proves little: vLLM's fork imports even when its compiled extension failed to load (it then sets
``FA2_AVAILABLE = False``, which is read too), and a kernel may load and still not run on this GPU, dtype or block
size. So a candidate is chosen only after one tiny real call with the pool's device, dtype, block size and head dim
returns the right result (:func:`probe_kernel`, cached per key); every candidate refused, and why, is reported
(:class:`KernelChoice`, ``EngineStats.decode_kernel_refused``, and the error when a named kernel cannot run).

The continual metric (KV-Compress's decode-time squared attention): with a flash-attention kernel, each cached key's
probability is ``exp(q·k·scale − lse)`` from the kernel's log-sum-exp, so only the keys (not the values) are
gathered and no softmax or ``P·V`` is recomputed (:func:`accumulate_metric_from_lse`); the Triton kernel does the
same inside the kernel (:attr:`PagedKernel.fuses_metric`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from ..errors import InvalidParameterError
from .quant import KVQuant, dequantize_values, quantize_values, resolve_pool_kv_quant

DECODE_KERNELS = ("auto", "gather", "flash", "triton")
_DTYPES = (torch.float16, torch.bfloat16)
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256

# (out [B, G, d], lse [B, G] fp32) = call(q [B, G, d], k_cache, v_cache [N, bs, 1, d], seqlens [B] int32,
#                                         block_table [B, W] int32, max_seqlen_k, softmax_scale)
PagedCall = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class PagedKernel:
    """One importable block-table attention kernel.

    Attributes:
        name: ``"vllm_flash_attn"``, ``"flash_attn"`` or ``"triton"``
        block_multiple: the block sizes it accepts are multiples of this
        call: the kernel behind one calling convention (see ``PagedCall`` above)
        fuses_metric: ``call`` also takes ``metric=FusedMetric(...)`` and updates the continual metric itself
        kv_quant: the packed formats it reads (``KVQuant.name``); empty: unquantized blocks only. A kernel that reads
            packed formats reads nothing else: ``call`` takes :class:`PackedKV` for ``k_cache`` / ``v_cache`` and
            ``kv_quant=`` the pool's :class:`~kvtrim.cache.quant.KVQuant`
    """

    name: str
    block_multiple: int
    call: PagedCall
    fuses_metric: bool = False
    kv_quant: tuple[str, ...] = ()


@dataclass(frozen=True)
class PackedKV:
    """The keys or the values of a :class:`~kvtrim.cache.quantized_block_pool.QuantizedBlockPool` as a kernel reads
    them (views of the pool's tensors, no copy).

    Attributes:
        codes: ``[num_blocks, block_size, head_dim * bits / 8]`` uint8
        scale, zero: ``[num_blocks, block_size, head_dim / value_group]`` float16 (per token)
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor


@dataclass(frozen=True)
class FusedMetric:
    """The continual metric update a kernel with ``fuses_metric`` does in the same launch.

    Attributes:
        metric: ``[num_blocks, block_size]`` float32, updated in place (the pool's)
        positions: ``[num_blocks, block_size]`` long, each slot's token position (the pool's)
        qpos: ``[n]`` long, each sequence's query position (kernel row ``r`` belongs to sequence ``r // heads``)
        heads: KV heads per sequence
        buffer: keys with position ``> qpos − buffer`` are left out (0: every stored key counts)
    """

    metric: torch.Tensor
    positions: torch.Tensor
    qpos: torch.Tensor
    heads: int
    buffer: int


# ---------------------------------------------------------------------------------------------------- lookup
_IMPORT_ERRORS: dict[str, str] = {}  # kernel name -> why its module could not be used (filled by the loaders)
_PROBES: dict[tuple, str | None] = {}  # (implementation, device, dtype, block size, head dim) -> why it failed


def clear_kernel_cache() -> None:
    """Forget every kernel lookup and test call (for tools and tests that change what is installed)."""
    for loader in (_load_vllm_fork, _load_flash_attn, _load_triton, _load_triton_quant):
        loader.cache_clear()
    _IMPORT_ERRORS.clear()
    _PROBES.clear()


def _fa2_unavailable(package: ModuleType) -> str | None:
    """Why vLLM's fork says its FlashAttention-2 extension did not load, or None. The package imports even when its
    compiled extension failed to load; it then sets ``FA2_AVAILABLE = False`` (in ``flash_attn_interface``)."""
    modules = [package]
    with contextlib.suppress(Exception):  # a fork without the submodule: its package's flag (if any) decides
        modules.append(importlib.import_module(f"{package.__name__}.flash_attn_interface"))
    for module in modules:
        if getattr(module, "FA2_AVAILABLE", True) is False:
            why = getattr(module, "FA2_UNAVAILABLE_REASON", None) or "no reason given"
            return f"vllm.vllm_flash_attn imports but reports FA2_AVAILABLE = False ({why})"
    return None


@functools.lru_cache(maxsize=1)
def _load_vllm_fork() -> Callable | None:
    """``vllm.vllm_flash_attn.flash_attn_varlen_func`` or None (why: ``_IMPORT_ERRORS``)."""
    try:
        package = importlib.import_module("vllm.vllm_flash_attn")
        fn = package.flash_attn_varlen_func
    except Exception as exc:  # not installed, a CPU build, or built for another torch
        _IMPORT_ERRORS["vllm_flash_attn"] = f"vllm.vllm_flash_attn is not importable ({type(exc).__name__}: {exc})"
        return None
    reason = _fa2_unavailable(package)
    if reason is not None:
        _IMPORT_ERRORS["vllm_flash_attn"] = reason
        return None
    return fn


@functools.lru_cache(maxsize=1)
def _load_flash_attn() -> Callable | None:
    """``flash_attn.flash_attn_with_kvcache`` or None (why: ``_IMPORT_ERRORS``)."""
    try:
        return importlib.import_module("flash_attn").flash_attn_with_kvcache
    except Exception as exc:
        _IMPORT_ERRORS["flash_attn"] = f"flash_attn is not importable ({type(exc).__name__}: {exc})"
        return None


@functools.lru_cache(maxsize=1)
def _load_triton() -> ModuleType | None:
    """:mod:`kvtrim.cache.triton_paged` (which imports ``triton``) or None."""
    try:
        from . import triton_paged
    except Exception as exc:  # triton not installed, or a build that does not import here
        _IMPORT_ERRORS["triton"] = f"{type(exc).__name__}: {exc}"
        return None
    return triton_paged


@functools.lru_cache(maxsize=1)
def _load_triton_quant() -> ModuleType | None:
    """:mod:`kvtrim.cache.triton_paged_quant` (which imports ``triton``) or None."""
    try:
        from . import triton_paged_quant
    except Exception as exc:
        _IMPORT_ERRORS["triton_quant"] = f"{type(exc).__name__}: {exc}"
        return None
    return triton_paged_quant


def _varlen_call(fn: Callable) -> PagedCall:
    def call(q, k_cache, v_cache, seqlens, block_table, max_seqlen_k: int, scale: float):
        b = q.shape[0]
        cu_q = torch.arange(b + 1, dtype=torch.int32, device=q.device)  # one query token per kernel sequence
        out, lse = fn(
            q, k_cache, v_cache, max_seqlen_q=1, cu_seqlens_q=cu_q, max_seqlen_k=max_seqlen_k, seqused_k=seqlens,
            softmax_scale=scale, causal=False, block_table=block_table, return_softmax_lse=True,
        )  # fmt: skip
        return out, lse.transpose(0, 1)  # lse [nheads, total_q] -> [B, G]

    call.impl = fn
    return call


def _kvcache_call(fn: Callable) -> PagedCall:
    def call(q, k_cache, v_cache, seqlens, block_table, max_seqlen_k: int, scale: float):
        out, lse = fn(
            q[:, None], k_cache, v_cache, cache_seqlens=seqlens, block_table=block_table, softmax_scale=scale,
            causal=False, return_softmax_lse=True,
        )  # fmt: skip
        return out[:, 0], lse[:, :, 0]  # out [B, 1, G, d], lse [B, G, 1]

    call.impl = fn
    return call


def available_kernels() -> list[PagedKernel]:
    """The importable flash-attention kernels in lookup order (vLLM's fork first); the Triton kernel is
    :func:`triton_kernel`."""
    found = []
    fork = _load_vllm_fork()
    if fork is not None:
        found.append(PagedKernel("vllm_flash_attn", 16, _varlen_call(fork)))
    upstream = _load_flash_attn()
    if upstream is not None:
        found.append(PagedKernel("flash_attn", 256, _kvcache_call(upstream)))
    return found


def triton_kernel() -> PagedKernel | None:
    """kvtrim's Triton kernel (any block size, metric fused), or None when ``triton`` is not importable."""
    module = _load_triton()
    return None if module is None else PagedKernel("triton", 1, module.paged_decode, fuses_metric=True)


def triton_quant_kernel() -> PagedKernel | None:
    """kvtrim's fused dequantizing Triton kernel for quantized pools, or None when ``triton`` is not importable."""
    module = _load_triton_quant()
    if module is None:
        return None
    return PagedKernel("triton_quant", 1, module.paged_decode_quant, fuses_metric=True, kv_quant=module.QUANT_FORMATS)


def _triton_on_cuda(device: torch.device) -> bool:
    return device.type == "cuda"


def _triton_unusable_reason(
    device: torch.device, dtype: torch.dtype, head_dim: int, *, auto: bool, quant: bool = False
) -> str | None:
    """Why the Triton kernel (``quant``: the fused dequantizing one) cannot serve this pool, or None. A CPU pool is
    served only under Triton's interpreter and only when the kernel is named (``auto`` never picks an
    interpreter)."""
    module = _load_triton_quant() if quant else _load_triton()
    if module is None:
        why = _IMPORT_ERRORS.get("triton_quant" if quant else "triton")
        return "the triton package is not importable (pip install 'kvtrim[gpu]')" + (f": {why}" if why else "")
    if not _triton_on_cuda(device) and (auto or not module.interpreter_on()):
        return (
            f"it needs a CUDA device, the KV pool is on {device} (a CPU pool runs only under Triton's interpreter, "
            "TRITON_INTERPRET=1, Triton's debug mode)"
        )
    if dtype not in _TRITON_DTYPES:
        return f"it needs float16, bfloat16 or float32 KV, the pool holds {dtype}"
    if head_dim > MAX_HEAD_DIM:
        return f"it needs head_dim at most {MAX_HEAD_DIM}, got {head_dim}"
    return None


def _device_supported(device: torch.device) -> bool:
    return device.type == "cuda"


def _dtype_supported(dtype: torch.dtype) -> bool:
    return dtype in _DTYPES


def _unusable_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    if not _device_supported(device):
        return f"it needs a CUDA device, the KV pool is on {device}"
    if not _dtype_supported(dtype):
        return f"it needs float16 or bfloat16 KV, the pool holds {dtype}"
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return f"it needs head_dim a multiple of 8 and at most {MAX_HEAD_DIM}, got {head_dim}"
    return None


PROBE_GROUP = 2  # query heads per KV head in the test call (the GQA layout every decode step uses)


def probe_kernel(
    kernel: PagedKernel,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    block_size: int,
    head_dim: int,
    kv_quant: KVQuant | None = None,
) -> str | None:
    """Why ``kernel`` failed one tiny real call on this pool's device, dtype, block size and head dim, or None.

    The call reads one row of ``block_size + 1`` keys through a two-block table (blocks out of order) with
    ``PROBE_GROUP`` query heads, updates a scratch metric when the kernel fuses it, and is compared with the same
    attention in float32. An import that succeeds says nothing about whether the compiled kernel loads, runs on
    this GPU or accepts these shapes; this call does. A kernel that reads packed entries (``kernel.kv_quant``) gets
    the pool's format ``kv_quant``: the blocks are quantized and the reference attends over them dequantized.
    Cached per (implementation, device, dtype, block size, head dim, format): it runs once per process and key.
    """
    device = torch.device(device)
    impl = getattr(kernel.call, "impl", kernel.call)
    key = (kernel.name, impl, str(device), dtype, block_size, head_dim, kv_quant)
    if key not in _PROBES:
        _PROBES[key] = _probe(kernel, device, dtype, block_size, head_dim, kv_quant)
    return _PROBES[key]


def _probe(
    kernel: PagedKernel,
    device: torch.device,
    dtype: torch.dtype,
    block_size: int,
    head_dim: int,
    kv_quant: KVQuant | None = None,
):
    g = torch.Generator().manual_seed(0)
    length, d = block_size + 1, head_dim
    k_cache = torch.randn(3, block_size, 1, d, generator=g).to(device, dtype)
    v_cache = torch.randn(3, block_size, 1, d, generator=g).to(device, dtype)
    extra = {}
    if kernel.kv_quant:
        if kv_quant is None:
            return "it reads packed entries and was given no kv_quant format"
        packed = []
        for cache in (k_cache, v_cache):
            codes, scale, zero = quantize_values(cache[:, :, 0].float(), kv_quant)
            packed.append(PackedKV(codes, scale, zero))
            cache.copy_(dequantize_values(codes, scale, zero, kv_quant, dtype)[:, :, None])  # what the kernel reads
        extra["kv_quant"] = kv_quant
        k_arg, v_arg = packed
    else:
        k_arg, v_arg = k_cache, v_cache
    q = torch.randn(1, PROBE_GROUP, d, generator=g).to(device, dtype)
    table = torch.tensor([[2, 0]], dtype=torch.int32, device=device)
    seqlens = torch.tensor([length], dtype=torch.int32, device=device)
    scale = d**-0.5
    if kernel.fuses_metric:
        metric = torch.zeros(3, block_size, dtype=torch.float32, device=device)
        positions = torch.arange(3 * block_size, device=device).view(3, block_size)
        qpos = torch.full((1,), 3 * block_size, dtype=torch.long, device=device)
        extra["metric"] = FusedMetric(metric, positions, qpos, 1, 0)
    try:
        out, lse = kernel.call(q, k_arg, v_arg, seqlens, table, 2 * block_size, scale, **extra)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:
        return f"a test call raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
    if tuple(out.shape) != (1, PROBE_GROUP, d) or tuple(lse.shape) != (1, PROBE_GROUP):
        return f"a test call returned shapes {tuple(out.shape)} and {tuple(lse.shape)}"
    slots = (table[0].long()[:, None] * block_size + torch.arange(block_size, device=device)).reshape(-1)[:length]
    keys, values = k_cache.view(-1, d)[slots].float(), v_cache.view(-1, d)[slots].float()  # [length, d]
    logits = q[0].float() @ keys.T * scale  # [G, length]
    want_lse = torch.logsumexp(logits, -1)
    probs = torch.exp(logits - want_lse[:, None])
    checks = [("output", out[0].float(), probs @ values), ("log-sum-exp", lse[0].float(), want_lse)]
    if kernel.fuses_metric:
        checks.append(("metric", extra["metric"].metric.view(-1)[slots], probs.square().sum(0)))
    tol = 1e-2 if dtype == torch.float32 else 5e-2
    for what, got, want in checks:
        if not torch.allclose(got, want, atol=tol, rtol=tol):
            return f"a test call returned a wrong {what} (max error {float((got - want).abs().max()):.3g})"
    return None



@dataclass(frozen=True)
class KernelChoice:
    """What :func:`choose_decode_kernel` decided.

    Attributes:
        kernel: the kernel decode attention runs with, or None for the gather + SDPA path
        refused: ``(kernel name, why)`` for every candidate looked at and not chosen, in lookup order
    """

    kernel: PagedKernel | None
    refused: tuple[tuple[str, str], ...] = ()


def resolve_decode_kernel(
    choice: str,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    block_size: int,
    head_dim: int,
    kv_quant: str | KVQuant | None = None,
) -> PagedKernel | None:
    """:func:`choose_decode_kernel`'s kernel (None: the gather + SDPA path)."""
    return choose_decode_kernel(
        choice, device=device, dtype=dtype, block_size=block_size, head_dim=head_dim, kv_quant=kv_quant
    ).kernel


def choose_decode_kernel(
    choice: str,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    block_size: int,
    head_dim: int,
    kv_quant: str | KVQuant | None = None,
) -> KernelChoice:
    """The kernel decode attention runs with, and why every other candidate was refused.

    A candidate is chosen only after its conditions hold AND one tiny real call on this device, dtype, block size
    and head dim succeeds with the right result (:func:`probe_kernel`): an import can succeed while the compiled
    kernel cannot run (vLLM's fork imports with ``FA2_AVAILABLE = False`` when its extension failed to load).

    Args:
        choice: ``"gather"`` (always None), ``"flash"`` (a flash-attention kernel, or raise), ``"triton"`` (the
            Triton kernel, or raise), ``"auto"`` (vLLM's fork, else the Triton kernel, else upstream flash-attn,
            the first that passes; else None)
        device, dtype, block_size, head_dim: the KV pool's
        kv_quant: the pool's packed format (``"int8"``, ``"int4"``, ``"fp8"`` or a :class:`KVQuant`) or None. A
            quantized pool is read by the fused dequantizing Triton kernel only (``"triton"`` and ``"auto"`` pick
            it where it runs, ``"auto"`` else the gather path, which reads the codes itself); the flash-attention
            kernels read unquantized blocks (``"flash"`` raises)
    Raises:
        InvalidParameterError: an unknown ``choice``; ``"flash"`` or ``"triton"`` when no such kernel can serve
            this pool (the message says why, for each candidate), including a format the fused kernel does not read
    """
    if not isinstance(choice, str) or choice not in DECODE_KERNELS:
        raise InvalidParameterError(f"decode_kernel must be one of {', '.join(DECODE_KERNELS)}; got {choice!r}")
    if choice == "gather":
        return KernelChoice(None)
    if kv_quant is not None:
        return _choose_quantized(choice, torch.device(device), dtype, block_size, head_dim, kv_quant)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise InvalidParameterError(f"block_size must be a positive integer, got {block_size!r}")
    device = torch.device(device)
    refused: list[tuple[str, str]] = []

    def passes(kernel: PagedKernel) -> bool:
        reason = probe_kernel(kernel, device=device, dtype=dtype, block_size=block_size, head_dim=head_dim)
        if reason is not None:
            refused.append((kernel.name, reason))
        return reason is None

    def refuse() -> str:
        return "; ".join(f"{name}: {why}" for name, why in refused)

    if choice == "triton":
        reason = _triton_unusable_reason(device, dtype, head_dim, auto=False)
        if reason is not None:
            raise InvalidParameterError(f"decode_kernel='triton' cannot be used: {reason}")
        kernel = triton_kernel()
        if not passes(kernel):
            raise InvalidParameterError(f"decode_kernel='triton' cannot be used: {refused[-1][1]}")
        return KernelChoice(kernel)
    # the flash-attention kernels: shared conditions, then what is importable, then the block size, then a call
    reason = _unusable_reason(device, dtype, head_dim)
    flash: list[PagedKernel] = []
    if reason is not None:
        refused += [(name, reason) for name in ("vllm_flash_attn", "flash_attn")]
    else:
        kernels = available_kernels()
        names = {k.name for k in kernels}
        refused += [(n, _IMPORT_ERRORS.get(n, "not importable")) for n in ("vllm_flash_attn", "flash_attn")
                    if n not in names]  # fmt: skip
        for k in kernels:
            if block_size % k.block_multiple:
                refused.append((k.name, f"it needs block_size a multiple of {k.block_multiple}, got {block_size}"))
            else:
                flash.append(k)
        if not kernels:
            reason = (
                "neither vLLM's flash-attention fork (vllm.vllm_flash_attn, block_size a multiple of 16) nor the "
                f"flash-attn package (block_size a multiple of 256) is importable ({refuse()})"
            )
        elif not flash:
            allowed = ", ".join(f"{k.name} needs a multiple of {k.block_multiple}" for k in kernels)
            reason = f"block_size={block_size} is not allowed by the importable kernels ({allowed})"
    if choice == "flash":
        if reason is None:
            for k in flash:
                if passes(k):
                    return KernelChoice(k, tuple(refused))
            reason = f"no importable kernel passed a test call ({refuse()})"
        raise InvalidParameterError(f"decode_kernel='flash' cannot be used: {reason}")
    # auto: vLLM's fork, then the Triton kernel, then upstream flash-attn (module docstring)
    if flash and flash[0].name == "vllm_flash_attn":
        fork = flash.pop(0)
        if passes(fork):
            return KernelChoice(fork, tuple(refused))
    reason = _triton_unusable_reason(device, dtype, head_dim, auto=True)
    if reason is None:
        kernel = triton_kernel()
        if passes(kernel):
            return KernelChoice(kernel, tuple(refused))
    else:
        refused.append(("triton", reason))
    for k in flash:
        if passes(k):
            return KernelChoice(k, tuple(refused))
    return KernelChoice(None, tuple(refused))


def _choose_quantized(
    choice: str, device: torch.device, dtype: torch.dtype, block_size: int, head_dim: int, kv_quant: str | KVQuant
) -> KernelChoice:
    """:func:`choose_decode_kernel` for a quantized pool: the fused dequantizing Triton kernel or the gather path."""
    fmt = resolve_pool_kv_quant(kv_quant)  # a pool's: no window, no sink
    flash_why = (
        f"kv_quant={fmt.name!r}: the flash-attention kernels read unquantized blocks; decode_kernel='triton' "
        "(the fused dequantizing kernel) or 'gather' read the packed entries"
    )
    if choice == "flash":
        raise InvalidParameterError(f"decode_kernel='flash' cannot be used with {flash_why}")
    refused = [("vllm_flash_attn", flash_why), ("flash_attn", flash_why)]
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise InvalidParameterError(f"block_size must be a positive integer, got {block_size!r}")
    reason = _triton_unusable_reason(device, dtype, head_dim, auto=choice == "auto", quant=True)
    kernel = None
    if reason is None:
        kernel = triton_quant_kernel()
        if fmt.name not in kernel.kv_quant or fmt.full_precision:
            what = repr(fmt.name)
            if fmt.full_precision:
                field, value = fmt.full_precision
                kind = "a full-precision window" if field == "residual" else "full-precision oldest entries"
                what = f"KVQuant.{field}={value} ({kind})"
            reason = f"it reads kv_quant {', '.join(kernel.kv_quant)} with no full-precision entries, got {what}"
    if reason is None:
        reason = probe_kernel(
            kernel, device=device, dtype=dtype, block_size=block_size, head_dim=head_dim, kv_quant=fmt
        )
    if reason is None:
        return KernelChoice(kernel, tuple(refused))
    if choice == "triton":
        raise InvalidParameterError(f"decode_kernel='triton' cannot be used with kv_quant={fmt.name!r}: {reason}")
    return KernelChoice(None, (*refused, ("triton_quant", reason)))


# ---------------------------------------------------------------------------------------------------- attention
def paged_decode_attention(
    kernel: PagedKernel,
    query: torch.Tensor,
    pool,
    table: torch.Tensor,
    length: torch.Tensor,
    scaling: float,
    *,
    metric_qpos: torch.Tensor | None = None,
    buffer: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of every (sequence, KV head) of one layer in one kernel call.

    Args:
        query: ``[n, q_heads, 1, d]`` post-rotary
        pool: the :class:`~kvtrim.cache.block_pool.BlockPool` (this step's K/V already written)
        table: ``[n, kv_heads, width]`` long block ids of the layer's rows
        length: ``[n, kv_heads]`` long entries per row after the write (at least 1)
        metric_qpos: ``[n, 1]`` query positions: a kernel with ``fuses_metric`` also adds the continual metric
            (keys within ``buffer`` positions of the query left out) to ``pool.metric``; needs ``fuses_metric``
    Returns:
        ``([n, 1, q_heads, d]`` output in ``query``'s dtype, ``[n, kv_heads, G]`` fp32 log-sum-exp of the scaled
        logits)
    """
    n, hq, _, d = query.shape
    h, width = table.shape[1], table.shape[2]
    g = hq // h
    q = query.to(pool.dtype).reshape(n * h, g, d)  # query head kv * G + j reads KV head kv
    extra = {}
    if kernel.kv_quant:
        if pool.quant is None:
            raise InvalidParameterError(f"the {kernel.name} kernel reads quantized pools; this pool holds {pool.dtype}")
        k_cache = PackedKV(pool.key_codes, pool.key_scale, pool.key_zero)
        v_cache = PackedKV(pool.value_codes, pool.value_scale, pool.value_zero)
        extra["kv_quant"] = pool.quant
    else:
        k_cache, v_cache = pool.keys.unsqueeze(2), pool.values.unsqueeze(2)  # [num_blocks, block_size, 1, d]: views
    if metric_qpos is not None:
        if not kernel.fuses_metric:
            raise InvalidParameterError(f"the {kernel.name} kernel does not fuse the metric: pass no metric_qpos")
        extra["metric"] = FusedMetric(pool.metric, pool.positions, metric_qpos.reshape(n), h, buffer)
    out, lse = kernel.call(
        q,
        k_cache,
        v_cache,
        length.reshape(n * h).to(torch.int32),
        table.reshape(n * h, width).to(torch.int32),
        width * pool.block_size,
        scaling,
        **extra,
    )
    return out.reshape(n, 1, hq, d).to(query.dtype), lse.reshape(n, h, g).float()


def accumulate_metric_from_lse(
    pool,
    query: torch.Tensor,
    lse: torch.Tensor,
    table: torch.Tensor,
    length: torch.Tensor,
    qpos: torch.Tensor,
    scaling: float,
    buffer: int,
) -> None:
    """Add every query head's squared attention, summed over its group, to ``pool.metric`` of each cached key
    (KV-Compress's continual metric), with probabilities ``exp(q·k·scale − lse)`` from the kernel's log-sum-exp.

    Args:
        query: ``[n, q_heads, 1, d]``; lse: ``[n, kv_heads, G]`` fp32; table: ``[n, kv_heads, width]``;
        length: ``[n, kv_heads]`` after the write; qpos: ``[n, 1]`` the query positions
        buffer: keys within ``buffer`` positions of the query are left out
    """
    n, hq, _, d = query.shape
    h, width = table.shape[1], table.shape[2]
    bs = pool.block_size
    slots = (table[:, :, :, None] * bs + torch.arange(bs, device=table.device)).reshape(n, h, width * bs)
    keys = pool.read_keys(slots)  # [n, H, S, d]: the keys only, no values
    q = query.to(pool.dtype).reshape(n, h, hq // h, d).float() * scaling
    logits = torch.matmul(q, keys.float().transpose(-1, -2))  # [n, H, G, S]
    sq = torch.exp(logits - lse[..., None]).square().sum(dim=2)  # [n, H, S]
    counted = torch.arange(width * bs, device=table.device)[None, None, :] < length[:, :, None]
    if buffer:
        counted = counted & (pool.positions.view(-1)[slots] <= qpos.view(n, 1, 1) - buffer)
    # ``where``, not a product: a stale slot beyond a row's length may overflow exp() to inf (inf * 0 = NaN).
    pool.metric.view(-1).index_add_(0, slots.reshape(-1), torch.where(counted, sq, 0.0).reshape(-1))
