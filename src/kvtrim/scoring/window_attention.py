"""Observation-window attention scores (SnapKV family)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import LayerView, Scorer
from .observation import ObservationSpec
from .reduce import pool_sequence, reduce_group


@dataclass
class WindowAttentionScorer(Scorer):
    """Attention that the last ``window`` prompt queries pay to each entry.

    Per query head: aggregate over the window queries (``mean`` or ``sum``), then reduce over the GQA group
    (``group_reduce``) and pool along the sequence, in the order ``pool_first`` says.

    Args:
        window: observation window size ``w``
        kernel, pooling: sequence pooling (``max``/``avg``/``none``)
        aggregate: how window queries combine, ``mean`` or ``sum`` (same ranking)
        group_reduce: ``mean``, ``max`` or ``sum`` over the query heads of a KV head
        pool_first: pool per query head before the group reduction (kvpress order) instead of after (AdaKV)
        head_mean: average the final scores over all KV heads of the layer, so every head keeps the same
            entries (TOVA)
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    uses_attention = True
    question_aware = True
    runs_in_vllm = True

    window: int = 32
    kernel: int = 7
    pooling: str = "max"
    aggregate: str = "mean"
    group_reduce: str = "mean"
    pool_first: bool = False
    head_mean: bool = False
    observation: ObservationSpec = field(init=False)

    def __post_init__(self) -> None:
        if self.window <= 0:
            raise ValueError(f"window must be positive, got {self.window}")
        self.observation = ObservationSpec(window=self.window)

    def per_query_head(self, view: LayerView) -> torch.Tensor:
        """``[batch, q_heads, seq]`` window attention aggregated over the window queries."""
        probs = view.window_attention(self.window)
        return probs.mean(2) if self.aggregate == "mean" else probs.sum(2)

    def score(self, view: LayerView) -> torch.Tensor:
        scores = self.per_query_head(view)
        if self.pool_first:
            scores = reduce_group(pool_sequence(scores, self.kernel, self.pooling), view.kv_heads, self.group_reduce)
        else:
            scores = pool_sequence(reduce_group(scores, view.kv_heads, self.group_reduce), self.kernel, self.pooling)
        if self.head_mean:
            scores = scores.mean(1, keepdim=True).expand_as(scores)
        return scores
