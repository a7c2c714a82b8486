"""ThinK: key-channel pruning, alone or on top of SnapKV's token selection."""

from __future__ import annotations

from ..budgets.keep_all import KeepAllBudget
from ..budgets.uniform import UniformBudget
from ..compression.pipeline import Pipeline
from ..scoring.position import RecencyScorer
from ..selection.key_channels import QueryDrivenChannels
from ..selection.topk import TopKSelector
from . import papers
from .attention import snap_scorer
from .presets import SNAPKV
from .registry import parts, register

FAMILY = "ThinK"


@register(
    "think",
    family=FAMILY,
    summary="Key-channel pruning: per KV head, the key channels with the largest ||Q_obs[:,i]||*||K[:,i]|| are "
    "kept (keys stored thinner); no token is evicted. The ratio is the fraction of key channels pruned.",
    paper=papers.THINK,
    preset="observation window w=8 (as kvtrim's SnapKV), post-rotary queries of the GQA group stacked; ratio = λ "
    "(paper: 0.4-0.5); tokens appended after compression are pruned to the same channels",
)
def think(window: int = SNAPKV.window) -> Pipeline:
    """ThinK (Xu et al., 2025, arXiv 2407.21018) alone: prune a ``ratio`` fraction of every KV head's key channels.

    Keys are stored with ``head_dim − ⌊ratio·head_dim⌋`` channels (values untouched), so the K/V bytes drop by
    about ``ratio / 2``. Needs a ratio; a budget of entries has no channel meaning.
    """
    return parts(RecencyScorer(), KeepAllBudget(), TopKSelector(), channels=QueryDrivenChannels(window=window))


@register(
    "think_snapkv",
    family=FAMILY,
    summary="SnapKV token selection, then ThinK key-channel pruning of the kept keys.",
    paper=papers.THINK + "; " + "Li et al., SnapKV, NeurIPS 2024 (arXiv 2404.14469)",
    preset="SnapKV as `snapkv` (w=8, max-pool k=7) under the requested ratio/budget; channel_ratio λ=0.5 of the "
    "key channels (the paper's SnapKV+ThinK setting prunes 40-50%), scored by the same window",
)
def think_snapkv(
    window: int = SNAPKV.window, kernel: int = SNAPKV.kernel, pooling: str = SNAPKV.pooling, channel_ratio: float = 0.5
) -> Pipeline:
    """ThinK (arXiv 2407.21018) on top of SnapKV (arXiv 2404.14469): tokens by SnapKV, then key channels.

    The ratio/budget is SnapKV's (tokens); ``channel_ratio`` of the kept keys' channels is pruned on top, so the
    K/V bytes are about ``(1 − ratio)·(1 − channel_ratio/2)`` of the full cache.
    """
    return parts(
        snap_scorer(window, kernel, pooling),
        UniformBudget(),
        TopKSelector(recent=window),
        channels=QueryDrivenChannels(window=window, fraction=channel_ratio),
    )
