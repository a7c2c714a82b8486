"""CompressKV and its ablations: semantic retrieval heads choose the tokens, error-aware layer budgets."""

from __future__ import annotations

from ..budgets.artifact_head_scores import ArtifactHeadScoreBudget
from ..budgets.base import BudgetAllocator
from ..budgets.error_aware import ArtifactErrorAwareBudget, LayerThenHeadBudget
from ..budgets.head_adaptive import HeadAdaptiveBudget
from ..budgets.uniform import UniformBudget
from ..compression.pipeline import Pipeline
from ..scoring.head_subset import ArtifactHeadSubsetScorer
from ..selection.topk import TopKSelector
from . import papers
from .presets import (
    ADAKV_ALPHA,
    ADAKV_RULE,
    COMPRESSKV,
    COMPRESSKV_HEADS,
    COMPRESSKV_MAX_FACTOR,
    COMPRESSKV_MIN_BUDGET,
    HEADKV_BETA,
    HEADKV_TEMPERATURE,
)
from .registry import parts, register

FAMILY = "CompressKV"

PRESET = (
    "authors' code: top-4 heads per layer, window w=8 (summed over the window queries, fp32 softmax, each head "
    "against its own KV group), avg-pool k=5, mean over the heads, same indices for every KV head; "
    "Algorithm 1 with m=32, M=3B (kvtrim: m=min(32,B), M capped at the context); budget/ratio = mean entries per "
    "layer including the window; needs `kvtrim calibrate compresskv`"
)


def _srh_parts(
    heads: str,
    heads_per_layer: int,
    window: int,
    kernel: int,
    pooling: str,
    artifact: str | None,
    budget: BudgetAllocator,
    *,
    per_kv: bool = False,
) -> Pipeline:
    """The top ``heads_per_layer`` retrieval heads' (``heads``: ``"srh"`` or ``"trh"``) window attention, pooled,
    chooses the top entries plus the window under ``budget``; ``per_kv``: each KV head scored by its own group's."""
    scorer = ArtifactHeadSubsetScorer(
        ranking=heads,
        heads_per_layer=heads_per_layer,
        window=window,
        kernel=kernel,
        pooling=pooling,
        per_kv_head=per_kv,
        path=artifact,
    )
    return parts(scorer, budget, TopKSelector(recent=window))


def _error_aware(min_budget: int, max_factor: float, artifact: str | None) -> ArtifactErrorAwareBudget:
    """CompressKV's Algorithm 1 layer budgets from the artifact's profiled layer errors."""
    return ArtifactErrorAwareBudget(min_budget=min_budget, max_factor=max_factor, path=artifact)


@register(
    "compresskv",
    family=FAMILY,
    summary="Per layer, the window attention of its top semantic retrieval heads (offline SRH scores), pooled and "
    "shared by all KV heads; error-aware layer budgets (Algorithm 1) from an offline layer-error profile.",
    paper=papers.COMPRESSKV,
    preset=PRESET,
)
def compresskv(
    window: int = COMPRESSKV.window,
    kernel: int = COMPRESSKV.kernel,
    pooling: str = COMPRESSKV.pooling,
    heads_per_layer: int = COMPRESSKV_HEADS,
    min_budget: int = COMPRESSKV_MIN_BUDGET,
    max_factor: float = COMPRESSKV_MAX_FACTOR,
    heads: str = "srh",
    artifact: str | None = None,
) -> Pipeline:
    """CompressKV (Lin et al., arXiv 2508.02401): SRH token selection under error-aware layer budgets.

    Per layer, the top ``heads_per_layer`` query heads by offline SRH score (``heads="trh"``: copy-paste retrieval
    heads) score the prompt with their window attention; every KV head of the layer keeps the same top
    ``b_l − window`` tokens plus the window. ``b_l`` follows Algorithm 1 from the profiled layer errors ``e_l``
    (mean ``B`` = the requested budget per layer). Both come from the ``compresskv`` artifact
    (``kvtrim calibrate compresskv``; ``artifact=PATH`` for another file).
    """
    budget = _error_aware(min_budget, max_factor, artifact)
    return _srh_parts(heads, heads_per_layer, window, kernel, pooling, artifact, budget)


@register(
    "compresskv_srh_only",
    family=FAMILY,
    summary="CompressKV ablation: SRH token selection with uniform layer budgets.",
    paper=papers.COMPRESSKV,
    preset="as `compresskv`, every layer keeps the requested budget (the paper's SRH-only ablation)",
)
def compresskv_srh_only(
    window: int = COMPRESSKV.window,
    kernel: int = COMPRESSKV.kernel,
    pooling: str = COMPRESSKV.pooling,
    heads_per_layer: int = COMPRESSKV_HEADS,
    heads: str = "srh",
    artifact: str | None = None,
) -> Pipeline:
    """CompressKV's selection alone (arXiv 2508.02401): top SRH heads' window attention, uniform budgets."""
    return _srh_parts(heads, heads_per_layer, window, kernel, pooling, artifact, UniformBudget())


@register(
    "compresskv_trh",
    family=FAMILY,
    summary="CompressKV ablation: traditional (copy-paste) retrieval heads select the tokens; error-aware layer "
    "budgets.",
    paper=papers.COMPRESSKV,
    preset="as `compresskv` with the TRH ranking (Retrieval_Head criterion) instead of SRH",
)
def compresskv_trh(
    window: int = COMPRESSKV.window,
    kernel: int = COMPRESSKV.kernel,
    pooling: str = COMPRESSKV.pooling,
    heads_per_layer: int = COMPRESSKV_HEADS,
    min_budget: int = COMPRESSKV_MIN_BUDGET,
    max_factor: float = COMPRESSKV_MAX_FACTOR,
    artifact: str | None = None,
) -> Pipeline:
    """CompressKV (arXiv 2508.02401) with TRH heads in place of SRH heads (the paper's head-type ablation)."""
    return compresskv(window, kernel, pooling, heads_per_layer, min_budget, max_factor, "trh", artifact)


@register(
    "head_compresskv",
    family=FAMILY,
    summary="HeadKV per-head budgets (offline retrieval-reasoning head scores) with CompressKV's SRH token "
    "selection (stored ragged).",
    paper=papers.COMPRESSKV + "; " + papers.HEADKV,
    preset="SRH selection as `compresskv` (nested token sets across the KV heads of a layer); HeadKV budgets as "
    "`headkv` (β, temperature); needs both `kvtrim calibrate compresskv` and `kvtrim calibrate headkv`",
)
def head_compresskv(
    window: int = COMPRESSKV.window,
    kernel: int = COMPRESSKV.kernel,
    pooling: str = COMPRESSKV.pooling,
    heads_per_layer: int = COMPRESSKV_HEADS,
    beta: float = HEADKV_BETA,
    temperature: float = HEADKV_TEMPERATURE,
    artifact: str | None = None,
    headkv_artifact: str | None = None,
) -> Pipeline:
    """CompressKV's SRH selection (arXiv 2508.02401) inside HeadKV budgets (arXiv 2410.19258)."""
    budget = ArtifactHeadScoreBudget(beta=beta, temperature=temperature, window=window, path=headkv_artifact)
    return _srh_parts("srh", heads_per_layer, window, kernel, pooling, artifact, budget)


@register(
    "ada_compresskv",
    family=FAMILY,
    summary="Error-aware layer budgets (CompressKV), split among each layer's KV heads by AdaKV; SRH scores per KV "
    "group select the tokens (stored ragged).",
    paper=papers.COMPRESSKV + "; Feng et al., Ada-KV (arXiv 2407.11550)",
    preset="Algorithm 1 layer budgets as `compresskv`; AdaKV official rule α=0.2 inside each layer; each KV head "
    "scored by the top SRH heads of its own group (layer mean when its group has none)",
)
def ada_compresskv(
    window: int = COMPRESSKV.window,
    kernel: int = COMPRESSKV.kernel,
    pooling: str = COMPRESSKV.pooling,
    heads_per_layer: int = COMPRESSKV_HEADS,
    min_budget: int = COMPRESSKV_MIN_BUDGET,
    max_factor: float = COMPRESSKV_MAX_FACTOR,
    alpha: float = ADAKV_ALPHA,
    rule: str = ADAKV_RULE,
    artifact: str | None = None,
) -> Pipeline:
    """CompressKV (arXiv 2508.02401) layer budgets with Ada-KV (arXiv 2407.11550) head budgets inside each layer.

    AdaKV needs scores that differ between KV heads, so each KV head is scored by the chosen SRH heads of its
    own GQA group (the layer's mean over all chosen heads when none of them is in the group).
    """
    budget = LayerThenHeadBudget(
        _error_aware(min_budget, max_factor, artifact), HeadAdaptiveBudget(alpha=alpha, window=window, rule=rule)
    )
    return _srh_parts("srh", heads_per_layer, window, kernel, pooling, artifact, budget, per_kv=True)
