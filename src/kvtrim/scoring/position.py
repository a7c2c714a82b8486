"""Position-only scores (recency, for StreamingLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import LayerView, Scorer
from .observation import ObservationSpec


@dataclass
class RecencyScorer(Scorer):
    """Score = logical position: the most recent entries rank highest."""

    # capabilities (read by the method registry, kvtrim.methods.registry)
    uses_attention = False
    question_aware = False
    runs_in_vllm = True

    observation: ObservationSpec = field(default_factory=ObservationSpec)

    def score(self, view: LayerView) -> torch.Tensor:
        return view.positions.float()
