"""Batched attention over kvtrim's stores: one kernel call per layer, whatever the store, no host syncs.

Every store attends through :func:`attend_padded`, which takes keys and values already laid out as
``[batch, kv_heads, width, head_dim]`` and a boolean visibility mask, folds each KV head's query group into the
query axis (GQA without repeating keys) and makes ONE ``scaled_dot_product_attention`` call.

* Dense stores pass their buffers as they are.
* Ragged stores (a different number of entries per (sequence, KV head) row, packed back to back in flat buffers)
  are gathered into a padded ``[batch, kv_heads, width, head_dim]`` view with one ``index_select`` per tensor from
  a gather index that only changes when the store is repacked, plus a key-padding mask ``slot < length[row]``
  (:func:`gather_rows`). The padded copy is transient (one layer at a time).
* With the optional ``flash-attn`` package on CUDA (fp16/bf16), ragged decode steps skip the gather:
  :func:`flash_varlen_attention` hands the flat buffers to ``flash_attn_varlen_func``, each (sequence, KV head) row
  being one variable-length sequence and its append slack a second one (so rows need not be back to back).

No function here reads a device value on the host (no ``.item()``, ``.tolist()``, ``bool(tensor)``, boolean
indexing): shapes come from host-side bookkeeping the stores keep.
"""

from __future__ import annotations

import importlib.util

import torch

from .sdpa import sdpa as backend_sdpa

_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


def sdpa(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """The single place this module calls scaled-dot-product attention (``[b, h, q, d]`` each), through
    :func:`kvtrim.cache.sdpa.sdpa` so the CUDA backend is chosen on purpose."""
    return backend_sdpa(query, keys, values, attn_mask=mask, scale=scaling)


def attend_padded(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    may_be_empty: bool = True,
) -> torch.Tensor:
    """Grouped-query attention with one SDPA call.

    Args:
        query: ``[batch, q_heads, q, head_dim]``; query head ``h`` belongs to KV head ``h // (q_heads / kv_heads)``
        keys, values: ``[batch, kv_heads, width, head_dim]``
        mask: boolean, True = visible: ``[batch, kv_heads, q, width]`` or ``[batch, kv_heads, 1, width]`` (the same
            keys for every query, e.g. a decoding step); None = every key visible to every query
        may_be_empty: some query may see no key at all (its output is then zero, not NaN)
    Returns:
        ``[batch, q, q_heads, head_dim]``
    """
    b, hq, tq, d = query.shape
    hkv = keys.shape[1]
    group = hq // hkv
    if mask is None:
        # Unmasked (a decoding step over a store without empty slots): the same GQA call as transformers' own
        # SDPA path, so the result is bitwise the uncompressed model's (folded queries differ in bf16 rounding).
        out = backend_sdpa(query, keys, values, scale=scaling, enable_gqa=group > 1)
        return out.transpose(1, 2)
    # Fold the group into the query axis: [b, hkv, group * tq, d] (a view) against [b, hkv, width, d].
    q = query.reshape(b, hkv, group * tq, d)
    m = mask
    if mask is not None and mask.shape[2] != 1 and group > 1:
        m = mask[:, :, None].expand(b, hkv, group, tq, mask.shape[-1]).reshape(b, hkv, group * tq, -1)
    out = sdpa(q, keys, values, m, scaling)
    if mask is not None and may_be_empty:
        # A query that sees nothing gets NaN from the softmax; zero it on the device (no host check).
        seen = m.any(-1, keepdim=True)  # [b, hkv, group*tq or 1, 1]
        out = out.masked_fill(~seen, 0.0)
    # reshape, not view: CUDA's SDPA kernels return [b, h, q, d] as a transposed view of a [b, q, h, d] buffer
    return out.reshape(b, hq, tq, values.shape[-1]).transpose(1, 2)  # values may be wider than pruned keys


def gather_index(start: torch.Tensor, width: int, total: int) -> torch.Tensor:
    """``[rows, width]`` flat slot of column ``j`` of every row: ``start[r] + j`` (clamped into the buffer; columns
    past a row's length are masked, whatever they read)."""
    cols = torch.arange(width, device=start.device)
    return (start[:, None] + cols).clamp_(max=max(total - 1, 0))


def gather_rows(flat: torch.Tensor, index: torch.Tensor, batch: int, kv_heads: int) -> torch.Tensor:
    """Padded ``[batch, kv_heads, width, ...]`` copy of a flat ``[slots, ...]`` buffer through ``index``
    ``[rows, width]`` (one ``index_select``)."""
    width = index.shape[1]
    return flat.index_select(0, index.reshape(-1)).view(batch, kv_heads, width, *flat.shape[1:])


def ragged_mask(
    lengths: torch.Tensor,
    width: int,
    batch: int,
    kv_heads: int,
    key_positions: torch.Tensor | None = None,
    query_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Visibility for a padded ragged view.

    Args:
        lengths: ``[batch * kv_heads]`` filled slots per row
        key_positions: ``[batch, kv_heads, width]`` positions of the padded view (None: a decoding step, which sees
            every stored entry)
        query_positions: ``[batch, q]`` (``-1`` = padding query, sees nothing); with ``key_positions``
    Returns:
        ``[batch, kv_heads, 1, width]`` (decoding) or ``[batch, kv_heads, q, width]``
    """
    cols = torch.arange(width, device=lengths.device)
    filled = (cols[None, :] < lengths[:, None]).view(batch, kv_heads, 1, width)
    if key_positions is None:
        return filled
    qpos = query_positions[:, None, :, None]
    return filled & (key_positions[:, :, None, :] <= qpos) & (qpos >= 0)


def flash_varlen_available(query: torch.Tensor) -> bool:
    """Whether :func:`flash_varlen_attention` can run for this query (flash-attn installed, CUDA, fp16/bf16)."""
    return _FLASH_ATTN and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 256


def varlen_offsets(start: torch.Tensor, length: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cu_seqlens_q`` and ``cu_seqlens_k`` (int32, ``2 * rows + 1``) describing every row ``r`` of a flat ragged
    buffer (rows in ascending ``start`` order) as kernel sequence ``2r`` (its ``length[r]`` keys) followed by its
    slack (up to the next row's start, or ``total``) as sequence ``2r + 1``; every sequence has exactly one query.

    One query per sequence is what flash-attn 2's varlen kernel requires of a decode step with more query heads than
    KV heads: with ``max_seqlen_q == 1`` it views ``q`` as ``[batch, nheads_k, ngroups, d]``, ``batch`` being the
    number of sequences, and reads sequence ``b``'s query from row ``b`` (``mha_varlen_fwd``,
    ``csrc/flash_attn/flash_api.cpp``), so a sequence without a query is not expressible there."""
    rows = start.shape[0]
    ends = torch.cat([start[1:], start.new_full((1,), total)])
    cu_k = torch.stack([start, start + length], dim=1).view(-1)
    cu_k = torch.cat([cu_k, ends[-1:]]).to(torch.int32)
    cu_q = torch.arange(2 * rows + 1, device=start.device, dtype=torch.int32)
    return cu_q, cu_k


def flash_varlen_attention(
    query: torch.Tensor,
    flat_keys: torch.Tensor,
    flat_values: torch.Tensor,
    start: torch.Tensor,
    length: torch.Tensor,
    max_row_slots: int,
    scaling: float,
    varlen_fn=None,
) -> torch.Tensor:
    """A decoding step over a ragged store with ``flash_attn_varlen_func``, no gather and no mask.

    Args:
        query: ``[batch, q_heads, 1, head_dim]``
        flat_keys, flat_values: ``[slots, head_dim]`` (rows back to back, each followed by its slack)
        start, length: ``[batch * kv_heads]`` row offsets (ascending) and filled lengths
        max_row_slots: an upper bound on any row's slots, its slack included (host-side; sizes the kernel grid)
        varlen_fn: the kernel (default ``flash_attn.flash_attn_varlen_func``; tests pass a reference)
    Returns:
        ``[batch, 1, q_heads, head_dim]``

    Each row is a kernel sequence and so is its slack (:func:`varlen_offsets`); the slack's sequence gets a copy of
    the row's query, whose output is dropped. That query reads the row's free slots (at most an eighth of the row
    plus 16 after a repack, see :meth:`RaggedStore._make_room`), the price of a layout the kernel accepts.
    """
    if varlen_fn is None:
        from flash_attn import flash_attn_varlen_func as varlen_fn
    b, hq, _, d = query.shape
    rows = start.shape[0]
    group = hq // (rows // b)
    # One sequence per (sequence, KV head) row and one per its slack; the query heads of a row are its group
    # (nheads = group, nheads_k = 1), and its slack's sequence gets the same query (output dropped).
    q = query.reshape(rows, 1, group, d).expand(rows, 2, group, d).reshape(2 * rows, group, d)
    cu_q, cu_k = varlen_offsets(start, length, flat_keys.shape[0])
    out = varlen_fn(
        q,
        flat_keys.unsqueeze(1),
        flat_values.unsqueeze(1),
        cu_q,
        cu_k,
        1,
        max_row_slots,
        softmax_scale=scaling,
        causal=False,
    )
    return out.view(rows, 2, group, d)[:, 0].reshape(b, hq, 1, d).transpose(1, 2)
