"""Attention-free eviction: position, key geometry or chance decide; no query is observed."""

from __future__ import annotations

from ..budgets.uniform import UniformBudget
from ..compression.pipeline import Pipeline
from ..scoring.key_diff import KeyDiffScorer
from ..scoring.key_norm import KeyNormScorer
from ..scoring.position import RecencyScorer
from ..scoring.random import RandomScorer
from ..selection.topk import TopKSelector
from . import papers
from .presets import SINKS
from .registry import parts, register

FAMILY = "attention-free"


@register(
    "streaming_llm",
    family=FAMILY,
    summary="Attention sinks plus the most recent tokens.",
    paper=papers.STREAMING_LLM,
    preset="4 sink tokens, rest recent (KVCache-Factory / kvpress); keys keep their original rotation",
)
def streaming_llm(sink: int = SINKS) -> Pipeline:
    """StreamingLLM (Xiao et al., 2024, arXiv 2309.17453): keep ``sink`` first tokens and the most recent ones."""
    return parts(RecencyScorer(), UniformBudget(), TopKSelector(sink=sink))


@register(
    "knorm",
    family=FAMILY,
    summary="Keep the keys with the lowest L2 norm (attention-free).",
    paper=papers.KNORM,
    preset="kvpress KnormPress: all layers, no protected window",
)
def knorm() -> Pipeline:
    """KNorm (Devoto et al., 2024, arXiv 2406.11430)."""
    return parts(KeyNormScorer(), UniformBudget(), TopKSelector())


@register(
    "keydiff",
    family=FAMILY,
    summary="Keep the keys least similar (cosine) to the head's mean key direction (attention-free).",
    paper=papers.KEYDIFF,
    preset="kvpress KeyDiffPress: anchor = mean of the unit-normalized keys of each KV head, score −cos(k, anchor), "
    "one-shot after prefill, no protected window",
)
def keydiff() -> Pipeline:
    """KeyDiff (Park et al., arXiv 2504.15364), one-shot after prefill."""
    return parts(KeyDiffScorer(), UniformBudget(), TopKSelector())


@register(
    "random",
    family=FAMILY,
    summary="Uniformly random entries: a sanity floor.",
    paper=papers.RANDOM,
    preset="seed 0, no protected window",
)
def random_method(seed: int = 0) -> Pipeline:
    """Random eviction (a floor every method should beat)."""
    return parts(RandomScorer(seed=seed), UniformBudget(), TopKSelector())
