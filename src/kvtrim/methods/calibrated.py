"""kvpress presses whose parts are calibrated offline per model: Q-Filters (a key-space direction per head) and
LU-KV (per-head budget curves)."""

from __future__ import annotations

from ..budgets.uniform import UniformBudget
from ..budgets.utility_curves import UtilityCurveBudget
from ..compression.pipeline import Pipeline
from ..errors import InvalidParameterError
from ..scoring.expected_attention import ExpectedAttentionScorer
from ..scoring.query_filter import QueryFilterScorer
from ..selection.topk import TopKSelector
from . import papers
from .presets import SINKS
from .registry import parts, register

FAMILY = "kvpress"

LUKV_EPS = 0.02
"""kvpress LUKVPress's default scorer: ExpectedAttentionPress(epsilon=2e-2)."""


@register(
    "qfilter",
    family=FAMILY,
    summary="Keys scored by their projection on the principal direction of the head's queries (offline Q-Filters); "
    "the largest projections kept. No attention weights, query-agnostic.",
    paper=papers.QFILTERS,
    preset="kvpress QFilterPress: no protected window; filters from `kvtrim calibrate qfilter` (SVD of the post-RoPE "
    "queries of each GQA group on kvtrim's synthetic tasks) instead of the authors' Hub files",
)
def qfilter(artifact: str | None = None) -> Pipeline:
    """Q-Filters (Godey et al., arXiv 2503.02812): score ``⟨k, u_{l,h}⟩`` with ``u`` the first right singular vector
    of the queries of KV head ``h``'s group (``qfilter`` artifact, ``[layers, kv_heads, head_dim]``), oriented so
    queries project positively on it. ``artifact=PATH`` loads another file."""
    return parts(QueryFilterScorer(path=artifact), UniformBudget(), TopKSelector())


@register(
    "lukv",
    family=FAMILY,
    summary="Per-head budgets from offline LU-KV curves (greedy marginal future utility over each head's concave "
    "hull), expected-attention selection inside each head (stored ragged).",
    paper=papers.LUKV,
    preset="kvpress LUKVPress defaults: ExpectedAttentionPress(ε=0.02), 4 sinks, window 1; curves from "
    "`kvtrim calibrate lukv` (utility = attention from the question and answer of kvtrim's synthetic tasks) "
    "interpolated between whole percents",
)
def lukv(sink: int = SINKS, window: int = 1, eps: float = LUKV_EPS, artifact: str | None = None) -> Pipeline:
    """LU-KV (Tang et al., arXiv 2602.08585) around kvpress's expected attention: each (layer, KV head) keeps the
    fraction of the context its offline curve gives at the requested ratio (``lukv`` artifact), its highest
    expected-attention entries after ``sink`` first and ``window`` last tokens. The curves are calibrated for the
    default ``sink``, ``window`` and ``eps``; ``artifact=PATH`` loads another file."""
    for name, value in (("sink", sink), ("window", window)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidParameterError(f"{name} must be a non-negative integer (tokens), got {value!r}")
    scorer = ExpectedAttentionScorer(n_sink=sink, eps=eps)
    budget = UtilityCurveBudget(protected=sink + window, path=artifact)
    return parts(scorer, budget, TopKSelector(sink=sink, recent=window))
