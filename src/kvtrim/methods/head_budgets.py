"""Head budgets from offline head profiles: HeadKV's retrieval–reasoning scores, DuoAttention's gates."""

from __future__ import annotations

from ..budgets.artifact_head_scores import ArtifactHeadScoreBudget
from ..budgets.duo_heads import DuoHeadBudget
from ..compression.pipeline import Pipeline
from ..scoring.position import RecencyScorer
from ..selection.topk import TopKSelector
from . import papers
from .attention import snap_scorer
from .presets import HEADKV_BETA, HEADKV_SCORES, HEADKV_TEMPERATURE, SNAPKV
from .registry import parts, register

FAMILY = "head budgets"


@register(
    "headkv",
    family=FAMILY,
    summary="Per-head budgets from offline retrieval-reasoning head scores (calibration artifact), SnapKV "
    "selection inside each head (stored ragged).",
    paper=papers.HEADKV,
    preset="HeadKV LongBench settings w=8, max-pool k=7, temperature 1; β from the sweep on the embedded model; "
    "query-head capacities averaged within each GQA group (KVCache-Factory kv_head mode); needs "
    "`kvtrim calibrate headkv`",
)
def headkv(
    window: int = SNAPKV.window,
    kernel: int = SNAPKV.kernel,
    pooling: str = SNAPKV.pooling,
    beta: float = HEADKV_BETA,
    temperature: float = HEADKV_TEMPERATURE,
    scores: str = HEADKV_SCORES,
    artifact: str | None = None,
) -> Pipeline:
    """HeadKV (Fu et al., 2025, arXiv 2410.19258): head-level budgets from offline head scores."""
    return parts(
        snap_scorer(window, kernel, pooling),
        ArtifactHeadScoreBudget(beta=beta, temperature=temperature, window=window, scores=scores, path=artifact),
        TopKSelector(recent=window),
    )


@register(
    "duo_attention",
    family=FAMILY,
    summary="Retrieval heads keep the whole context, streaming heads keep sinks + recent tokens; heads ranked by "
    "offline DuoAttention gates, the number of streaming heads set by the ratio (stored ragged).",
    paper=papers.DUO_ATTENTION,
    preset="sink 16 + recent 48 (scaled down from the paper's 64-128 + 256 for ~1k-token contexts); the "
    "lowest-gate heads stream, as many as the ratio/budget needs (kvpress-style head_compression), ties by "
    "(layer, head); needs `kvtrim calibrate duo`",
)
def duo_attention(sink: int = 16, recent: int = 48, artifact: str | None = None) -> Pipeline:
    """DuoAttention (Xiao et al., 2025, arXiv 2410.10819) with gates from the ``duo`` artifact.

    ``n_s = ⌈N (T − B)/(T − W)⌉`` of the ``N`` (layer, KV head) pairs stream (``W = sink + recent``, ``B`` the
    requested mean keep, ``T`` the context), so memory matches the ratio like every other method; when ``B < W``
    every head streams with ``B`` tokens (:mod:`kvtrim.budgets.duo_heads`). ``artifact=PATH`` loads another file.
    """
    return parts(RecencyScorer(), DuoHeadBudget(sink=sink, recent=recent, path=artifact), TopKSelector(sink=sink))
