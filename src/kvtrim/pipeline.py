"""A compression method as a composition: scorer → budget allocator → selector."""

from __future__ import annotations

from dataclasses import dataclass, field

from .budgets.base import BudgetAllocator
from .schedule import AfterPrefill, Schedule
from .scoring.base import Scorer
from .scoring.observation import ObservationSpec
from .selection.base import Selector


@dataclass
class Pipeline:
    """One configured compression method.

    Attributes:
        name: registry name
        scorer: how much each entry matters
        budget: how many entries each (layer, KV head) keeps
        selector: which entries, under those budgets
        params: the configuration the method was built with (recorded in results)
        layout: storage after compression: ``auto`` (dense when every head keeps the same count, else ragged),
            ``dense`` (pad every head to the widest one), or ``ragged`` (exact counts per head)
        schedule: when to compress (:mod:`kvtrim.schedule`); the default compresses once after prefill
    """

    name: str
    scorer: Scorer
    budget: BudgetAllocator
    selector: Selector
    params: dict = field(default_factory=dict)
    layout: str = "auto"
    schedule: Schedule = field(default_factory=AfterPrefill)

    def __post_init__(self) -> None:
        if self.layout not in ("auto", "dense", "ragged"):
            raise ValueError(f"layout must be 'auto', 'dense' or 'ragged', got {self.layout!r}")

    def bind(self, model) -> Pipeline:
        """Let parts that depend on the model (offline artifacts) load what they need; returns self."""
        for part in (self.scorer, self.budget, self.selector):
            bind = getattr(part, "bind", None)
            if bind is not None:
                bind(model)
        return self

    def check(self, ratio: float | None, budget: int | None) -> None:
        """Raise :class:`~kvtrim.errors.InvalidParameterError` if a part cannot work with this ratio/budget."""
        for part in (self.scorer, self.budget, self.selector):
            check = getattr(part, "check", None)
            if check is not None:
                check(ratio, budget)

    @property
    def observation(self) -> ObservationSpec:
        return self.scorer.observation
