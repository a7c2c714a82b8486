"""CriticalKV: two-stage selection (attention, then the entry's projected output perturbation) in other budgets."""

from __future__ import annotations

from ..budgets.artifact_head_scores import ArtifactHeadScoreBudget
from ..budgets.head_adaptive import HeadAdaptiveBudget
from ..budgets.uniform import UniformBudget
from ..compression.pipeline import Pipeline
from ..selection.critical import CriticalSelector
from . import papers
from .attention import snap_scorer
from .presets import (
    ADAKV_ALPHA,
    ADAKV_RULE,
    CRITICAL_ALPHA,
    CRITICAL_EPS,
    HEADKV_BETA,
    HEADKV_SCORES,
    HEADKV_TEMPERATURE,
    SNAPKV,
)
from .registry import parts, register

FAMILY = "CriticalKV"


@register(
    "critical_snapkv",
    family=FAMILY,
    summary="CriticalKV two-stage selection (attention, then (A+ε)·‖V·W_O‖₁) on SnapKV scores, uniform budgets.",
    paper=papers.CRITICALKV,
    preset="α=0.5, ε=1e-4, L1 norm per query-head slice of W_O, mean over the group (paper code); SnapKV scorer as "
    "in `snapkv`",
)
def critical_snapkv(
    window: int = SNAPKV.window,
    kernel: int = SNAPKV.kernel,
    pooling: str = SNAPKV.pooling,
    alpha: float = CRITICAL_ALPHA,
    eps: float = CRITICAL_EPS,
) -> Pipeline:
    """CriticalKV (Feng et al., arXiv 2502.03805) with SnapKV scores and uniform budgets."""
    return parts(
        snap_scorer(window, kernel, pooling), UniformBudget(), CriticalSelector(alpha=alpha, eps=eps, recent=window)
    )


@register(
    "critical_adakv",
    family=FAMILY,
    summary="CriticalKV two-stage selection inside AdaKV's per-head budgets (stored ragged).",
    paper=papers.CRITICALKV,
    preset="α=0.5, ε=1e-4; AdaKV official rule with α_s=0.2 (decision 8, docs/decisions.md); SnapKV scorer as in "
    "`snapkv`",
)
def critical_adakv(
    window: int = SNAPKV.window,
    kernel: int = SNAPKV.kernel,
    pooling: str = SNAPKV.pooling,
    alpha: float = CRITICAL_ALPHA,
    eps: float = CRITICAL_EPS,
    safeguard: float = ADAKV_ALPHA,
    rule: str = ADAKV_RULE,
    page_size: int = 1,
    head_groups: int = 1,
) -> Pipeline:
    """CriticalKV (Feng et al., arXiv 2502.03805) on Ada-KV budgets (arXiv 2407.11550); ``page_size`` and
    ``head_groups`` as in :func:`~kvtrim.methods.attention.adakv`."""
    return parts(
        snap_scorer(window, kernel, pooling),
        HeadAdaptiveBudget(alpha=safeguard, window=window, rule=rule, page_size=page_size, head_groups=head_groups),
        CriticalSelector(alpha=alpha, eps=eps, recent=window),
    )


@register(
    "critical_headkv",
    family=FAMILY,
    summary="CriticalKV two-stage selection inside HeadKV's per-head budgets (stored ragged).",
    paper=papers.CRITICALKV + "; " + papers.HEADKV,
    preset="α=0.5, ε=1e-4 inside each head's HeadKV budget (decision 3, docs/decisions.md); HeadKV settings as in "
    "`headkv`",
)
def critical_headkv(
    window: int = SNAPKV.window,
    kernel: int = SNAPKV.kernel,
    pooling: str = SNAPKV.pooling,
    alpha: float = CRITICAL_ALPHA,
    eps: float = CRITICAL_EPS,
    beta: float = HEADKV_BETA,
    temperature: float = HEADKV_TEMPERATURE,
    scores: str = HEADKV_SCORES,
    artifact: str | None = None,
) -> Pipeline:
    """CriticalKV (arXiv 2502.03805) on HeadKV budgets (arXiv 2410.19258)."""
    return parts(
        snap_scorer(window, kernel, pooling),
        ArtifactHeadScoreBudget(beta=beta, temperature=temperature, window=window, scores=scores, path=artifact),
        CriticalSelector(alpha=alpha, eps=eps, recent=window),
    )
