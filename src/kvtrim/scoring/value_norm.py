"""Projected value norms ‖v·W_O‖₁ (CriticalKV's value term)."""

from __future__ import annotations

import torch

from ..cache.attention import low_precision_matmul

MAX_PROJECTED = 1 << 26  # projected entries per chunk (256 MiB in fp32)


def projected_value_norms(values: torch.Tensor, o_proj_weight: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """L1 norm of each value projected by the output matrix of each query head, averaged over the GQA group.

    For query head ``h`` of KV group ``g``: ``n_i^(h) = ‖v_i^(g) · W_O[h]‖₁`` with ``W_O[h]`` the ``[head_dim,
    hidden]`` slice of the output projection that head ``h`` feeds; ``n_i^(g) = mean_{h∈g} n_i^(h)``. Tokens are
    processed ``chunk`` at a time (fewer when ``batch × q_heads × hidden`` is large, so a chunk holds at most
    ``MAX_PROJECTED`` projected entries): no ``[tokens × hidden]`` tensor per head is held for long sequences.

    Args:
        values: ``[batch, kv_heads, seq, head_dim]``
        o_proj_weight: ``[hidden, q_heads * head_dim]`` (``nn.Linear`` layout)
    Returns:
        ``[batch, kv_heads, seq]`` fp32
    """
    b, hkv, s, d = values.shape
    hidden = o_proj_weight.shape[0]
    hq = o_proj_weight.shape[1] // d
    low = low_precision_matmul(values, o_proj_weight)
    # on accelerators with fp16/bf16 weights: the projection in that dtype (tensor cores), the L1 sum in fp32, and
    # no fp32 copy of W_O; elsewhere fp32 throughout
    w = (o_proj_weight if low else o_proj_weight.float()).view(hidden, hkv, hq // hkv, d).permute(1, 2, 3, 0)
    chunk = max(1, min(chunk, MAX_PROJECTED // max(1, b * hq * hidden)))  # [b, kv, group, c, hidden] bounded
    out = values.new_empty(b, hkv, s, dtype=torch.float32)
    for start in range(0, s, chunk):
        v = values[:, :, start : start + chunk]  # [b, kv, c, d]
        projected = torch.einsum("bkcd,kgde->bkgce", v if low else v.float(), w)  # [b, kv, group, c, hidden]
        out[:, :, start : start + chunk] = projected.abs_().sum(-1, dtype=torch.float32).mean(2)
    return out
