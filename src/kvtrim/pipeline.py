"""A compression method as a composition: scorer → budget allocator → selector."""

from __future__ import annotations

from dataclasses import dataclass, field

from .budgets.base import BudgetAllocator
from .scoring.base import Scorer
from .scoring.observation import ObservationSpec
from .selection.topk import TopKSelector


@dataclass
class Pipeline:
    """One configured compression method.

    Attributes:
        name: registry name
        scorer: how much each entry matters
        budget: how many entries each (layer, KV head) keeps
        selector: which entries, under those budgets
        params: the configuration the method was built with (recorded in results)
    """

    name: str
    scorer: Scorer
    budget: BudgetAllocator
    selector: TopKSelector
    params: dict = field(default_factory=dict)

    @property
    def observation(self) -> ObservationSpec:
        return self.scorer.observation
