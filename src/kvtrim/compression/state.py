"""The compression policy of one cache: which method, how much to keep, when to compress, what it did.

The cache (:class:`kvtrim.integration.cache.KVTrimCache`) holds the entries; a :class:`CompressionState` holds
the method and the budget, decides at the start of every forward pass whether to compress (after a prefill, or
when the method's schedule says so), runs the compressor, and keeps the reports and counters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import InvalidParameterError
from ..scoring.observation import LayerObservation, ObservationSpec
from .compressor import BudgetSpec, CompressionReport, compress_cache

if TYPE_CHECKING:
    from .pipeline import Pipeline
    from .schedule import Schedule
    from .target import CompressibleCache

__all__ = ["CompressionState"]

REUSED_CACHE = (
    "this KVTrimCache was already used by a generate call; a cache serves one generate call: make a new one "
    "(kvtrim.make_cache), or call model.generate without past_key_values inside kvtrim.compressing, which supplies "
    "a fresh cache to every call"
)


class CompressionState:
    """Pipeline, budget, schedule, reports and counters of one cache.

    Args:
        pipeline: the compression method (from :func:`kvtrim.methods.get_method`), or None for no compression
        budget: how much to keep; required with ``pipeline``
        auto_compress: compress automatically before the first forward pass that follows a prefill
    """

    def __init__(self, pipeline: Pipeline | None = None, budget: BudgetSpec | None = None, auto_compress: bool = True):
        if pipeline is not None and budget is None:
            raise InvalidParameterError("a compression pipeline needs a budget (ratio or budget)")
        self.pipeline = pipeline
        self.budget = budget
        self.auto_compress = auto_compress
        self.observing = pipeline is not None
        self.observation_spec: ObservationSpec = pipeline.observation if pipeline is not None else ObservationSpec()
        self.last_report: CompressionReport | None = None
        self.reports: list[CompressionReport] = []  # every compression, in order (decode-time ones included)
        self.compressions = 0
        self.tokens_since_compression = 0
        self.prefilled_uncompressed = False
        self.decoding = False  # a one-token step followed a prompt (auto_compress caches: no new prompt after)

    @property
    def schedule(self) -> Schedule | None:
        return None if self.pipeline is None else self.pipeline.schedule

    def before_forward(self, cache: CompressibleCache, new_tokens: int) -> None:
        """Called at layer 0 of every forward pass of ``cache``, before anything is stored: compresses when due."""
        if self.auto_compress and self.decoding and new_tokens != 1:
            # a new prompt after decoding: the cache is being reused by a second generate call
            raise InvalidParameterError(REUSED_CACHE)
        self.decoding = self.decoding or (new_tokens == 1 and cache.layers[0].seen > 0)
        cache.track_peak()
        if self.prefilled_uncompressed and self.auto_compress:
            self.compress(cache)
        elif self.compressions and self.schedule.continuous and self.schedule.due(cache):
            self.compress(cache)  # decoding-time compression: the new tokens attend to the compressed cache
        if self.observing and new_tokens > 1 and not self.compressions:
            self.prefilled_uncompressed = True
        self.tokens_since_compression += new_tokens

    def compress(self, cache: CompressibleCache, logits=None, keep_observing: bool = False) -> CompressionReport:
        """Apply the method to everything ``cache`` stores so far.

        Observation stops afterwards unless the method's schedule compresses again later (or ``keep_observing``,
        used between the chunks of a chunked prefill).
        """
        if self.pipeline is None:
            raise InvalidParameterError("this KVTrimCache has no compression method")
        report = compress_cache(cache, self.pipeline, self.budget, logits=logits)
        self.last_report = report
        self.reports.append(report)
        self.compressions += 1
        self.tokens_since_compression = 0
        self.prefilled_uncompressed = False
        self.observing = keep_observing or self.schedule.continuous
        if not self.observing:
            for layer in cache.layers:
                layer.observation = LayerObservation()
        cache.track_peak()
        return report

    def copy_for(self, pipeline: Pipeline | None, budget: BudgetSpec | None) -> CompressionState:
        """The state of a copy of the cache that carries ``pipeline`` and ``budget``: observation and the pending
        prefill carry over when it compresses at all; counters when it carries on the same method."""
        other = CompressionState(pipeline, budget, auto_compress=self.auto_compress)
        other.observing = self.observing and pipeline is not None
        other.prefilled_uncompressed = self.prefilled_uncompressed and pipeline is not None
        if pipeline is not None and pipeline is self.pipeline:  # a copy that carries on the same schedule
            other.compressions = self.compressions
            other.tokens_since_compression = self.tokens_since_compression
        return other
