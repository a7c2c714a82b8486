"""The registry of named compression methods.

Each method is a factory that composes a scorer, a budget allocator and a selector, with defaults taken from
``shared/specs`` (the preset each follows is named in its entry). Budgets count entries per layer and KV
head *including* protected windows.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

from .artifacts.compilerkv import TableSource
from .budgets.artifact_head_scores import ArtifactHeadScoreBudget
from .budgets.duo_heads import DuoHeadBudget
from .budgets.error_aware import (
    DEFAULT_MAX_FACTOR,
    DEFAULT_MIN_BUDGET,
    ArtifactErrorAwareBudget,
    LayerThenHeadBudget,
)
from .budgets.global_blocks import GlobalBlockBudget
from .budgets.global_threshold import GlobalThresholdBudget
from .budgets.head_adaptive import HeadAdaptiveBudget
from .budgets.head_scores import DEFAULT_BETA, DEFAULT_TEMPERATURE
from .budgets.keep_all import KeepAllBudget
from .budgets.partition import PartitionBudget
from .budgets.pyramid import PyramidBudget
from .budgets.uniform import UniformBudget
from .compression.pipeline import Pipeline
from .compression.schedule import TailFull, parse_schedule
from .errors import InvalidParameterError
from .scoring.cumulative_attention import CumulativeAttentionScorer
from .scoring.expected_attention import ExpectedAttentionScorer
from .scoring.head_subset import ArtifactHeadSubsetScorer
from .scoring.key_diff import KeyDiffScorer
from .scoring.key_norm import KeyNormScorer
from .scoring.lag_relative import LagRelativeScorer
from .scoring.observation import ObservationSpec
from .scoring.position import RecencyScorer
from .scoring.random import RandomScorer
from .scoring.reconstruction import ReconstructionScorer
from .scoring.squared_attention import SquaredAttentionScorer
from .scoring.stabilized_utility import StabilizedUtilityScorer
from .scoring.window_attention import WindowAttentionScorer
from .selection.chunk import ChunkSelector
from .selection.critical import CriticalSelector
from .selection.key_channels import QueryDrivenChannels
from .selection.partition import PartitionTopKSelector
from .selection.threshold import ThresholdGateSelector
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


_COMPRESSKV_PAPER = (
    "Lin et al., CompressKV: Semantic Retrieval Heads Know What Tokens are Not Important Before Generation "
    "(arXiv 2508.02401)"
)
_COMPRESSKV_PRESET = (
    "authors' code: top-4 heads per layer, window w=8 (summed over the window queries, fp32 softmax, each head "
    "against its own KV group), avg-pool k=5, mean over the heads, same indices for every KV head; "
    "Algorithm 1 with m=32, M=3B (kvtrim: m=min(32,B), M capped at the context); budget/ratio = mean entries per "
    "layer including the window; needs `kvtrim calibrate compresskv`"
)


def _compresskv_scorer(
    ranking: str, heads_per_layer: int, window: int, kernel: int, pooling: str, artifact: str | None, per_kv: bool
) -> ArtifactHeadSubsetScorer:
    return ArtifactHeadSubsetScorer(
        ranking=ranking,
        heads_per_layer=heads_per_layer,
        window=window,
        kernel=kernel,
        pooling=pooling,
        per_kv_head=per_kv,
        path=artifact,
    )


@register(
    "compresskv",
    "Per layer, the window attention of its top semantic retrieval heads (offline SRH scores), pooled and "
    "shared by all KV heads; error-aware layer budgets (Algorithm 1) from an offline layer-error profile.",
    _COMPRESSKV_PAPER,
    _COMPRESSKV_PRESET,
)
def compresskv(
    window: int = 8,
    kernel: int = 5,
    pooling: str = "avg",
    heads_per_layer: int = 4,
    min_budget: int = DEFAULT_MIN_BUDGET,
    max_factor: float = DEFAULT_MAX_FACTOR,
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
    return Pipeline(
        "compresskv",
        _compresskv_scorer(heads, heads_per_layer, window, kernel, pooling, artifact, False),
        ArtifactErrorAwareBudget(min_budget=min_budget, max_factor=max_factor, path=artifact),
        TopKSelector(recent=window),
        {
            "window": window,
            "kernel": kernel,
            "pooling": pooling,
            "heads_per_layer": heads_per_layer,
            "min_budget": min_budget,
            "max_factor": max_factor,
            "heads": heads,
            "artifact": artifact,
        },
    )


@register(
    "compresskv_srh_only",
    "CompressKV ablation: SRH token selection with uniform layer budgets.",
    _COMPRESSKV_PAPER,
    "as `compresskv`, every layer keeps the requested budget (the paper's SRH-only ablation)",
)
def compresskv_srh_only(
    window: int = 8,
    kernel: int = 5,
    pooling: str = "avg",
    heads_per_layer: int = 4,
    heads: str = "srh",
    artifact: str | None = None,
) -> Pipeline:
    """CompressKV's selection alone (arXiv 2508.02401): top SRH heads' window attention, uniform budgets."""
    return Pipeline(
        "compresskv_srh_only",
        _compresskv_scorer(heads, heads_per_layer, window, kernel, pooling, artifact, False),
        UniformBudget(),
        TopKSelector(recent=window),
        {
            "window": window,
            "kernel": kernel,
            "pooling": pooling,
            "heads_per_layer": heads_per_layer,
            "heads": heads,
            "artifact": artifact,
        },
    )


@register(
    "compresskv_trh",
    "CompressKV ablation: traditional (copy-paste) retrieval heads select the tokens; error-aware layer budgets.",
    _COMPRESSKV_PAPER,
    "as `compresskv` with the TRH ranking (Retrieval_Head criterion) instead of SRH",
)
def compresskv_trh(
    window: int = 8,
    kernel: int = 5,
    pooling: str = "avg",
    heads_per_layer: int = 4,
    min_budget: int = DEFAULT_MIN_BUDGET,
    max_factor: float = DEFAULT_MAX_FACTOR,
    artifact: str | None = None,
) -> Pipeline:
    """CompressKV (arXiv 2508.02401) with TRH heads in place of SRH heads (the paper's head-type ablation)."""
    pipeline = compresskv(window, kernel, pooling, heads_per_layer, min_budget, max_factor, "trh", artifact)
    pipeline.name = "compresskv_trh"
    pipeline.params.pop("heads")
    return pipeline


@register(
    "head_compresskv",
    "HeadKV per-head budgets (offline retrieval-reasoning head scores) with CompressKV's SRH token selection "
    "(stored ragged).",
    _COMPRESSKV_PAPER + "; " + _HEADKV_PAPER,
    "SRH selection as `compresskv` (nested token sets across the KV heads of a layer); HeadKV budgets as "
    "`headkv` (β, temperature); needs both `kvtrim calibrate compresskv` and `kvtrim calibrate headkv`",
)
def head_compresskv(
    window: int = 8,
    kernel: int = 5,
    pooling: str = "avg",
    heads_per_layer: int = 4,
    beta: float = DEFAULT_BETA,
    temperature: float = DEFAULT_TEMPERATURE,
    artifact: str | None = None,
    headkv_artifact: str | None = None,
) -> Pipeline:
    """CompressKV's SRH selection (arXiv 2508.02401) inside HeadKV budgets (arXiv 2410.19258)."""
    return Pipeline(
        "head_compresskv",
        _compresskv_scorer("srh", heads_per_layer, window, kernel, pooling, artifact, False),
        ArtifactHeadScoreBudget(beta=beta, temperature=temperature, window=window, path=headkv_artifact),
        TopKSelector(recent=window),
        {
            "window": window,
            "kernel": kernel,
            "pooling": pooling,
            "heads_per_layer": heads_per_layer,
            "beta": beta,
            "temperature": temperature,
            "artifact": artifact,
            "headkv_artifact": headkv_artifact,
        },
    )


@register(
    "ada_compresskv",
    "Error-aware layer budgets (CompressKV), split among each layer's KV heads by AdaKV; SRH scores per KV "
    "group select the tokens (stored ragged).",
    _COMPRESSKV_PAPER + "; Feng et al., Ada-KV (arXiv 2407.11550)",
    "Algorithm 1 layer budgets as `compresskv`; AdaKV official rule α=0.2 inside each layer; each KV head scored "
    "by the top SRH heads of its own group (layer mean when its group has none)",
)
def ada_compresskv(
    window: int = 8,
    kernel: int = 5,
    pooling: str = "avg",
    heads_per_layer: int = 4,
    min_budget: int = DEFAULT_MIN_BUDGET,
    max_factor: float = DEFAULT_MAX_FACTOR,
    alpha: float = 0.2,
    rule: str = "official",
    artifact: str | None = None,
) -> Pipeline:
    """CompressKV (arXiv 2508.02401) layer budgets with Ada-KV (arXiv 2407.11550) head budgets inside each layer.

    AdaKV needs scores that differ between KV heads, so each KV head is scored by the chosen SRH heads of its
    own GQA group (the layer's mean over all chosen heads when none of them is in the group).
    """
    return Pipeline(
        "ada_compresskv",
        _compresskv_scorer("srh", heads_per_layer, window, kernel, pooling, artifact, True),
        LayerThenHeadBudget(
            ArtifactErrorAwareBudget(min_budget=min_budget, max_factor=max_factor, path=artifact),
            HeadAdaptiveBudget(alpha=alpha, window=window, rule=rule),
        ),
        TopKSelector(recent=window),
        {
            "window": window,
            "kernel": kernel,
            "pooling": pooling,
            "heads_per_layer": heads_per_layer,
            "min_budget": min_budget,
            "max_factor": max_factor,
            "alpha": alpha,
            "rule": rule,
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


def _lag_pipeline(
    name: str, statistic: str, sink: int, lag: int, value_weight: float, eps: float, skip_layers: tuple[int, ...]
) -> Pipeline:
    for label, value in (("sink", sink), ("lag", lag)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if label == "lag" else 0):
            raise InvalidParameterError(f"{label} must be an integer >= {1 if label == 'lag' else 0}, got {value!r}")
    skip = tuple(int(i) for i in skip_layers)
    return Pipeline(
        name,
        LagRelativeScorer(sink=sink, lag=lag, statistic=statistic, value_weight=value_weight, eps=eps),
        PartitionBudget(sink=sink, lag=lag, skip_layers=skip),
        PartitionTopKSelector(sink=sink, lag=lag, skip_layers=skip),
        {"sink": sink, "lag": lag, "value_weight": value_weight, "eps": eps, "skip_layers": list(skip)},
        schedule=TailFull(lag=lag, sink=sink),
    )


_LAG_PAPER = (
    "Liang et al., LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are Important, 2025 "
    "(arXiv 2504.04704)"
)


@register(
    "lagkv",
    "Attention-free: min-max normalize each lag partition by the next one, keep the top r*L per KV head; "
    "recursive in prefill and every L decoded tokens.",
    _LAG_PAPER,
    "authors' code: S=16, L=128, r=1-ratio (k x <-> ratio 1-1/k), K+V scores summed; kvtrim adds eps=1e-6 "
    "to the min-max range and keeps kept entries in position order",
)
def lagkv(
    sink: int = 16, lag: int = 128, value_weight: float = 1.0, eps: float = 1e-6, skip_layers: tuple = ()
) -> Pipeline:
    """LagKV (Liang et al., 2025, arXiv 2504.04704).

    After ``sink`` tokens, the uncompressed tokens form partitions of ``lag`` tokens; each partition's keys and
    values are min–max normalized per channel with the statistics of the *next* partition, the channel-wise
    standard deviation of every token is softmaxed over the partition, key and value scores are summed
    (``value_weight`` = γ), and each (KV head, partition) keeps its top ``⌊r·L⌋`` tokens, ``r = 1 − ratio``.
    The last full partition and the remainder stay uncompressed; compressed tokens are never re-scored. The
    schedule compresses after prefill and again whenever the tail reaches ``2·lag`` tokens (every ``lag`` decoded
    tokens), and between the chunks of a chunked prefill. Differences from the authors' code (documented):
    ``eps`` in the normalization (their code divides by the raw range), kept entries sorted by position.
    ``skip_layers`` leaves some layers uncompressed (the code's ``skip_layer_idx``).
    """
    return _lag_pipeline("lagkv", "lag_std", sink, lag, value_weight, eps, skip_layers)


@register(
    "localkv",
    "LagKV ablation: each partition normalized with its own min-max statistics.",
    _LAG_PAPER,
    "as lagkv, reference = the partition itself (the paper's LocalKV ablation)",
)
def localkv(
    sink: int = 16, lag: int = 128, value_weight: float = 1.0, eps: float = 1e-6, skip_layers: tuple = ()
) -> Pipeline:
    """LocalKV, the ablation of LagKV (arXiv 2504.04704) without the lag: statistics of the partition itself."""
    return _lag_pipeline("localkv", "local_std", sink, lag, value_weight, eps, skip_layers)


@register(
    "lag_knorm",
    "Key L2 norm scored inside LagKV's recursive partition frame (lowest norms kept per partition).",
    _LAG_PAPER + "; score from Devoto et al., EMNLP 2024 (arXiv 2406.11430)",
    "as lagkv, score softmax(-||k||) per partition (the L2-norm baseline of the LagKV paper)",
)
def lag_knorm(sink: int = 16, lag: int = 128, skip_layers: tuple = ()) -> Pipeline:
    """The key-L2-norm score (arXiv 2406.11430) in LagKV's recursive frame (arXiv 2504.04704)."""
    return _lag_pipeline("lag_knorm", "key_norm", sink, lag, 0.0, 1e-6, skip_layers)

_COMPILERKV_PAPER = (
    "CompilerKV: Risk-Adaptive KV Compression via Offline Experience Compilation (arXiv 2602.08686)"
)
_COMPILERKV_PRESET = (
    "v2 operator (per-head ρ, cross-layer α, weighted max over heads, quantile risk bins, absolute threshold), "
    "W=64, pad-to-budget (kvtrim decision 2); tables compiled by `kvtrim calibrate compilerkv`"
)


def _compilerkv(
    name: str,
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
    return Pipeline(
        name,
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
        {
            "window": window,
            "mode": mode,
            "utility": utility,
            "alpha": alpha,
            "rho": rho,
            "normalize": normalize,
            "keep_window": keep_window,
            "static_threshold": static_threshold,
            "neutral": tables.neutral,
            "exact_budget": tables.exact_budget,
            "artifact": tables.path,
        },
    )


@register(
    "compilerkv",
    "Stabilized utility (cross-layer window attention × relative value norm), max over heads weighted by the "
    "compiled head reliability table; risk-adaptive threshold from the compiled risk table, top-k corrected to "
    "the budget (padded).",
    _COMPILERKV_PAPER,
    _COMPILERKV_PRESET,
)
def compilerkv(
    window: int = 64,
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
    tables = TableSource(path=artifact, exact_budget=exact_budget)
    return _compilerkv(
        "compilerkv", tables, window=window, mode=mode, utility=utility, alpha=alpha, rho=rho, normalize=normalize,
        keep_window=keep_window, missing_logprobs=missing_logprobs,
    )


@register(
    "compilerkv_elastic",
    "CompilerKV with the elastic budget clamp: only tokens above the risk-adaptive threshold are kept (≤ budget).",
    _COMPILERKV_PAPER,
    "as compilerkv, mode='elastic' (the v2 paper's clamp, no padding)",
)
def compilerkv_elastic(
    window: int = 64, exact_budget: bool = False, missing_logprobs: str = "error", artifact: str | None = None
) -> Pipeline:
    """CompilerKV (arXiv 2602.08686) with the elastic clamp: memory below the budget when the gate allows."""
    tables = TableSource(path=artifact, exact_budget=exact_budget)
    return _compilerkv(
        "compilerkv_elastic", tables, window=window, mode="elastic", missing_logprobs=missing_logprobs
    )


@register(
    "compilerkv_neutral",
    "CompilerKV ablation without compiled tables: all head weights 1 and one fixed threshold.",
    _COMPILERKV_PAPER,
    "as compilerkv with W_head ≡ 1 and τ ≡ 0.8 (the uncompiled operator); needs no artifact",
)
def compilerkv_neutral(window: int = 64, mode: str = "pad", threshold: float = 0.8) -> Pipeline:
    """The CompilerKV operator (arXiv 2602.08686) with neutral tables: an explicitly named ablation."""
    tables = TableSource(neutral=True, neutral_threshold=threshold)
    return _compilerkv("compilerkv_neutral", tables, window=window, mode=mode)


@register(
    "compilerkv_neutral_elastic",
    "CompilerKV ablation: neutral tables (weights 1, τ ≡ 0.8) with the elastic clamp.",
    _COMPILERKV_PAPER,
    "as compilerkv_neutral, mode='elastic'",
)
def compilerkv_neutral_elastic(window: int = 64, threshold: float = 0.8) -> Pipeline:
    """The CompilerKV operator (arXiv 2602.08686), neutral tables, elastic clamp."""
    tables = TableSource(neutral=True, neutral_threshold=threshold)
    return _compilerkv("compilerkv_neutral_elastic", tables, window=window, mode="elastic")


@register(
    "compilerkv_raw_attention",
    "CompilerKV ablation: the layer's raw window attention per head replaces the stabilized utility.",
    _COMPILERKV_PAPER,
    "as compilerkv with utility='raw' (no cross-layer mean, no value term); compiled head table",
)
def compilerkv_raw_attention(window: int = 64, mode: str = "pad", artifact: str | None = None) -> Pipeline:
    """CompilerKV (arXiv 2602.08686) with raw per-layer attention in place of α·ρ (the utility ablation)."""
    tables = TableSource(path=artifact)
    return _compilerkv("compilerkv_raw_attention", tables, window=window, mode=mode, utility="raw")


@register(
    "compilerkv_static_threshold",
    "CompilerKV ablation: elastic clamp with one static threshold instead of the compiled risk table.",
    _COMPILERKV_PAPER,
    "as compilerkv_elastic with τ ≡ 0.8 for every layer and prompt; compiled head table",
)
def compilerkv_static_threshold(window: int = 64, threshold: float = 0.8, artifact: str | None = None) -> Pipeline:
    """CompilerKV (arXiv 2602.08686), elastic, with a static threshold (the risk-gating ablation)."""
    tables = TableSource(path=artifact)
    return _compilerkv(
        "compilerkv_static_threshold", tables, window=window, mode="elastic", static_threshold=threshold
    )


_KVC_PAPER = (
    "Rehg, KV-Compress: Paged KV-Cache Compression with Variable Compression Rates per Attention Head "
    "(arXiv 2410.00161)"
)


class _SquaredAttentionPipeline(Pipeline):
    """A pipeline whose continuous schedules also accumulate decoding queries' squared attention per entry."""

    @property
    def observation(self) -> ObservationSpec:
        spec = self.scorer.observation
        if self.schedule.continuous:
            spec = spec.merge(ObservationSpec(accumulate=("attn_sq_sum",), chunk=spec.chunk))
        return spec


def _kvcompress(
    name: str, window: int | None, protected_window: int, kernel: int, buffer: int, block_size: int
) -> Pipeline:
    return _SquaredAttentionPipeline(
        name,
        SquaredAttentionScorer(window=window, kernel=kernel, buffer=buffer),
        GlobalBlockBudget(block_size=block_size, protected_window=protected_window),
        TopKSelector(recent=protected_window),
        {
            "window": window,
            "protected_window": protected_window,
            "kernel": kernel,
            "buffer": buffer,
            "block_size": block_size,
        },
    )


@register(
    "kvcompress",
    "Squared attention of the last w queries (max-pooled), blocks ranked across all layers and heads.",
    _KVC_PAPER,
    "KVC-w with w=32: L2-sum metric, max-pool k=7 per query head then sum over the group, protected window 32, "
    "block size 16, budget M = per-head mean incl. the window rounded up to whole blocks; with a continuous "
    "schedule (kvcompress@every:64) decoding queries' squared attention is added to the metric",
)
def kvcompress(
    window: int = 32, protected_window: int = 32, kernel: int = 7, buffer: int = 0, block_size: int = 16
) -> Pipeline:
    """KV-Compress (Rehg, arXiv 2410.00161), KVC-w: variable compression rates per layer and KV head.

    The paged engine (:mod:`kvtrim.serve`) runs the same ranking on real paged storage; here the kept entries are
    stored ragged. Continual compression: use a schedule (``kvcompress@every:64``).
    """
    return _kvcompress("kvcompress", window, protected_window, kernel, buffer, block_size)


@register(
    "kvc_w8",
    "KV-Compress with an 8-query observation window and an 8-token protected window.",
    _KVC_PAPER,
    "KVC-w with w=8 (the authors' LongBench scripts): protected window 8, max-pool k=7, block size 16",
)
def kvc_w8(
    window: int = 8, protected_window: int = 8, kernel: int = 7, buffer: int = 0, block_size: int = 16
) -> Pipeline:
    """KV-Compress (Rehg, arXiv 2410.00161), the KVC-w preset with w = 8."""
    return _kvcompress("kvc_w8", window, protected_window, kernel, buffer, block_size)


@register(
    "kvc_full",
    "KV-Compress with squared attention summed over every prompt query (10 nearest keys excluded), no pooling.",
    _KVC_PAPER,
    "KVC-full: all prompt queries, v=10 nearest keys excluded per query, no max-pool, protected window 32, "
    "block size 16",
)
def kvc_full(protected_window: int = 32, buffer: int = 10, kernel: int = 1, block_size: int = 16) -> Pipeline:
    """KV-Compress (Rehg, arXiv 2410.00161), the KVC-full preset (metric over all prompt queries)."""
    return _kvcompress("kvc_full", None, protected_window, kernel, buffer, block_size)


# ---------------------------------------------------------------- kvpress methods (issue 19): ExpectedAttention,
# KeyDiff, ChunkKV, KVzip


@register(
    "expected_attention",
    "Expected attention of future queries (Gaussian query statistics moved by the average rotary rotation "
    "ahead) times ‖v‖; sinks kept. Query-agnostic.",
    "Devoto et al., Expected Attention: KV Cache Compression by Estimating Attention from Future Queries "
    "Distribution (arXiv 2510.00636); kvpress ExpectedAttentionPress",
    "kvpress defaults: 512 future positions, 4 sinks, covariance on, value-norm rescaling on, ε=0; statistics "
    "from the post-RoPE prompt queries un-rotated (kvtrim records every prompt query)",
)
def expected_attention(
    n_future: int = 512, n_sink: int = 4, use_covariance: bool = True, use_vnorm: bool = True, eps: float = 0.0
) -> Pipeline:
    """Expected Attention (Devoto et al., arXiv 2510.00636): kvpress's query-agnostic expected-attention score."""
    return Pipeline(
        "expected_attention",
        ExpectedAttentionScorer(
            n_future=n_future, n_sink=n_sink, use_covariance=use_covariance, use_vnorm=use_vnorm, eps=eps
        ),
        UniformBudget(),
        TopKSelector(sink=n_sink),
        {"n_future": n_future, "n_sink": n_sink, "use_covariance": use_covariance, "use_vnorm": use_vnorm,
         "eps": eps},
    )


@register(
    "keydiff",
    "Keep the keys least similar (cosine) to the head's mean key direction (attention-free).",
    "Park et al., KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in "
    "Resource-Constrained Environments (arXiv 2504.15364)",
    "kvpress KeyDiffPress: anchor = mean of the unit-normalized keys of each KV head, score −cos(k, anchor), "
    "one-shot after prefill, no protected window",
)
def keydiff() -> Pipeline:
    """KeyDiff (Park et al., arXiv 2504.15364), one-shot after prefill."""
    return Pipeline("keydiff", KeyDiffScorer(), UniformBudget(), TopKSelector(), {})


_CHUNKKV_PAPER = (
    "Liu et al., ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM Inference "
    "(arXiv 2502.00299)"
)


def _chunkkv(name: str, window: int, chunk: int, reuse_layers: int, share_heads: bool) -> Pipeline:
    scorer = WindowAttentionScorer(window=window, kernel=1, pooling="none", aggregate="mean", group_reduce="mean")
    return Pipeline(
        name,
        scorer,
        UniformBudget(),
        ChunkSelector(chunk=chunk, recent=window, reuse_layers=reuse_layers, share_heads=share_heads),
        {"window": window, "chunk": chunk, "reuse_layers": reuse_layers, "share_heads": share_heads},
    )


@register(
    "chunkkv",
    "Window attention summed into chunks of 10 contiguous tokens; whole chunks kept (the same for every KV head "
    "of a layer) plus the window.",
    _CHUNKKV_PAPER,
    "chunk size 10 (paper default), observation window w=8 (kvtrim's SnapKV preset, no pooling), chunk score = "
    "mean token score summed over the KV heads (kvpress ChunkKVPress), no layer reuse",
)
def chunkkv(window: int = 8, chunk: int = 10, reuse_layers: int = 1, share_heads: bool = True) -> Pipeline:
    """ChunkKV (Liu et al., arXiv 2502.00299): chunk-granular selection; ``reuse_layers`` > 1 shares indices."""
    return _chunkkv("chunkkv", window, chunk, reuse_layers, share_heads)


@register(
    "chunkkv_reuse",
    "ChunkKV with layer-wise index reuse: each pair of layers keeps the chunks chosen by its first layer.",
    _CHUNKKV_PAPER,
    "as chunkkv with reuse_layers=2 (the paper's index-reuse setting of 2 layers per group)",
)
def chunkkv_reuse(window: int = 8, chunk: int = 10, reuse_layers: int = 2, share_heads: bool = True) -> Pipeline:
    """ChunkKV (arXiv 2502.00299) with layer-wise index reuse (layers grouped by ``reuse_layers``)."""
    return _chunkkv("chunkkv_reuse", window, chunk, reuse_layers, share_heads)


@register(
    "kvzip",
    "Query-agnostic: the model re-reads its context after a repeat instruction; an entry scores the largest "
    "attention the reconstruction pays it; one global threshold across layers and heads (stored ragged). "
    "Costs one extra forward pass over the prompt at compression.",
    "Kim et al., KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction, NeurIPS 2025 "
    "(arXiv 2505.23416)",
    "kvpress KVzipPress defaults: prompt 'Repeat the previous context exactly.' in the chat template, 4 sinks, "
    "max over the group and the reconstruction queries, non-layerwise (global) budgets; layerwise=True gives "
    "every layer the same budget; one reconstruction pass instead of 2K-token chunks",
)
def kvzip(
    prompt: str = "Repeat the previous context exactly.",
    n_sink: int = 4,
    layerwise: bool = False,
    chunk: int = 256,
    tokenizer: str | None = None,
) -> Pipeline:
    """KVzip (Kim et al., arXiv 2505.23416): context-reconstruction scores, global or per-layer budgets."""
    return Pipeline(
        "kvzip",
        ReconstructionScorer(prompt=prompt, n_sink=n_sink, chunk=chunk, tokenizer=tokenizer),
        UniformBudget() if layerwise else GlobalThresholdBudget(),
        TopKSelector(sink=n_sink),
        {"prompt": prompt, "n_sink": n_sink, "layerwise": layerwise, "chunk": chunk, "tokenizer": tokenizer},
    )


# ---------------------------------------------------------------------------------------- ThinK and DuoAttention
_THINK_PAPER = "Xu et al., ThinK: Thinner Key Cache by Query-Driven Pruning, ICLR 2025 (arXiv 2407.21018)"
_DUO_PAPER = (
    "Xiao et al., DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming Heads, "
    "ICLR 2025 (arXiv 2410.10819)"
)


@register(
    "think",
    "Key-channel pruning: per KV head, the key channels with the largest ||Q_obs[:,i]||*||K[:,i]|| are kept "
    "(keys stored thinner); no token is evicted. The ratio is the fraction of key channels pruned.",
    _THINK_PAPER,
    "observation window w=8 (as kvtrim's SnapKV), post-rotary queries of the GQA group stacked; ratio = λ "
    "(paper: 0.4-0.5); tokens appended after compression are pruned to the same channels",
)
def think(window: int = 8) -> Pipeline:
    """ThinK (Xu et al., 2025, arXiv 2407.21018) alone: prune a ``ratio`` fraction of every KV head's key channels.

    Keys are stored with ``head_dim − ⌊ratio·head_dim⌋`` channels (values untouched), so the K/V bytes drop by
    about ``ratio / 2``. Needs a ratio; a budget of entries has no channel meaning.
    """
    return Pipeline(
        "think",
        RecencyScorer(),
        KeepAllBudget(),
        TopKSelector(),
        {"window": window},
        channels=QueryDrivenChannels(window=window),
    )


@register(
    "think_snapkv",
    "SnapKV token selection, then ThinK key-channel pruning of the kept keys.",
    _THINK_PAPER + "; " + "Li et al., SnapKV, NeurIPS 2024 (arXiv 2404.14469)",
    "SnapKV as `snapkv` (w=8, max-pool k=7) under the requested ratio/budget; channel_ratio λ=0.5 of the key "
    "channels (the paper's SnapKV+ThinK setting prunes 40-50%), scored by the same window",
)
def think_snapkv(window: int = 8, kernel: int = 7, pooling: str = "max", channel_ratio: float = 0.5) -> Pipeline:
    """ThinK (arXiv 2407.21018) on top of SnapKV (arXiv 2404.14469): tokens by SnapKV, then key channels.

    The ratio/budget is SnapKV's (tokens); ``channel_ratio`` of the kept keys' channels is pruned on top, so the
    K/V bytes are about ``(1 − ratio)·(1 − channel_ratio/2)`` of the full cache.
    """
    return Pipeline(
        "think_snapkv",
        _snap_scorer(window, kernel, pooling),
        UniformBudget(),
        TopKSelector(recent=window),
        {"window": window, "kernel": kernel, "pooling": pooling, "channel_ratio": channel_ratio},
        channels=QueryDrivenChannels(window=window, fraction=channel_ratio),
    )


@register(
    "duo_attention",
    "Retrieval heads keep the whole context, streaming heads keep sinks + recent tokens; heads ranked by offline "
    "DuoAttention gates, the number of streaming heads set by the ratio (stored ragged).",
    _DUO_PAPER,
    "sink 16 + recent 48 (scaled down from the paper's 64-128 + 256 for ~1k-token contexts); the lowest-gate "
    "heads stream, as many as the ratio/budget needs (kvpress-style head_compression), ties by (layer, head); "
    "needs `kvtrim calibrate duo`",
)
def duo_attention(sink: int = 16, recent: int = 48, artifact: str | None = None) -> Pipeline:
    """DuoAttention (Xiao et al., 2025, arXiv 2410.10819) with gates from the ``duo`` artifact.

    ``n_s = ⌈N (T − B)/(T − W)⌉`` of the ``N`` (layer, KV head) pairs stream (``W = sink + recent``, ``B`` the
    requested mean keep, ``T`` the context), so memory matches the ratio like every other method; when ``B < W``
    every head streams with ``B`` tokens (:mod:`kvtrim.budgets.duo_heads`). ``artifact=PATH`` loads another file.
    """
    return Pipeline(
        "duo_attention",
        RecencyScorer(),
        DuoHeadBudget(sink=sink, recent=recent, path=artifact),
        TopKSelector(sink=sink),
        {"sink": sink, "recent": recent, "artifact": artifact},
    )


def method_names() -> list[str]:
    """Names of all registered methods."""
    return sorted(_REGISTRY)


def split_schedule(name: str) -> tuple[str, str | None]:
    """``"snapkv@every:64"`` → ``("snapkv", "every:64")``; a plain name has no schedule."""
    base, sep, schedule = name.partition("@")
    return base, (schedule if sep else None)


def method_info(name: str) -> MethodInfo:
    """The registry entry for ``name`` (a ``@schedule`` suffix is ignored; the error lists the valid names)."""
    base, _ = split_schedule(name)
    if base not in _REGISTRY:
        raise InvalidParameterError(f"method={name!r} is unknown; valid methods: {', '.join(method_names())}")
    return _REGISTRY[base]


def get_method(name: str, **params) -> Pipeline:
    """Build the pipeline of method ``name`` with optional parameter overrides.

    ``name@schedule`` runs the method with a decoding-time schedule (see :mod:`kvtrim.compression.schedule`), e.g.
    ``"snapkv@every:64"`` re-compresses every 64 new tokens and ``"snapkv@over:0"`` caps every head at its budget.
    """
    info = method_info(name)
    _, schedule = split_schedule(name)
    allowed = info.defaults()
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise InvalidParameterError(
            f"method {name!r} has no parameter(s) {unknown}; its parameters are {sorted(allowed) or 'none'}"
        )
    pipeline = info.factory(**params)
    if schedule is not None:
        parsed = parse_schedule(schedule, sink=int(pipeline.params.get("sink", 0)))
        if isinstance(parsed, TailFull) and not isinstance(pipeline.selector, PartitionTopKSelector):
            raise InvalidParameterError(
                f"schedule 'tail:LAG' needs a lag-partition method (lagkv, localkv, lag_knorm), not {info.name!r}; "
                "use 'every:N' or 'over:SLACK'"
            )
        pipeline.schedule = parsed
        pipeline.name = name
    return pipeline


def methods() -> dict[str, str]:
    """Registry listing: name → one-line summary with the paper."""
    return {name: f"{info.summary} [{info.paper}]" for name, info in sorted(_REGISTRY.items())}
