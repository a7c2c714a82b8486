"""Decoding-time eviction for long generations (reasoning traces): the cache is bounded while the answer grows."""

from __future__ import annotations

from ..budgets.uniform import UniformBudget
from ..compression.pipeline import Pipeline
from ..compression.schedule import OverBudget
from ..errors import InvalidParameterError
from ..scoring.redundancy import RedundancyAwareScorer
from ..scoring.trigonometric import TrigonometricScorer
from ..selection.topk import TopKSelector
from . import papers
from .registry import parts, register

FAMILY = "decoding-time"


@register(
    "rkv",
    family=FAMILY,
    summary="R-KV: window attention minus key redundancy (cosine copies of other keys), top entries per KV head "
    "plus the window; re-compressed while decoding whenever a head holds budget + buffer entries.",
    paper=papers.RKV,
    preset="authors' code: window 8, max-pool 7, mix λ=0.07, similarity threshold 0.5 (newest copy exempted), "
    "buffer 128; GQA max over the group after the softmax (their code: on the logits)",
)
def rkv(window: int = 8, kernel: int = 7, mix: float = 0.07, threshold: float = 0.5, buffer: int = 128) -> Pipeline:
    """R-KV (Cai et al., 2025, arXiv 2505.24133).

    Every entry scores ``mix · importance − (1 − mix) · redundancy``: importance is the attention the last
    ``window`` queries pay it (mean over them, max over the query heads of a KV head, max-pooled over ``kernel``
    positions); redundancy is the mean cosine similarity of its key to the head's other keys, softmaxed, where each
    key's most recent near-copy (similarity > ``threshold``) is exempted. Each KV head keeps its top entries plus
    the last ``window`` tokens. The schedule compresses after prefill and, while decoding, whenever a head holds
    ``buffer`` entries more than its budget (R-KV's buffer), so the cache stays between the budget and budget +
    buffer however long the generation. Pass ``budget=`` (tokens per head, R-KV's setting) or ``ratio=``.
    """
    if isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < window:
        raise InvalidParameterError(f"buffer must be an integer >= window ({window}), got {buffer!r}")
    return parts(
        RedundancyAwareScorer(window=window, kernel=kernel, mix=mix, threshold=threshold),
        UniformBudget(),
        TopKSelector(recent=window),
        schedule=OverBudget(slack=buffer),
    )


@register(
    "triattention",
    family=FAMILY,
    summary="TriAttention: each key scored by the logit the pre-RoPE query centre would give it, averaged over "
    "future distances 1, 2, 4 … 65536 (a trigonometric series over the rotary bands), plus the query magnitude the "
    "centre does not explain × the key's band norms; max over the group; re-compressed while decoding whenever a "
    "head holds budget + 128 entries.",
    paper=papers.TRIATTENTION,
    preset="authors' code defaults: geometric offsets up to 65536, mean over offsets, no score normalization, max "
    "over the query heads of a KV head, compression every 128 tokens over the budget; query statistics from the "
    "last 1024 recorded queries (the paper: calibrated offline); the prompt competes for the budget (the authors' "
    "default keeps the whole prompt)",
)
def triattention(offset_max: int = 65536, stats_window: int = 1024, buffer: int = 128) -> Pipeline:
    """TriAttention (Mao et al., 2026, arXiv 2604.04921).

    The pre-RoPE queries of a head cluster around a fixed centre ``q̄``, so the logit a future query gives a key
    depends mostly on their distance ``Δ``: ``Σ_f |q̄_f||k_f| cos(ω_f Δ + φ_f)``, a trigonometric series over the
    rotary bands ``f``. Every key scores that series averaged over the future offsets ``1, 2, 4 … offset_max``
    plus ``Σ_f (E|q_f| − |q̄_f|)|k_f|`` (the query magnitude the centre does not capture); a KV head takes the max
    over its query heads and keeps its top entries. The statistics come from the last ``stats_window`` recorded
    queries. The schedule compresses after prefill and, while decoding, whenever a head holds ``buffer`` entries
    more than its budget. Pass ``budget=`` (tokens per head, the paper's setting) or ``ratio=``.
    """
    if isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 1:
        raise InvalidParameterError(f"buffer must be an integer >= 1, got {buffer!r}")
    return parts(
        TrigonometricScorer(offset_max=offset_max, stats_window=stats_window),
        UniformBudget(),
        TopKSelector(),
        schedule=OverBudget(slack=buffer),
    )
