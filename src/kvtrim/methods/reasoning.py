"""Decoding-time eviction for long generations (reasoning traces): the cache is bounded while the answer grows."""

from __future__ import annotations

from ..budgets.uniform import UniformBudget
from ..compression.pipeline import Pipeline
from ..compression.schedule import OverBudget
from ..errors import InvalidParameterError
from ..scoring.redundancy import RedundancyAwareScorer
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
