"""HeadKV budgets whose head scores come from the model's calibration artifact."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import InvalidParameterError
from .base import BudgetAllocator, BudgetRequest
from .head_scores import DEFAULT_BETA, DEFAULT_TEMPERATURE, HeadScoreBudget


@dataclass
class ArtifactHeadScoreBudget(BudgetAllocator):
    """:class:`HeadScoreBudget` loaded from the ``headkv`` artifact of the model it is bound to.

    Binding happens when a method is resolved for a model (``kvtrim.generate``, ``Session``, ``compressing``…);
    a model with no artifact raises :class:`~kvtrim.errors.MissingArtifactError` naming
    ``kvtrim calibrate headkv`` before anything runs.
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    varies_by = "head"
    artifact_kind = "headkv"
    runs_in_vllm = True  # counts fixed before scoring: one-head sub-pages sized by the largest layer (kvtrim.vllm)

    beta: float = DEFAULT_BETA
    temperature: float = DEFAULT_TEMPERATURE
    window: int = 8
    scores: str = "retrieval_reasoning"
    path: str | None = None
    _inner: HeadScoreBudget | None = field(default=None, repr=False)

    def bind(self, model: torch.nn.Module) -> None:
        self._inner = HeadScoreBudget.from_artifact(
            model, self.path, self.scores, beta=self.beta, temperature=self.temperature, window=self.window
        )

    def allocate(self, request: BudgetRequest, scores: list[torch.Tensor]) -> torch.Tensor:
        if self._inner is None:
            raise InvalidParameterError(
                "HeadKV budgets need the model's head scores: resolve the method through kvtrim.generate, "
                "kvtrim.Session or kvtrim.compressing, or call pipeline.bind(model) first"
            )
        return self._inner.allocate(request, scores)
