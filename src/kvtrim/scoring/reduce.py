"""Shared score transforms: pooling along the sequence and reduction over a GQA query group."""

from __future__ import annotations

import torch
import torch.nn.functional as F

POOLINGS = ("max", "avg", "none")
GROUP_REDUCTIONS = ("mean", "max", "sum")


def pool_sequence(scores: torch.Tensor, kernel: int, pooling: str) -> torch.Tensor:
    """1-D pooling along the last axis with stride 1 and ``kernel // 2`` padding (length preserved).

    Args:
        scores: ``[..., seq]``
    """
    if pooling == "none" or kernel <= 1:
        return scores
    shape = scores.shape
    flat = scores.reshape(-1, 1, shape[-1])
    if pooling == "max":
        out = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    elif pooling == "avg":
        out = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2)  # padding counts as zeros, as SnapKV does
    else:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    return out[..., : shape[-1]].reshape(shape)


def reduce_group(scores: torch.Tensor, kv_heads: int, how: str) -> torch.Tensor:
    """Reduce per-query-head scores ``[batch, q_heads, seq]`` to ``[batch, kv_heads, seq]``.

    Query head ``h`` belongs to KV head ``h // (q_heads // kv_heads)``, matching transformers' ``repeat_kv``.
    """
    b, hq, s = scores.shape
    grouped = scores.view(b, kv_heads, hq // kv_heads, s)
    if how == "mean":
        return grouped.mean(2)
    if how == "max":
        return grouped.amax(2)
    if how == "sum":
        return grouped.sum(2)
    raise ValueError(f"group reduction must be one of {GROUP_REDUCTIONS}, got {how!r}")
