"""Attention-based eviction: the prompt's attention decides which entries each KV head keeps."""

from __future__ import annotations

from ..budgets.head_adaptive import HeadAdaptiveBudget
from ..budgets.pyramid import PyramidBudget
from ..budgets.uniform import UniformBudget
from ..compression.pipeline import Pipeline
from ..errors import InvalidParameterError
from ..scoring.cumulative_attention import CumulativeAttentionScorer
from ..scoring.window_attention import WindowAttentionScorer
from ..selection.topk import TopKSelector
from . import papers
from .presets import ADAKV_ALPHA, ADAKV_RULE, SNAPKV
from .registry import parts, register

FAMILY = "attention eviction"


def snap_scorer(window: int, kernel: int, pooling: str) -> WindowAttentionScorer:
    """SnapKV's score: the last ``window`` queries' attention, pooled, mean over the query heads of a group."""
    return WindowAttentionScorer(window=window, kernel=kernel, pooling=pooling, aggregate="mean", group_reduce="mean")


@register(
    "snapkv",
    family=FAMILY,
    summary="Attention of the last w prompt queries, pooled; top entries per KV head plus the window.",
    paper=papers.SNAPKV,
    preset="KVCache-Factory run config: w=8, max-pool k=7 (also HeadKV/CompressKV/DynamicKV); the paper's w=32 is "
    "window=32. GQA: mean over the group before pooling (AdaKV gqa_support)",
)
def snapkv(window: int = SNAPKV.window, kernel: int = SNAPKV.kernel, pooling: str = SNAPKV.pooling) -> Pipeline:
    """SnapKV (Li et al., 2024, arXiv 2404.14469). Window tokens are always kept and count in the budget."""
    return parts(snap_scorer(window, kernel, pooling), UniformBudget(), TopKSelector(recent=window))


@register(
    "pyramidkv",
    family=FAMILY,
    summary="SnapKV selection under pyramid-shaped layer budgets (more in lower layers).",
    paper=papers.PYRAMIDKV,
    preset="beta=20, w=8, max-pool k=7 (KVCache-Factory PyramidKVCluster and run config), SnapKV scorer as in `snapkv`",
)
def pyramidkv(
    window: int = SNAPKV.window, kernel: int = SNAPKV.kernel, pooling: str = SNAPKV.pooling, beta: float = 20.0
) -> Pipeline:
    """PyramidKV (Cai et al., 2024, arXiv 2406.02069): per-layer budgets decrease linearly with depth."""
    return parts(
        snap_scorer(window, kernel, pooling), PyramidBudget(beta=beta, window=window), TopKSelector(recent=window)
    )


@register(
    "adakv",
    family=FAMILY,
    summary="SnapKV scores; the KV heads of each layer share its budget by score (variable per head, stored ragged).",
    paper=papers.ADAKV,
    preset="official AdaKV rule b_h = c_h(1-α) + αB' with α=0.2 at KV-head granularity; SnapKV scorer as in "
    "`snapkv` (w=8, max-pool k=7); rule='kvpress' gives kvpress's top-⌊αB'⌋ safeguard",
)
def adakv(
    window: int = SNAPKV.window,
    kernel: int = SNAPKV.kernel,
    pooling: str = SNAPKV.pooling,
    alpha: float = ADAKV_ALPHA,
    rule: str = ADAKV_RULE,
    page_size: int = 1,
    head_groups: int = 1,
) -> Pipeline:
    """Ada-KV (Feng et al., 2024, arXiv 2407.11550) on SnapKV scores; real per-head memory (ragged storage).

    ``page_size > 1``: per-head counts in whole pages of that many entries, a layer keeping ``⌈kv_heads·budget /
    page_size⌉`` pages (what the uniform budget's entries fill), for paged caches whose pages hold one head (the
    vLLM plugin with ``page_size`` equal to vLLM's block size frees the uniform method's blocks).

    ``head_groups > 1``: the layer's KV heads form that many equal groups of consecutive heads, each sharing its own
    budget by score (the split tensor-parallel ranks can make, each holding one slice of the heads; the vLLM plugin
    with ``tensor_parallel_size`` needs it to be a multiple of the rank count)."""
    return parts(
        snap_scorer(window, kernel, pooling),
        HeadAdaptiveBudget(alpha=alpha, window=window, rule=rule, page_size=page_size, head_groups=head_groups),
        TopKSelector(recent=window),
    )


@register(
    "h2o",
    family=FAMILY,
    summary="Heavy hitters by attention accumulated over all prompt queries, plus recent tokens.",
    paper=papers.H2O,
    preset="paper split: half heavy hitters, half recent; prefill-only; sums over queries in chunks of 256",
)
def h2o(recent_fraction: float = 0.5, chunk: int = 256) -> Pipeline:
    """H2O (Zhang et al., 2023, arXiv 2306.14048) applied once after prefill."""
    if not 0.0 <= recent_fraction <= 1.0:
        raise InvalidParameterError(f"recent_fraction must be in [0, 1], got {recent_fraction}")
    return parts(CumulativeAttentionScorer(chunk=chunk), UniformBudget(), TopKSelector(recent=float(recent_fraction)))


@register(
    "tova",
    family=FAMILY,
    summary="Last query's attention averaged over heads; one token set per layer.",
    paper=papers.TOVA,
    preset="kvpress TOVAPress: one-shot after prefill, window 1, head-averaged, last token kept",
)
def tova() -> Pipeline:
    """TOVA (Oren et al., 2024, arXiv 2401.06104), one-shot after prefill."""
    scorer = WindowAttentionScorer(window=1, kernel=1, pooling="none", group_reduce="mean", head_mean=True)
    return parts(scorer, UniformBudget(), TopKSelector(recent=1))
