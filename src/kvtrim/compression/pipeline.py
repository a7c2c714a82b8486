"""A compression method as a composition: scorer → budget allocator → selector."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..budgets.base import BudgetAllocator
from ..errors import InvalidParameterError
from ..scoring.base import Scorer
from ..scoring.observation import ObservationSpec
from ..selection.base import Selector
from ..selection.key_channels import QueryDrivenChannels
from ..selection.merge import ValueMerge
from ..selection.rerotation import KeyRerotation
from ..selection.restore_tokens import AppendedEntries
from .schedule import AfterPrefill, Schedule


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
        schedule: when to compress (:mod:`kvtrim.compression.schedule`); the default compresses once after prefill
        channels: optional key-channel pruning applied after the token selection (ThinK); the layer's keys are
            then stored with fewer channels (:class:`~kvtrim.cache.channel_pruned.ChannelPrunedStore`)
        merge: optional merge on evict between selection and compaction (``merge(view, selection)`` returns the
            layer's values with the evicted ones folded into kept entries; the store keeps those values)
        rerotate: optional key re-rotation between selection and compaction: the kept keys are rotated to, and
            recorded at, contiguous positions ending where the context ends (``rerotate(view, selection)``)
        append: optional entries added to every layer after eviction that take part of the budget (RestoreKV's
            restore tokens, :class:`~kvtrim.selection.restore_tokens.AppendedEntries`)
    """

    name: str
    scorer: Scorer
    budget: BudgetAllocator
    selector: Selector
    params: dict = field(default_factory=dict)
    layout: str = "auto"
    schedule: Schedule = field(default_factory=AfterPrefill)
    channels: QueryDrivenChannels | None = None
    merge: ValueMerge | None = None
    rerotate: KeyRerotation | None = None
    append: AppendedEntries | None = None

    def __post_init__(self) -> None:
        if self.layout not in ("auto", "dense", "ragged"):
            raise ValueError(f"layout must be 'auto', 'dense' or 'ragged', got {self.layout!r}")
        for name, part, base in (
            ("scorer", self.scorer, Scorer),
            ("budget", self.budget, BudgetAllocator),
            ("selector", self.selector, Selector),
        ):
            if not isinstance(part, base):  # the hooks the compressor calls are declared on the base classes
                raise InvalidParameterError(
                    f"{name}={type(part).__name__}: a pipeline's {name} must subclass "
                    f"{base.__module__}.{base.__qualname__}"
                )

    def stores_dense(self, uniform: bool) -> bool:
        """Whether a compressed layer stays dense (``uniform``: every head of it keeps the same count)."""
        return self.layout == "dense" or (self.layout == "auto" and uniform)

    def bind(self, model) -> Pipeline:
        """Let parts that depend on the model (offline artifacts) load what they need; returns self."""
        for part in self.parts:
            part.bind(model)
        return self

    @property
    def parts(self) -> tuple:
        """The scorer, the budget allocator, the selector and the appended entries when there are some."""
        extra = () if self.append is None else (self.append,)
        return (self.scorer, self.budget, self.selector, *extra)

    def check(self, ratio: float | None, budget: int | None) -> None:
        """Raise :class:`~kvtrim.errors.InvalidParameterError` if a part cannot work with this ratio/budget."""
        for part in self.parts:
            part.check(ratio, budget)
        if self.append is not None and self.schedule.continuous:
            raise InvalidParameterError(
                f"method {self.name!r} appends its entries once after prefill; a decoding-time schedule would append "
                "them again at every compression: use it without '@schedule'"
            )
        if self.channels is not None:
            self.channels.check(ratio, budget)
            if self.schedule.continuous:
                raise InvalidParameterError(
                    f"method {self.name!r} prunes key channels once after prefill; a decoding-time schedule would "
                    "have to re-score keys that lost channels: use it without '@schedule'"
                )

    @property
    def observation(self) -> ObservationSpec:
        spec = self.scorer.observation
        if self.channels is not None:
            spec = spec.merge(self.channels.observation)
        if self.merge is not None:
            spec = spec.merge(self.merge.observation)
        return spec
