"""``KVTrimCache``: a transformers ``Cache`` whose layers can be compressed in place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache

from ..errors import InvalidParameterError
from ..scoring.observation import LayerObservation, ObservationSpec
from .layer import CompressibleLayer

if TYPE_CHECKING:
    from ..compressor import BudgetSpec, CompressionReport
    from ..pipeline import Pipeline


@dataclass(frozen=True)
class CacheStats:
    """Entries and bytes held by a cache, measured from its tensors."""

    entries: int
    kv_bytes: int
    index_bytes: int
    seen_tokens: int

    def as_dict(self) -> dict:
        return {
            "entries": self.entries,
            "kv_bytes": self.kv_bytes,
            "index_bytes": self.index_bytes,
            "seen_tokens": self.seen_tokens,
        }


class KVTrimCache(Cache):
    """A KV cache that a compression method can shrink after prefill.

    Used two ways:
      * by :func:`kvtrim.generate`, which prefills, calls :meth:`compress` and decodes;
      * inside a user's own ``model.generate(..., past_key_values=cache)``: the prompt is prefilled exactly, and
        the cache compresses itself at the start of the next forward pass (question-aware mode).

    Args:
        num_layers: number of decoder layers of the model
        pipeline: the compression method (from :func:`kvtrim.methods.get_method`), or None for no compression
        budget: how much to keep (a :class:`kvtrim.compressor.BudgetSpec`); required with ``pipeline``
        auto_compress: compress automatically before the first forward pass that follows a prefill
    """

    def __init__(
        self,
        num_layers: int,
        pipeline: Pipeline | None = None,
        budget: BudgetSpec | None = None,
        auto_compress: bool = True,
    ):
        if num_layers <= 0:
            raise InvalidParameterError(f"num_layers must be positive, got {num_layers}")
        if pipeline is not None and budget is None:
            raise InvalidParameterError("a compression pipeline needs a budget (ratio or budget)")
        super().__init__(layers=[CompressibleLayer(self, i) for i in range(num_layers)])
        self.pipeline = pipeline
        self.budget = budget
        self.auto_compress = auto_compress
        self.observing = pipeline is not None
        self.observation_spec: ObservationSpec = pipeline.observation if pipeline is not None else ObservationSpec()
        self.last_report: CompressionReport | None = None
        self._prefilled_uncompressed = False
        self._unconsumed: int | None = None  # layer whose update was not yet consumed by kvtrim attention

    # ------------------------------------------------------------------ lifecycle
    def _before_forward(self, new_tokens: int) -> None:
        """Called at layer 0 of every forward pass, before anything is stored."""
        if self._prefilled_uncompressed and self.auto_compress:
            self.compress()
        if self.observing and new_tokens > 1:
            self._prefilled_uncompressed = True

    def compress(self, logits: torch.Tensor | None = None) -> CompressionReport:
        """Apply the method to everything stored so far, then stop observing."""
        from ..compressor import compress_cache

        if self.pipeline is None:
            raise InvalidParameterError("this KVTrimCache has no compression method")
        report = compress_cache(self, self.pipeline, self.budget, logits=logits)
        self.last_report = report
        self.observing = False
        self._prefilled_uncompressed = False
        for layer in self.layers:
            layer.observation = LayerObservation()
        return report

    def clone(self, pipeline: Pipeline | None = None, budget: BudgetSpec | None = None) -> KVTrimCache:
        """An independent copy (tensors copied) that may carry another method and budget.

        Lets one prefill serve several methods: observations recorded for the union of their needs are copied
        with the entries.
        """
        other = KVTrimCache(len(self.layers), pipeline, budget, auto_compress=self.auto_compress)
        other.observing = self.observing and pipeline is not None
        other._prefilled_uncompressed = self._prefilled_uncompressed and pipeline is not None
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            theirs.seen = mine.seen
            theirs.module = mine.module
            if mine.store is not None:
                theirs.store = mine.store.copy()
                theirs.is_initialized = True
                theirs.dtype, theirs.device = mine.dtype, mine.device
            theirs.observation = mine.observation.copy()
        return other

    @property
    def kv_layers(self) -> list[CompressibleLayer]:
        return [layer for layer in self.layers if layer.store is not None]

    # ------------------------------------------------------------------ rollback
    def mark(self) -> list[tuple]:
        """Remember the current end of every layer, to remove later appends with :meth:`rollback`."""
        return [(layer.store.mark() if layer.store else None, layer.seen) for layer in self.layers]

    def rollback(self, mark: list[tuple]) -> None:
        """Remove every entry appended after ``mark`` (e.g. a question and its answer)."""
        for layer, (store_mark, seen) in zip(self.layers, mark, strict=True):
            if layer.store is not None:
                layer.store.truncate_to(store_mark)
            layer.seen = seen

    # ------------------------------------------------------------------ accounting
    def stats(self) -> CacheStats:
        """Entries and bytes held right now, measured from the tensors."""
        layers = self.kv_layers
        return CacheStats(
            entries=sum(layer.store.entries() for layer in layers),
            kv_bytes=sum(layer.store.nbytes() for layer in layers),
            index_bytes=sum(layer.store.index_nbytes() for layer in layers),
            seen_tokens=self.layers[0].seen,
        )

    def entries_per_layer_head(self) -> torch.Tensor:
        """``[batch, layers, kv_heads]`` real tokens held per layer and KV head."""
        return torch.stack([layer.store.entries_per_head() for layer in self.kv_layers], dim=1)
