"""LagKV's recursive partition frame: attention-free scores per lag partition, re-applied while decoding."""

from __future__ import annotations

from ..budgets.partition import PartitionBudget
from ..compression.pipeline import Pipeline
from ..compression.schedule import TailFull
from ..errors import InvalidParameterError
from ..scoring.lag_relative import LagRelativeScorer
from ..selection.partition import PartitionTopKSelector
from . import papers
from .presets import LAGKV
from .registry import parts, register

FAMILY = "LagKV"


def _lag_parts(
    statistic: str, sink: int, lag: int, value_weight: float, eps: float, skip_layers: tuple[int, ...]
) -> Pipeline:
    for label, value in (("sink", sink), ("lag", lag)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if label == "lag" else 0):
            raise InvalidParameterError(f"{label} must be an integer >= {1 if label == 'lag' else 0}, got {value!r}")
    skip = tuple(int(i) for i in skip_layers)
    return parts(
        LagRelativeScorer(sink=sink, lag=lag, statistic=statistic, value_weight=value_weight, eps=eps),
        PartitionBudget(sink=sink, lag=lag, skip_layers=skip),
        PartitionTopKSelector(sink=sink, lag=lag, skip_layers=skip),
        schedule=TailFull(lag=lag, sink=sink),
    )


@register(
    "lagkv",
    family=FAMILY,
    summary="Attention-free: min-max normalize each lag partition by the next one, keep the top r*L per KV head; "
    "recursive in prefill and every L decoded tokens.",
    paper=papers.LAGKV,
    preset="authors' code: S=16, L=128, r=1-ratio (k x <-> ratio 1-1/k), K+V scores summed; kvtrim adds eps=1e-6 "
    "to the min-max range and keeps kept entries in position order",
)
def lagkv(
    sink: int = LAGKV.sink,
    lag: int = LAGKV.lag,
    value_weight: float = LAGKV.value_weight,
    eps: float = LAGKV.eps,
    skip_layers: tuple = (),
) -> Pipeline:
    """LagKV (Liang et al., 2025, arXiv 2504.04704).

    After ``sink`` tokens, the uncompressed tokens form partitions of ``lag`` tokens; each partition's keys and
    values are min–max normalized per channel with the statistics of the *next* partition, the channel-wise
    standard deviation of every token is softmaxed over the partition, key and value scores are summed
    (``value_weight`` = γ), and each (KV head, partition) keeps its top ``⌊r·L⌋`` tokens, ``r = 1 − ratio``.
    The last full partition and the remainder stay uncompressed; compressed tokens are never re-scored. The
    schedule compresses after prefill and again whenever the tail reaches ``2·lag`` tokens (every ``lag`` decoded
    tokens), and between the chunks of a chunked prefill. Differences from the authors' code (documented):
    ``eps`` in the normalization (their code divides by the raw range), kept entries sorted by position.
    ``skip_layers`` leaves some layers uncompressed (the code's ``skip_layer_idx``).
    """
    return _lag_parts("lag_std", sink, lag, value_weight, eps, skip_layers)


@register(
    "localkv",
    family=FAMILY,
    summary="LagKV ablation: each partition normalized with its own min-max statistics.",
    paper=papers.LAGKV,
    preset="as lagkv, reference = the partition itself (the paper's LocalKV ablation)",
)
def localkv(
    sink: int = LAGKV.sink,
    lag: int = LAGKV.lag,
    value_weight: float = LAGKV.value_weight,
    eps: float = LAGKV.eps,
    skip_layers: tuple = (),
) -> Pipeline:
    """LocalKV, the ablation of LagKV (arXiv 2504.04704) without the lag: statistics of the partition itself."""
    return _lag_parts("local_std", sink, lag, value_weight, eps, skip_layers)


@register(
    "lag_knorm",
    family=FAMILY,
    summary="Key L2 norm scored inside LagKV's recursive partition frame (lowest norms kept per partition).",
    paper=papers.LAGKV + "; score from Devoto et al., EMNLP 2024 (arXiv 2406.11430)",
    preset="as lagkv, score softmax(-||k||) per partition (the L2-norm baseline of the LagKV paper)",
)
def lag_knorm(sink: int = LAGKV.sink, lag: int = LAGKV.lag, skip_layers: tuple = ()) -> Pipeline:
    """The key-L2-norm score (arXiv 2406.11430) in LagKV's recursive frame (arXiv 2504.04704)."""
    return _lag_parts("key_norm", sink, lag, 0.0, LAGKV.eps, skip_layers)
