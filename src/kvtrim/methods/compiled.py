"""CompilerKV and its ablations: a stabilized utility gated by compiled risk and head tables."""

from __future__ import annotations

from ..artifacts.compilerkv import TableSource
from ..budgets.uniform import UniformBudget
from ..compression.pipeline import Pipeline
from ..scoring.stabilized_utility import StabilizedUtilityScorer
from ..selection.threshold import ThresholdGateSelector
from . import papers
from .presets import COMPILERKV_FIXED_THRESHOLD, COMPILERKV_WINDOW
from .registry import parts, register

FAMILY = "CompilerKV"

PRESET = (
    "v2 operator (per-head ρ, cross-layer α, weighted max over heads, quantile risk bins, absolute threshold), "
    "W=64, pad-to-budget (decision 2, docs/decisions.md); tables compiled by `kvtrim calibrate compilerkv`"
)


def _operator(
    tables: TableSource,
    *,
    window: int,
    mode: str,
    utility: str = "stabilized",
    alpha: str = "cross_layer",
    rho: str = "per_head",
    normalize: str = "none",
    keep_window: int = 0,
    static_threshold: float | None = None,
    missing_logprobs: str = "error",
) -> Pipeline:
    return parts(
        StabilizedUtilityScorer(tables, window=window, utility=utility, alpha=alpha, rho=rho),
        UniformBudget(),
        ThresholdGateSelector(
            tables,
            mode=mode,
            static_threshold=static_threshold,
            normalize=normalize,
            keep_window=keep_window,
            missing_logprobs=missing_logprobs,
        ),
    )


@register(
    "compilerkv",
    family=FAMILY,
    summary="Stabilized utility (cross-layer window attention × relative value norm), max over heads weighted by "
    "the compiled head reliability table; risk-adaptive threshold from the compiled risk table, top-k corrected "
    "to the budget (padded).",
    paper=papers.COMPILERKV,
    preset=PRESET,
)
def compilerkv(
    window: int = COMPILERKV_WINDOW,
    mode: str = "pad",
    utility: str = "stabilized",
    alpha: str = "cross_layer",
    rho: str = "per_head",
    normalize: str = "none",
    keep_window: int = 0,
    exact_budget: bool = False,
    missing_logprobs: str = "error",
    artifact: str | None = None,
) -> Pipeline:
    """CompilerKV (arXiv 2602.08686), prefill-only: the v2 operator with compiled tables.

    Every layer keeps ``B`` tokens (the same set for all its KV heads) ranked by û = max_h W[l,h]·α·ρ^{(l,h)}.
    ``mode="pad"`` (default) keeps exactly B, so the threshold gate is reported but cannot change the kept set;
    ``mode="elastic"`` keeps only the candidates above τ (at most B). v1 switches: ``alpha="window_cumulative"``,
    ``rho="head_mean"``, ``normalize="max"``, ``keep_window=64``. The tables come from the ``compilerkv`` artifact
    (``kvtrim calibrate compilerkv``); a budget that was not compiled uses the nearest compiled one (reported in
    the compression metadata) unless ``exact_budget=True``.
    """
    return _operator(
        TableSource(path=artifact, exact_budget=exact_budget), window=window, mode=mode, utility=utility,
        alpha=alpha, rho=rho, normalize=normalize, keep_window=keep_window, missing_logprobs=missing_logprobs,
    )  # fmt: skip


@register(
    "compilerkv_elastic",
    family=FAMILY,
    summary="CompilerKV with the elastic budget clamp: only tokens above the risk-adaptive threshold are kept "
    "(≤ budget).",
    paper=papers.COMPILERKV,
    preset="as compilerkv, mode='elastic' (the v2 paper's clamp, no padding)",
)
def compilerkv_elastic(
    window: int = COMPILERKV_WINDOW,
    exact_budget: bool = False,
    missing_logprobs: str = "error",
    artifact: str | None = None,
) -> Pipeline:
    """CompilerKV (arXiv 2602.08686) with the elastic clamp: memory below the budget when the gate allows."""
    tables = TableSource(path=artifact, exact_budget=exact_budget)
    return _operator(tables, window=window, mode="elastic", missing_logprobs=missing_logprobs)


@register(
    "compilerkv_neutral",
    family=FAMILY,
    summary="CompilerKV ablation without compiled tables: all head weights 1 and one fixed threshold.",
    paper=papers.COMPILERKV,
    preset="as compilerkv with W_head ≡ 1 and τ ≡ 0.8 (the uncompiled operator); needs no artifact",
)
def compilerkv_neutral(
    window: int = COMPILERKV_WINDOW, mode: str = "pad", threshold: float = COMPILERKV_FIXED_THRESHOLD
) -> Pipeline:
    """The CompilerKV operator (arXiv 2602.08686) with neutral tables: an explicitly named ablation."""
    return _operator(TableSource(neutral=True, neutral_threshold=threshold), window=window, mode=mode)


@register(
    "compilerkv_neutral_elastic",
    family=FAMILY,
    summary="CompilerKV ablation: neutral tables (weights 1, τ ≡ 0.8) with the elastic clamp.",
    paper=papers.COMPILERKV,
    preset="as compilerkv_neutral, mode='elastic'",
)
def compilerkv_neutral_elastic(
    window: int = COMPILERKV_WINDOW, threshold: float = COMPILERKV_FIXED_THRESHOLD
) -> Pipeline:
    """The CompilerKV operator (arXiv 2602.08686), neutral tables, elastic clamp."""
    return _operator(TableSource(neutral=True, neutral_threshold=threshold), window=window, mode="elastic")


@register(
    "compilerkv_raw_attention",
    family=FAMILY,
    summary="CompilerKV ablation: the layer's raw window attention per head replaces the stabilized utility.",
    paper=papers.COMPILERKV,
    preset="as compilerkv with utility='raw' (no cross-layer mean, no value term); compiled head table",
)
def compilerkv_raw_attention(
    window: int = COMPILERKV_WINDOW, mode: str = "pad", artifact: str | None = None
) -> Pipeline:
    """CompilerKV (arXiv 2602.08686) with raw per-layer attention in place of α·ρ (the utility ablation)."""
    return _operator(TableSource(path=artifact), window=window, mode=mode, utility="raw")


@register(
    "compilerkv_static_threshold",
    family=FAMILY,
    summary="CompilerKV ablation: elastic clamp with one static threshold instead of the compiled risk table.",
    paper=papers.COMPILERKV,
    preset="as compilerkv_elastic with τ ≡ 0.8 for every layer and prompt; compiled head table",
)
def compilerkv_static_threshold(
    window: int = COMPILERKV_WINDOW, threshold: float = COMPILERKV_FIXED_THRESHOLD, artifact: str | None = None
) -> Pipeline:
    """CompilerKV (arXiv 2602.08686), elastic, with a static threshold (the risk-gating ablation)."""
    return _operator(TableSource(path=artifact), window=window, mode="elastic", static_threshold=threshold)
