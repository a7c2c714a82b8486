"""Random scores: a sanity floor every real method must beat."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import LayerView, Scorer
from .observation import ObservationSpec


@dataclass
class RandomScorer(Scorer):
    """Uniform random scores, reproducible from ``seed`` (and the layer index)."""

    # capabilities (read by the method registry, kvtrim.methods.registry)
    uses_attention = False
    question_aware = False
    runs_in_vllm = True

    seed: int = 0
    observation: ObservationSpec = field(default_factory=ObservationSpec)

    def score(self, view: LayerView) -> torch.Tensor:
        # drawn on the CPU so a seed gives the same scores on every device
        gen = torch.Generator(device="cpu").manual_seed(self.seed * 100_003 + view.layer_idx)
        return torch.rand(view.positions.shape, generator=gen, device="cpu").to(view.positions.device)
