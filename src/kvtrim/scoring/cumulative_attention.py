"""Attention accumulated over every prompt query (H2O's heavy-hitter statistic)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import LayerView, Scorer
from .observation import ObservationSpec


@dataclass
class CumulativeAttentionScorer(Scorer):
    """Sum over all prompt queries (and the query heads of each group) of the attention paid to each entry.

    The sums are accumulated while the prompt is prefilled, ``chunk`` queries at a time, so memory stays at
    ``chunk × seq`` per head instead of ``seq × seq``.
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    uses_attention = True
    question_aware = False  # every prompt query counts alike

    chunk: int = 256
    observation: ObservationSpec = field(init=False)

    def __post_init__(self) -> None:
        self.observation = ObservationSpec(accumulate=("attn_sum",), chunk=self.chunk)

    def score(self, view: LayerView) -> torch.Tensor:
        return view.stats["attn_sum"].clone()
