"""Key dissimilarity to the mean key (KeyDiff)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import LayerView, Scorer
from .observation import ObservationSpec


def key_diff_scores(keys: torch.Tensor, valid: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``-cos(k_i, anchor)`` with ``anchor`` the mean of the unit-normalized valid keys of each head.

    Args:
        keys: ``[batch, kv_heads, seq, head_dim]``
        valid: ``[batch, kv_heads, seq]`` True where a slot holds a real token
    Returns:
        ``[batch, kv_heads, seq]`` fp32 (higher = more distinctive = keep); empty slots score 0
    """
    unit = torch.nn.functional.normalize(keys.float(), dim=-1, eps=eps) * valid[..., None]
    count = valid.sum(-1, keepdim=True).clamp(min=1)  # [b, h, 1]
    anchor = unit.sum(2) / count  # [b, h, d]
    anchor = torch.nn.functional.normalize(anchor, dim=-1, eps=eps)
    return -(unit * anchor[:, :, None, :]).sum(-1)


@dataclass
class KeyDiffScorer(Scorer):
    """KeyDiff (Park et al., 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM
    Inference in Resource-Constrained Environments", arXiv 2504.15364).

    Attention-free: each KV head keeps the keys whose direction differs most from the anchor, the mean of that
    head's unit-normalized keys (score ``-cos(k, anchor)``). Needs no observation, so it is the same in
    context-only and question-aware mode.
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    uses_attention = False
    question_aware = False

    observation: ObservationSpec = field(default_factory=ObservationSpec)

    def score(self, view: LayerView) -> torch.Tensor:
        return key_diff_scores(view.keys, view.valid)
