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
    from ..compression.compressor import BudgetSpec, CompressionReport
    from ..compression.pipeline import Pipeline


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
        budget: how much to keep (a :class:`kvtrim.compression.compressor.BudgetSpec`); required with ``pipeline``
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
        self.reports: list[CompressionReport] = []  # every compression, in order (decode-time ones included)
        self.compressions = 0
        self.tokens_since_compression = 0
        self.peak_kv_bytes = 0  # largest K/V bytes held at the start of a forward pass (or after a compression)
        self._prefilled_uncompressed = False
        self._decoding = False  # a one-token step followed a prompt (auto_compress caches: no new prompt after)
        self._unconsumed: int | None = None  # layer whose update was not yet consumed by kvtrim attention
        # [batch, w] log p(x_j | x_<j) of the last prompt tokens (NaN: padding or not recorded); set by kvtrim.api
        # when the method's observation asks for token_logprobs
        self.prompt_logprobs: torch.Tensor | None = None
        self._last_logprobs: torch.Tensor | None = None  # [batch, vocab] log-softmax of the last prefill position
        # [batch, n] the prompt's token ids (-1: padding), when the method's observation asks for input_ids
        self.prompt_ids: torch.Tensor | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def schedule(self):
        return None if self.pipeline is None else self.pipeline.schedule

    def _before_forward(self, new_tokens: int) -> None:
        """Called at layer 0 of every forward pass, before anything is stored."""
        if self.auto_compress and self._decoding and new_tokens != 1:
            # a new prompt after decoding: the cache is being reused by a second generate call
            raise InvalidParameterError(
                "this KVTrimCache was already used by a generate call; a cache serves one generate call: make a "
                "new one (kvtrim.make_cache), or call model.generate without past_key_values inside "
                "kvtrim.compressing, which supplies a fresh cache to every call"
            )
        self._decoding = self._decoding or (new_tokens == 1 and self.layers[0].seen > 0)
        self._track_peak()
        if self._prefilled_uncompressed and self.auto_compress:
            self.compress()
        elif self.compressions and self.schedule.continuous and self.schedule.due(self):
            self.compress()  # decoding-time compression: the new tokens attend to the compressed cache
        if self.observing and new_tokens > 1 and not self.compressions:
            self._prefilled_uncompressed = True
        self.tokens_since_compression += new_tokens

    def compress(self, logits: torch.Tensor | None = None, keep_observing: bool = False) -> CompressionReport:
        """Apply the method to everything stored so far.

        Observation stops afterwards unless the method's schedule compresses again later (or ``keep_observing``,
        used between the chunks of a chunked prefill).
        """
        from ..compression.compressor import compress_cache

        if self.pipeline is None:
            raise InvalidParameterError("this KVTrimCache has no compression method")
        report = compress_cache(self, self.pipeline, self.budget, logits=logits)
        self.last_report = report
        self.reports.append(report)
        self.compressions += 1
        self.tokens_since_compression = 0
        self._prefilled_uncompressed = False
        self.observing = keep_observing or self.schedule.continuous
        if not self.observing:
            for layer in self.layers:
                layer.observation = LayerObservation()
        self._track_peak()
        return report

    def _track_peak(self) -> None:
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.kv_nbytes())

    def kv_nbytes(self) -> int:
        """Bytes of the key and value tensors held right now (append slack included)."""
        return sum(layer.store.nbytes() for layer in self.kv_layers)

    def context_lengths(self) -> torch.Tensor | None:
        """``[batch]`` tokens seen per row (largest stored position + 1), or None while empty."""
        layers = self.kv_layers
        if not layers:
            return None
        store = layers[0].store
        if store.layout == "dense":
            latest = (
                store.positions.amax(dim=(1, 2))
                if store.length
                else torch.full((store.batch_size,), -1, device=store.positions.device)
            )
        else:
            latest = store.row_max_positions().view(store.batch_size, store.kv_heads).amax(dim=1)
        return (latest + 1).clamp(min=0)

    def clone(self, pipeline: Pipeline | None = None, budget: BudgetSpec | None = None) -> KVTrimCache:
        """An independent copy (tensors copied) that may carry another method and budget.

        Lets one prefill serve several methods: observations recorded for the union of their needs are copied
        with the entries.
        """
        other = KVTrimCache(len(self.layers), pipeline, budget, auto_compress=self.auto_compress)
        other.observing = self.observing and pipeline is not None
        other._prefilled_uncompressed = self._prefilled_uncompressed and pipeline is not None
        if pipeline is not None and pipeline is self.pipeline:  # a copy that carries on the same schedule
            other.compressions = self.compressions
            other.tokens_since_compression = self.tokens_since_compression
        other.peak_kv_bytes = self.kv_nbytes()
        other.prompt_logprobs = None if self.prompt_logprobs is None else self.prompt_logprobs.clone()
        other.prompt_ids = self.prompt_ids  # never written in place: appends build a new tensor
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            theirs.seen = mine.seen
            theirs.module = mine.module
            if pipeline is not None and pipeline is self.pipeline and mine.compressed_until is not None:
                theirs.compressed_until = mine.compressed_until.clone()
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
            kv_bytes=self.kv_nbytes(),
            index_bytes=sum(layer.store.index_nbytes() for layer in layers),
            seen_tokens=self.layers[0].seen,
        )

    def entries_per_layer_head(self) -> torch.Tensor:
        """``[batch, layers, kv_heads]`` real tokens held per layer and KV head."""
        return torch.stack([layer.store.entries_per_head() for layer in self.kv_layers], dim=1)
