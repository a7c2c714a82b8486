"""Key-norm scores: low-norm keys draw attention (KNorm)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import LayerView, Scorer
from .observation import ObservationSpec


@dataclass
class KeyNormScorer(Scorer):
    """Score ``-‖k‖₂`` per entry: the lowest-norm keys are kept. Needs no attention weights."""

    # capabilities (read by the method registry, kvtrim.methods.registry)
    uses_attention = False
    question_aware = False
    runs_in_vllm = True

    observation: ObservationSpec = field(default_factory=ObservationSpec)

    def score(self, view: LayerView) -> torch.Tensor:
        return -view.keys.float().norm(dim=-1)
