"""Attention kernels over kvtrim storage, GQA-native (KV heads are never repeated in memory)."""

from __future__ import annotations

import torch

from .packed_attention import attend_padded
from .sdpa import sdpa, sdpa_lower_right_causal


def grouped_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    causal: bool = False,
) -> torch.Tensor:
    """Scaled dot-product attention where each KV head serves a group of query heads.

    Args:
        query: ``[batch, q_heads, q, head_dim]``; query head ``h`` belongs to KV head ``h // group``.
        keys, values: ``[batch, kv_heads, s, head_dim]``
        mask: ``[batch, kv_heads, q, s]`` boolean (True = visible) or None
        causal: apply a causal mask aligned at the end (the queries are the last ``q`` of the ``s`` keys; only
            when ``mask`` is None)
    Returns:
        ``[batch, q, q_heads, head_dim]``
    """
    q, s = query.shape[2], keys.shape[2]
    if causal and mask is None and q > 1:
        group = query.shape[1] // keys.shape[1]
        if q == s:
            return sdpa(query, keys, values, is_causal=True, scale=scaling, enable_gqa=group > 1).transpose(1, 2)
        if q > s:
            raise ValueError(f"causal attention needs at most as many queries as keys, got {q} queries, {s} keys")
        return continued_causal_attention(query, keys, values, scaling)
    return attend_padded(query, keys, values, mask, scaling)


def continued_causal_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Causal attention of the last ``q`` positions over ``s >= q`` keys (a prompt chunk continuing a cache),
    through torch's lower-right causal bias: on CUDA the flash or memory-efficient kernel takes the alignment
    itself, so no ``[q, s]`` mask (let alone one per query head) is made. Shapes as :func:`grouped_attention`."""
    group = query.shape[1] // keys.shape[1]
    return sdpa_lower_right_causal(query, keys, values, scale=scaling, enable_gqa=group > 1).transpose(1, 2)


def low_precision_matmul(*tensors: torch.Tensor) -> bool:
    """Whether scoring matmuls run in the tensors' own fp16/bf16 dtype: on accelerators only (their tensor cores
    make it much faster than fp32); CPU scoring stays in fp32, unchanged."""
    return all(t.dtype in (torch.float16, torch.bfloat16) and t.device.type != "cpu" for t in tensors)


def attention_probabilities(
    query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """Softmax attention weights in fp32, per query head.

    Args:
        query: ``[batch, q_heads, q, head_dim]``
        keys: ``[batch, kv_heads, s, head_dim]``
        mask: ``[batch, kv_heads, q, s]`` boolean or None
    Returns:
        ``[batch, q_heads, q, s]`` fp32 (rows with no visible key are all zero); on CUDA with fp16/bf16 inputs the
        logits come from a matmul in that dtype (see :func:`low_precision_matmul`)
    """
    b, hq, tq, d = query.shape
    hkv = keys.shape[1]
    group = hq // hkv
    q = query.reshape(b, hkv, group * tq, d)
    if low_precision_matmul(query, keys):
        # The logits in the model's dtype (tensor cores, fp32 accumulation), scaled and normalized in fp32 as
        # eager attention does: no fp32 copy of the layer's keys.
        logits = torch.matmul(q, keys.transpose(-1, -2)).float().mul_(scaling).view(b, hkv, group, tq, -1)
    else:
        q = q.float() * scaling  # scale the queries, not the larger logits
        logits = torch.matmul(q, keys.float().transpose(-1, -2)).view(b, hkv, group, tq, -1)
    if mask is None:
        return torch.softmax(logits, dim=-1).reshape(b, hq, tq, -1)
    logits = logits.masked_fill_(~mask[:, :, None], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    seen = mask.any(-1)  # [b, hkv, tq]
    # rows that see nothing are NaN after softmax: make them zero (off the CPU without the host sync of a check)
    if probs.device.type != "cpu" or not bool(seen.all()):
        probs = probs.masked_fill_(~seen[:, :, None, :, None], 0.0)
    return probs.reshape(b, hq, tq, -1)
