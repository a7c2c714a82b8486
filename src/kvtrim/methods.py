"""The registry of named compression methods.

Each method is a factory that composes a scorer, a budget allocator and a selector, with defaults taken from
``shared/specs`` (the preset each follows is named in its entry). Budgets count entries per layer and KV
head *including* protected windows.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

from .budgets.artifact_head_scores import ArtifactHeadScoreBudget
from .budgets.head_adaptive import HeadAdaptiveBudget
from .budgets.head_scores import DEFAULT_BETA, DEFAULT_TEMPERATURE
from .budgets.pyramid import PyramidBudget
from .budgets.uniform import UniformBudget
from .errors import InvalidParameterError
from .pipeline import Pipeline
from .scoring.cumulative_attention import CumulativeAttentionScorer
from .scoring.key_norm import KeyNormScorer
from .scoring.position import RecencyScorer
from .scoring.random import RandomScorer
from .scoring.window_attention import WindowAttentionScorer
from .selection.critical import CriticalSelector
from .selection.topk import TopKSelector


@dataclass(frozen=True)
class MethodInfo:
    """A registry entry."""

    name: str
    factory: Callable[..., Pipeline]
    summary: str
    paper: str
    preset: str

    def defaults(self) -> dict:
        return {
            name: p.default
            for name, p in inspect.signature(self.factory).parameters.items()
            if p.default is not inspect.Parameter.empty
        }


_REGISTRY: dict[str, MethodInfo] = {}


def register(name: str, summary: str, paper: str, preset: str):
    """Decorator adding a pipeline factory to the registry."""

    def wrap(factory: Callable[..., Pipeline]) -> Callable[..., Pipeline]:
        _REGISTRY[name] = MethodInfo(name, factory, summary, paper, preset)
        return factory

    return wrap


def _snap_scorer(window: int, kernel: int, pooling: str) -> WindowAttentionScorer:
    return WindowAttentionScorer(window=window, kernel=kernel, pooling=pooling, aggregate="mean", group_reduce="mean")


@register(
    "streaming_llm",
    "Attention sinks plus the most recent tokens.",
    "Xiao et al., Efficient Streaming Language Models with Attention Sinks, ICLR 2024 (arXiv 2309.17453)",
    "4 sink tokens, rest recent (KVCache-Factory / kvpress); keys keep their original rotation",
)
def streaming_llm(sink: int = 4) -> Pipeline:
    """StreamingLLM (Xiao et al., 2024, arXiv 2309.17453): keep ``sink`` first tokens and the most recent ones."""
    return Pipeline("streaming_llm", RecencyScorer(), UniformBudget(), TopKSelector(sink=sink), {"sink": sink})


@register(
    "snapkv",
    "Attention of the last w prompt queries, pooled; top entries per KV head plus the window.",
    "Li et al., SnapKV: LLM Knows What You are Looking for Before Generation, NeurIPS 2024 (arXiv 2404.14469)",
    "KVCache-Factory run config: w=8, max-pool k=7 (also HeadKV/CompressKV/DynamicKV); the paper's w=32 is "
    "window=32. GQA: mean over the group before pooling (AdaKV gqa_support)",
)
def snapkv(window: int = 8, kernel: int = 7, pooling: str = "max") -> Pipeline:
    """SnapKV (Li et al., 2024, arXiv 2404.14469). Window tokens are always kept and count in the budget."""
    return Pipeline(
        "snapkv",
        _snap_scorer(window, kernel, pooling),
        UniformBudget(),
        TopKSelector(recent=window),
        {"window": window, "kernel": kernel, "pooling": pooling},
    )


@register(
    "pyramidkv",
    "SnapKV selection under pyramid-shaped layer budgets (more in lower layers).",
    "Cai et al., PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling (arXiv 2406.02069)",
    "beta=20, w=8, max-pool k=7 (KVCache-Factory PyramidKVCluster and run config), SnapKV scorer as in `snapkv`",
)
def pyramidkv(window: int = 8, kernel: int = 7, pooling: str = "max", beta: float = 20.0) -> Pipeline:
    """PyramidKV (Cai et al., 2024, arXiv 2406.02069): per-layer budgets decrease linearly with depth."""
    return Pipeline(
        "pyramidkv",
        _snap_scorer(window, kernel, pooling),
        PyramidBudget(beta=beta, window=window),
        TopKSelector(recent=window),
        {"window": window, "kernel": kernel, "pooling": pooling, "beta": beta},
    )


@register(
    "adakv",
    "SnapKV scores; the KV heads of each layer share its budget by score (variable per head, stored ragged).",
    "Feng et al., Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM Inference "
    "(arXiv 2407.11550)",
    "official AdaKV rule b_h = c_h(1-α) + αB' with α=0.2 at KV-head granularity; SnapKV scorer as in `snapkv` "
    "(w=8, max-pool k=7); rule='kvpress' gives kvpress's top-⌊αB'⌋ safeguard",
)
def adakv(
    window: int = 8, kernel: int = 7, pooling: str = "max", alpha: float = 0.2, rule: str = "official"
) -> Pipeline:
    """Ada-KV (Feng et al., 2024, arXiv 2407.11550) on SnapKV scores; real per-head memory (ragged storage)."""
    return Pipeline(
        "adakv",
        _snap_scorer(window, kernel, pooling),
        HeadAdaptiveBudget(alpha=alpha, window=window, rule=rule),
        TopKSelector(recent=window),
        {"window": window, "kernel": kernel, "pooling": pooling, "alpha": alpha, "rule": rule},
    )


_CRITICAL_PAPER = (
    "Feng et al., CriticalKV: Optimizing KV Cache Eviction from an Output Perturbation Perspective, ICML 2026 "
    "(arXiv 2502.03805, v1: Identify Critical KV Cache in LLM Inference from an Output Perturbation Perspective)"
)


@register(
    "critical_snapkv",
    "CriticalKV two-stage selection (attention, then (A+ε)·‖V·W_O‖₁) on SnapKV scores, uniform budgets.",
    _CRITICAL_PAPER,
    "α=0.5, ε=1e-4, L1 norm per query-head slice of W_O, mean over the group (paper code); SnapKV scorer as in "
    "`snapkv`",
)
def critical_snapkv(
    window: int = 8, kernel: int = 7, pooling: str = "max", alpha: float = 0.5, eps: float = 1e-4
) -> Pipeline:
    """CriticalKV (Feng et al., arXiv 2502.03805) with SnapKV scores and uniform budgets."""
    return Pipeline(
        "critical_snapkv",
        _snap_scorer(window, kernel, pooling),
        UniformBudget(),
        CriticalSelector(alpha=alpha, eps=eps, recent=window),
        {"window": window, "kernel": kernel, "pooling": pooling, "alpha": alpha, "eps": eps},
    )


@register(
    "critical_adakv",
    "CriticalKV two-stage selection inside AdaKV's per-head budgets (stored ragged).",
    _CRITICAL_PAPER,
    "α=0.5, ε=1e-4; AdaKV official rule with α_s=0.2 (spec decision 8); SnapKV scorer as in `snapkv`",
)
def critical_adakv(
    window: int = 8,
    kernel: int = 7,
    pooling: str = "max",
    alpha: float = 0.5,
    eps: float = 1e-4,
    safeguard: float = 0.2,
    rule: str = "official",
) -> Pipeline:
    """CriticalKV (Feng et al., arXiv 2502.03805) on Ada-KV budgets (arXiv 2407.11550)."""
    return Pipeline(
        "critical_adakv",
        _snap_scorer(window, kernel, pooling),
        HeadAdaptiveBudget(alpha=safeguard, window=window, rule=rule),
        CriticalSelector(alpha=alpha, eps=eps, recent=window),
        {
            "window": window,
            "kernel": kernel,
            "pooling": pooling,
            "alpha": alpha,
            "eps": eps,
            "safeguard": safeguard,
            "rule": rule,
        },
    )


_HEADKV_PAPER = (
    "Fu et al., Not All Heads Matter: A Head-Level KV Cache Compression Method with Integrated Retrieval and "
    "Reasoning, ICLR 2025 (arXiv 2410.19258)"
)


@register(
    "headkv",
    "Per-head budgets from offline retrieval-reasoning head scores (calibration artifact), SnapKV selection "
    "inside each head (stored ragged).",
    _HEADKV_PAPER,
    "HeadKV LongBench settings w=8, max-pool k=7, temperature 1; β from the sweep on the embedded model; "
    "query-head capacities averaged within each GQA group (KVCache-Factory kv_head mode); needs "
    "`kvtrim calibrate headkv`",
)
def headkv(
    window: int = 8,
    kernel: int = 7,
    pooling: str = "max",
    beta: float = DEFAULT_BETA,
    temperature: float = DEFAULT_TEMPERATURE,
    scores: str = "retrieval_reasoning",
    artifact: str | None = None,
) -> Pipeline:
    """HeadKV (Fu et al., 2025, arXiv 2410.19258): head-level budgets from offline head scores."""
    return Pipeline(
        "headkv",
        _snap_scorer(window, kernel, pooling),
        ArtifactHeadScoreBudget(beta=beta, temperature=temperature, window=window, scores=scores, path=artifact),
        TopKSelector(recent=window),
        {
            "window": window,
            "kernel": kernel,
            "pooling": pooling,
            "beta": beta,
            "temperature": temperature,
            "scores": scores,
            "artifact": artifact,
        },
    )


@register(
    "critical_headkv",
    "CriticalKV two-stage selection inside HeadKV's per-head budgets (stored ragged).",
    _CRITICAL_PAPER + "; " + _HEADKV_PAPER,
    "α=0.5, ε=1e-4 inside each head's HeadKV budget (spec decision 3); HeadKV settings as in `headkv`",
)
def critical_headkv(
    window: int = 8,
    kernel: int = 7,
    pooling: str = "max",
    alpha: float = 0.5,
    eps: float = 1e-4,
    beta: float = DEFAULT_BETA,
    temperature: float = DEFAULT_TEMPERATURE,
    scores: str = "retrieval_reasoning",
    artifact: str | None = None,
) -> Pipeline:
    """CriticalKV (arXiv 2502.03805) on HeadKV budgets (arXiv 2410.19258)."""
    return Pipeline(
        "critical_headkv",
        _snap_scorer(window, kernel, pooling),
        ArtifactHeadScoreBudget(beta=beta, temperature=temperature, window=window, scores=scores, path=artifact),
        CriticalSelector(alpha=alpha, eps=eps, recent=window),
        {
            "window": window,
            "kernel": kernel,
            "pooling": pooling,
            "alpha": alpha,
            "eps": eps,
            "beta": beta,
            "temperature": temperature,
            "scores": scores,
            "artifact": artifact,
        },
    )


@register(
    "h2o",
    "Heavy hitters by attention accumulated over all prompt queries, plus recent tokens.",
    "Zhang et al., H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs, NeurIPS 2023 "
    "(arXiv 2306.14048)",
    "paper split: half heavy hitters, half recent; prefill-only; sums over queries in chunks of 256",
)
def h2o(recent_fraction: float = 0.5, chunk: int = 256) -> Pipeline:
    """H2O (Zhang et al., 2023, arXiv 2306.14048) applied once after prefill."""
    if not 0.0 <= recent_fraction <= 1.0:
        raise InvalidParameterError(f"recent_fraction must be in [0, 1], got {recent_fraction}")
    return Pipeline(
        "h2o",
        CumulativeAttentionScorer(chunk=chunk),
        UniformBudget(),
        TopKSelector(recent=float(recent_fraction)),
        {"recent_fraction": recent_fraction, "chunk": chunk},
    )


@register(
    "knorm",
    "Keep the keys with the lowest L2 norm (attention-free).",
    "Devoto et al., A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression, EMNLP 2024 "
    "(arXiv 2406.11430)",
    "kvpress KnormPress: all layers, no protected window",
)
def knorm() -> Pipeline:
    """KNorm (Devoto et al., 2024, arXiv 2406.11430)."""
    return Pipeline("knorm", KeyNormScorer(), UniformBudget(), TopKSelector(), {})


@register(
    "tova",
    "Last query's attention averaged over heads; one token set per layer.",
    "Oren et al., Transformers are Multi-State RNNs (TOVA), EMNLP 2024 (arXiv 2401.06104)",
    "kvpress TOVAPress: one-shot after prefill, window 1, head-averaged, last token kept",
)
def tova() -> Pipeline:
    """TOVA (Oren et al., 2024, arXiv 2401.06104), one-shot after prefill."""
    scorer = WindowAttentionScorer(window=1, kernel=1, pooling="none", group_reduce="mean", head_mean=True)
    return Pipeline("tova", scorer, UniformBudget(), TopKSelector(recent=1), {})


@register(
    "random",
    "Uniformly random entries: a sanity floor.",
    "Baseline used across the KV-compression literature (e.g. kvpress RandomPress)",
    "seed 0, no protected window",
)
def random_method(seed: int = 0) -> Pipeline:
    """Random eviction (a floor every method should beat)."""
    return Pipeline("random", RandomScorer(seed=seed), UniformBudget(), TopKSelector(), {"seed": seed})


def method_names() -> list[str]:
    """Names of all registered methods."""
    return sorted(_REGISTRY)


def method_info(name: str) -> MethodInfo:
    """The registry entry for ``name`` (error lists the valid names)."""
    if name not in _REGISTRY:
        raise InvalidParameterError(f"method={name!r} is unknown; valid methods: {', '.join(method_names())}")
    return _REGISTRY[name]


def get_method(name: str, **params) -> Pipeline:
    """Build the pipeline of method ``name`` with optional parameter overrides."""
    info = method_info(name)
    allowed = info.defaults()
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise InvalidParameterError(
            f"method {name!r} has no parameter(s) {unknown}; its parameters are {sorted(allowed) or 'none'}"
        )
    return info.factory(**params)


def methods() -> dict[str, str]:
    """Registry listing: name → one-line summary with the paper."""
    return {name: f"{info.summary} [{info.paper}]" for name, info in sorted(_REGISTRY.items())}
