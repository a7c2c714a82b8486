"""A ragged store's decoding step through a block-table decode kernel (no gather, no mask).

The ragged store keeps every (sequence, KV head) row back to back in one flat ``[slots, head_dim]`` buffer. When
every row starts on a multiple of ``BLOCK`` slots, the buffer viewed as ``[slots / BLOCK, BLOCK, 1, head_dim]`` is a
block pool and row ``r``'s blocks are ``start[r] / BLOCK + 0, 1, 2, …``: the decode kernels written for the paged
engine (:mod:`kvtrim.cache.paged_kernels`: vLLM's flash-attention fork, kvtrim's split-K Triton kernel) read the
rows in place, one kernel row per (sequence, KV head) with its query group, and split long rows across the GPU.

Without such a kernel (a CPU, or no Triton), the store gathers its rows into a padded view and runs masked SDPA;
on CUDA that masked call cannot split a row, so a batch of a few sequences over long rows keeps a handful of
streaming multiprocessors busy (measured on an H100: AdaKV's decode step 1.4-1.9x the dense store's).
"""

from __future__ import annotations

import torch

from .paged_kernels import PagedKernel, choose_decode_kernel

BLOCK = 16  # slots per block: a multiple of every block-table kernel's requirement except upstream flash-attn's 256

_CHOICES: dict[tuple, PagedKernel | None] = {}


def decode_kernel_for(query: torch.Tensor, head_dim: int) -> PagedKernel | None:
    """The block-table kernel a ragged store's decoding step runs with on ``query``'s device and dtype (``"auto"``
    order: vLLM's fork, then kvtrim's Triton kernel), or None (the gather path). Chosen once per (device, dtype,
    head_dim), after a real test call (:func:`~kvtrim.cache.paged_kernels.choose_decode_kernel`)."""
    key = (query.device, query.dtype, head_dim)
    if key not in _CHOICES:
        if query.device.type != "cuda":
            _CHOICES[key] = None  # "auto" never runs a kernel under an interpreter
        else:
            choice = choose_decode_kernel("auto", device=query.device, dtype=query.dtype, block_size=BLOCK,
                                          head_dim=head_dim)  # fmt: skip
            _CHOICES[key] = choice.kernel
    return _CHOICES[key]


def block_table(start: torch.Tensor, width_blocks: int, num_blocks: int) -> torch.Tensor:
    """``[rows, width_blocks]`` int32 block ids of every row (``start`` ``[rows]``, multiples of :data:`BLOCK`); ids
    past a row's own blocks belong to the next rows and are never read (the kernel stops at the row's length)."""
    cols = torch.arange(width_blocks, device=start.device)
    return ((start // BLOCK)[:, None] + cols).clamp_(max=max(num_blocks - 1, 0)).to(torch.int32)


def ragged_paged_attention(
    kernel: PagedKernel,
    query: torch.Tensor,
    flat_keys: torch.Tensor,
    flat_values: torch.Tensor,
    start: torch.Tensor,
    length: torch.Tensor,
    max_row_slots: int,
    scaling: float,
    may_be_empty: bool,
) -> torch.Tensor:
    """One decoding query per (sequence, KV head) row over its entries, through ``kernel``.

    Args:
        query: ``[batch, q_heads, 1, head_dim]``; query head ``h`` reads KV head ``h // group``
        flat_keys, flat_values: ``[slots, head_dim]``, ``slots`` a multiple of :data:`BLOCK`
        start, length: ``[batch * kv_heads]`` each row's first slot (a multiple of :data:`BLOCK`) and entries
        max_row_slots: an upper bound on any row's slots (host-side; sizes the block table)
        may_be_empty: some row may hold no entry (its output is then zero)
    Returns:
        ``[batch, 1, q_heads, head_dim]``
    """
    b, hq, _, d = query.shape
    rows = start.shape[0]
    group = hq * b // rows
    q = query[:, :, 0].reshape(rows, group, d)
    pool_k = flat_keys.view(-1, BLOCK, 1, d)
    pool_v = flat_values.view(-1, BLOCK, 1, flat_values.shape[-1])
    table = block_table(start, -(-max_row_slots // BLOCK), pool_k.shape[0])
    out, _ = kernel.call(q, pool_k, pool_v, length.to(torch.int32), table, max_row_slots, scaling)
    if may_be_empty:
        out = out.masked_fill((length == 0)[:, None, None], 0.0)
    return out.reshape(b, hq, d)[:, None]
