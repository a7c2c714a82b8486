"""Attention with per-head lengths on vLLM's CPU kernel: every (request, KV head) becomes a one-head sequence.

vLLM's CPU kernels (``cpu_attention_with_kv_cache``, ``cpu_attn_reshape_and_cache``) take one block table and one
length per sequence for all KV heads. Viewing the cache ``[num_blocks, H, bs, 2·D]`` as
``[num_blocks·H, 1, bs, 2·D]`` (free: the cache is contiguous and head-major inside a block) makes each head slice
of a block a one-head *sub-page*. Folding the KV heads into the batch, sequence ``r·H + h`` holds request ``r``'s
query rows for the ``G = Hq/H`` query heads of KV head ``h``, its own sub-page table and its own length; the same
kernels then run with ``num_kv_heads = 1``. A request with every head at the same length and the default
sub-pages (``block·H + h``) gives exactly vLLM's own result (tests/vllm/test_folded_attention.py).
"""

from __future__ import annotations

import numpy as np
import torch


def folded_rows(query_start_loc: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the folded batch's query rows come from.

    Args:
        query_start_loc: ``[R + 1]`` the step's query row offsets per request
    Returns:
        ``token, head``: ``[N·H]`` source row and KV head of each folded row (order: request, head, token), and
        the folded ``query_start_loc`` ``[R·H + 1]`` (int32)
    """
    qsl = query_start_loc.to("cpu", torch.long)
    counts = (qsl[1:] - qsl[:-1]).repeat_interleave(kv_heads)  # [R·H]
    folded_qsl = torch.zeros(counts.numel() + 1, dtype=torch.int32)
    folded_qsl[1:] = counts.cumsum(0)
    total = int(folded_qsl[-1])
    starts = qsl[:-1].repeat_interleave(kv_heads)
    seq = torch.arange(counts.numel()).repeat_interleave(counts)
    offset = torch.arange(total) - folded_qsl[:-1].long().repeat_interleave(counts)
    token = starts.repeat_interleave(counts) + offset
    head = (seq % kv_heads) if kv_heads else seq
    return token, head, folded_qsl


def default_subpage_table(block_table: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[R·H, P]`` sub-page tables of requests stored as vLLM stores them (head ``h`` of block ``b``: ``b·H + h``).

    Args:
        block_table: ``[R, P]`` vLLM's block table rows
    """
    heads = torch.arange(kv_heads, dtype=block_table.dtype, device=block_table.device).view(1, -1, 1)
    return (block_table.unsqueeze(1) * kv_heads + heads).reshape(-1, block_table.shape[-1])


def default_subpage_slots(slot_mapping: torch.Tensor, kv_heads: int, block_size: int) -> torch.Tensor:
    """``[N, H]`` one-head slots of vLLM's slot mapping ``[N]`` (padding ``-1`` stays ``-1``)."""
    sl = slot_mapping.to(torch.long).view(-1, 1)
    heads = torch.arange(kv_heads, device=sl.device).view(1, -1)
    folded = ((sl // block_size) * kv_heads + heads) * block_size + sl % block_size
    return torch.where(sl >= 0, folded, torch.full_like(folded, -1))


def per_head_tables(
    table: torch.Tensor, seq_lens: torch.Tensor, rows: list[tuple[int, object]], num_layers: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's folded sub-page table and lengths for one step, built once for all layers.

    Args:
        table: ``[R·H, P]`` the step's default sub-page table (:func:`default_subpage_table`, CPU)
        seq_lens: ``[R·H]`` the step's default lengths (vLLM's, repeated per KV head)
        rows: ``(batch index, sub-pages)`` of the requests whose heads hold their own sub-pages
            (:class:`~kvtrim.vllm.subpages.RequestSubPages`)
    Returns:
        ``[layers, R·H, W]`` int32 tables (``W`` the longest page list; unused entries 0) and ``[layers, R·H]``
        int32 lengths; row ``i·H + h`` of layer ``l`` is head ``h`` of request ``i`` in that layer.
    """
    rh, width = table.shape
    counts = {i: pages.page_counts() for i, pages in rows}
    width = max([width, *(int(c.max(initial=0)) for c in counts.values())])
    out = np.zeros((num_layers, rh, width), dtype=np.int32)
    out[:, :, : table.shape[1]] = table.to(torch.int32).numpy()
    lens = np.repeat(seq_lens.to(torch.int32).numpy()[None], num_layers, axis=0)
    for i, pages in rows:
        h = pages.kv_heads
        w = min(width, pages.page_ids.shape[-1])
        held = np.arange(w) < counts[i][..., None]  # [layers, heads, w]
        out[:, i * h : (i + 1) * h] = 0
        out[:, i * h : (i + 1) * h, :w] = np.where(held, pages.page_ids[..., :w], 0)
        lens[:, i * h : (i + 1) * h] = pages.lengths
    return torch.from_numpy(out), torch.from_numpy(lens)


def _subpage_caches(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    num_blocks, kv_heads, block_size, two_d = kv_cache.shape
    view = kv_cache.view(num_blocks * kv_heads, 1, block_size * 2, two_d // 2)
    key_cache, value_cache = view.chunk(2, dim=2)
    return key_cache, value_cache


def folded_cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    isa: str,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_cache_dtype: str = "auto",
) -> None:
    """Write ``key``/``value`` ``[N, H, D]`` to one-head slots ``[N, H]`` (``sub_page·bs + offset``; ``-1`` skips);
    an fp8 cache (``kv_cache_dtype``) stores them encoded with the layer's ``k_scale`` / ``v_scale``."""
    from vllm import _custom_ops as ops

    n, heads, dim = key.shape
    key_cache, value_cache = _subpage_caches(kv_cache)
    ops.cpu_attn_reshape_and_cache(
        key.reshape(n * heads, 1, dim),
        value.reshape(n * heads, 1, dim),
        key_cache,
        value_cache,
        slots.reshape(-1).to(torch.long),
        isa,
        k_scale=k_scale,
        v_scale=v_scale,
        kv_cache_dtype=kv_cache_dtype,
    )


def folded_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    output: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    subpage_table: torch.Tensor,
    scale: float,
    isa: str,
    softcap: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_cache_dtype: str = "auto",
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of each (request, KV head) over its own sub-pages; writes and returns ``output``.

    Args:
        query: ``[N, Hq, D]`` the step's queries (query head ``q`` belongs to KV head ``q // G``)
        kv_cache: ``[num_blocks, H, bs, 2·D]`` the layer's CPU cache
        output: ``[N, Hq, D]`` (or any view of that shape) written in place
        query_start_loc: ``[R + 1]`` the query rows of each request
        seq_lens: ``[R·H]`` entries of each (request, head) after this step's writes
        subpage_table: ``[R·H, P]`` int32 sub-page ids of each (request, head), in entry order
        k_scale, v_scale, kv_cache_dtype: an fp8 cache's format and the layer's scales (as vLLM passes them)
        rows: :func:`folded_rows` of ``query_start_loc`` when the caller has them (one step's layers share them)
    """
    from vllm import _custom_ops as ops
    from vllm import envs

    n, q_heads, dim = query.shape
    kv_heads = kv_cache.shape[1]
    group = q_heads // kv_heads
    token, head, folded_qsl = folded_rows(query_start_loc, kv_heads) if rows is None else rows
    one_row_each = folded_qsl.numel() == n * kv_heads + 1 and bool((folded_qsl.diff() == 1).all())
    if one_row_each:  # one query row per request (decoding): the folded order is the tokens' own
        q = query.reshape(n * kv_heads, group, dim).contiguous()
    else:
        q = query.view(n, kv_heads, group, dim)[token, head].contiguous()  # [N·H, G, D]
    out = torch.empty_like(q)
    seq_lens = seq_lens.to(torch.int32).contiguous()
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=seq_lens.numel(),
        num_heads=group,
        num_kv_heads=1,
        head_dim=dim,
        seq_lens=seq_lens,
        dtype=query.dtype,
        query_start_loc=folded_qsl,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        kv_cache_dtype=kv_cache_dtype,
    )
    key_cache, value_cache = _subpage_caches(kv_cache)
    ops.cpu_attention_with_kv_cache(
        query=q,
        key_cache=key_cache,
        value_cache=value_cache,
        output=out,
        query_start_loc=folded_qsl,
        seq_lens=seq_lens,
        scale=scale,
        causal=True,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=subpage_table.to(torch.int32).contiguous(),
        softcap=softcap,
        scheduler_metadata=metadata,
        s_aux=None,
        k_scale=k_scale,
        v_scale=v_scale,
        kv_cache_dtype=kv_cache_dtype,
    )
    if one_row_each:
        output.view(n, kv_heads, group, dim).copy_(out.view(n, kv_heads, group, dim))
    else:
        output.view(n, kv_heads, group, dim)[token, head] = out
    return output
