"""Defaults shared by several methods, each stated once.

A default used by one method only stays in that method's signature; what several methods share (SnapKV's window,
the KV-Compress presets, the LagKV partition sizes …) is named here. The paged engine (:mod:`kvtrim.serve`) reads
the KV-Compress presets from here too.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..budgets.error_aware import DEFAULT_MAX_FACTOR, DEFAULT_MIN_BUDGET
from ..budgets.head_scores import DEFAULT_BETA, DEFAULT_TEMPERATURE


@dataclass(frozen=True)
class WindowPreset:
    """An observation window of the last prompt queries and the pooling of its attention over the keys.

    Attributes:
        window: last prompt queries observed (``w``)
        kernel: pooling kernel over neighbouring keys (1 = none)
        pooling: ``"max"``, ``"avg"`` or ``"none"``
    """

    window: int
    kernel: int
    pooling: str


# KVCache-Factory's run config for SnapKV (also HeadKV, CompressKV's baselines, DynamicKV): w=8, max-pool k=7.
SNAPKV = WindowPreset(window=8, kernel=7, pooling="max")
# CompressKV authors' code: w=8, avg-pool k=5, the top-4 heads of each layer.
COMPRESSKV = WindowPreset(window=8, kernel=5, pooling="avg")
COMPRESSKV_HEADS = 4
COMPRESSKV_MIN_BUDGET = DEFAULT_MIN_BUDGET
COMPRESSKV_MAX_FACTOR = DEFAULT_MAX_FACTOR

# Ada-KV's official rule b_h = c_h(1-α) + αB' with α = 0.2.
ADAKV_ALPHA = 0.2
ADAKV_RULE = "official"

# CriticalKV's paper code: α = 0.5 of the budget by attention first, ε = 1e-4.
CRITICAL_ALPHA = 0.5
CRITICAL_EPS = 1e-4

# HeadKV: β from the sweep on the embedded model, temperature 1, retrieval-reasoning head scores.
HEADKV_BETA = DEFAULT_BETA
HEADKV_TEMPERATURE = DEFAULT_TEMPERATURE
HEADKV_SCORES = "retrieval_reasoning"

# kvpress's sink count (ExpectedAttentionPress, KVzipPress) and StreamingLLM's.
SINKS = 4


@dataclass(frozen=True)
class LagPreset:
    """LagKV's recursive partition frame (the authors' code: S = 16, L = 128)."""

    sink: int = 16
    lag: int = 128
    value_weight: float = 1.0
    eps: float = 1e-6


LAGKV = LagPreset()

# CompilerKV: the v2 operator's window W = 64 and the fixed threshold of its ablations (neutral, static).
COMPILERKV_WINDOW = 64
COMPILERKV_FIXED_THRESHOLD = 0.8


@dataclass(frozen=True)
class KVCompressPreset:
    """A KV-Compress preset (Rehg, arXiv 2410.00161).

    Attributes:
        window: prompt queries observed by the metric (None: every prompt query, KVC-full)
        protected_window: newest tokens of every head never evicted
        kernel: max-pool kernel of the metric (1 = none)
        buffer: keys within ``buffer`` positions of a query are left out of its metric
        block_size: entries per block
        even_layer_evict: rank blocks within each layer instead of across all layers (the authors'
            ``--even-layer-evict``, off by default; the paged engine always ranks across layers)
    """

    window: int | None
    protected_window: int
    kernel: int
    buffer: int
    block_size: int = 16
    even_layer_evict: bool = False


KV_COMPRESS = {
    "kvcompress": KVCompressPreset(window=32, protected_window=32, kernel=7, buffer=0),  # KVC-w, w = 32
    "kvc_w8": KVCompressPreset(window=8, protected_window=8, kernel=7, buffer=0),  # the authors' LongBench scripts
    "kvc_full": KVCompressPreset(window=None, protected_window=32, kernel=1, buffer=10),  # KVC-full
}
