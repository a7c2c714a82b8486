"""Methods from kvpress's press family: expected attention, chunk-granular selection, context reconstruction,
a learned surrogate of KVzip (KVzap), leverage scores (CurDKV, Compactor, CapKV), block-wise compression, lazy
layers (SimLayerKV), the question's attention (FINCH), entropy-gated chunks, composite tokens (KVCompose),
merge on evict, cache merging (CaM), key re-rotation, gradient attribution (KVgrad)."""

from __future__ import annotations

import math

from ..budgets.composite import CompositeLayerBudget
from ..budgets.global_threshold import GlobalThresholdBudget
from ..budgets.layer_ratios import LayerRatioBudget
from ..budgets.lazy_layers import LazyLayerBudget
from ..budgets.score_threshold import ScoreThresholdBudget
from ..budgets.uniform import UniformBudget
from ..compression.pipeline import Pipeline
from ..errors import InvalidParameterError
from ..scoring.base import Scorer
from ..scoring.capacity import CapacityScorer
from ..scoring.expected_attention import ExpectedAttentionScorer, StoredStatsExpectedAttentionScorer
from ..scoring.gradient_attribution import GradientAttributionScorer
from ..scoring.leverage import KeyLeverageScorer, LocalLeverageScorer
from ..scoring.noncausal_attention import ChunkAttentionScorer, LeverageAttentionScorer
from ..scoring.question_attention import QuestionAttentionScorer
from ..scoring.reconstruction import ReconstructionScorer
from ..scoring.reread import RereadAttentionScorer
from ..scoring.surrogate import GateScorer, HiddenStateSurrogateScorer
from ..scoring.window_attention import WindowAttentionScorer
from ..selection.block_iterative import BlockIterativeSelector
from ..selection.chunk import ChunkSelector
from ..selection.chunk_quota import ChunkQuotaSelector
from ..selection.entropy_chunk import EntropyGatedChunkSelector
from ..selection.merge import NearestKeyMerge
from ..selection.neighbour_merge import NeighbourMerge
from ..selection.rerotation import KeyRerotation
from ..selection.restore_tokens import RestoreTokens
from ..selection.topk import TopKSelector
from . import papers
from .presets import SINKS, SNAPKV
from .registry import get_method, method_names, parts, register

FAMILY = "kvpress"


@register(
    "expected_attention",
    family=FAMILY,
    summary="Expected attention of future queries (Gaussian query statistics moved by the average rotary rotation "
    "ahead) times ‖v‖; sinks kept. Query-agnostic.",
    paper=papers.EXPECTED_ATTENTION,
    preset="kvpress defaults: 512 future positions, 4 sinks, covariance on, value-norm rescaling on, ε=0; "
    "statistics from the post-RoPE prompt queries un-rotated (kvtrim records every prompt query)",
)
def expected_attention(
    n_future: int = 512, n_sink: int = SINKS, use_covariance: bool = True, use_vnorm: bool = True, eps: float = 0.0
) -> Pipeline:
    """Expected Attention (Devoto et al., arXiv 2510.00636): kvpress's query-agnostic expected-attention score."""
    scorer = ExpectedAttentionScorer(
        n_future=n_future, n_sink=n_sink, use_covariance=use_covariance, use_vnorm=use_vnorm, eps=eps
    )
    return parts(scorer, UniformBudget(), TopKSelector(sink=n_sink))


@register(
    "expected_attention_stats",
    family=FAMILY,
    summary="Expected attention with each layer's query statistics computed offline on calibration prompts "
    "instead of the prompt's own queries (nothing recorded at prefill); sinks kept. Needs the "
    "`expected_attention_stats` artifact.",
    paper=papers.EXPECTED_ATTENTION,
    preset="kvpress ExpectedAttentionStatsPress defaults (those of expected_attention); the statistics come from "
    "`kvtrim calibrate expected_attention_stats` (kvtrim's calibration prompts instead of BookSum, population "
    "covariance), docs/calibration.md",
)
def expected_attention_stats(
    n_future: int = 512,
    n_sink: int = SINKS,
    use_covariance: bool = True,
    use_vnorm: bool = True,
    eps: float = 0.0,
    artifact: str | None = None,
) -> Pipeline:
    """Expected Attention (Devoto et al., arXiv 2510.00636) with stored query statistics (kvpress's
    ExpectedAttentionStatsPress)."""
    scorer = StoredStatsExpectedAttentionScorer(
        n_future=n_future, n_sink=n_sink, use_covariance=use_covariance, use_vnorm=use_vnorm, eps=eps, artifact=artifact
    )
    return parts(scorer, UniformBudget(), TopKSelector(sink=n_sink))


def _chunkkv_parts(window: int, chunk: int, reuse_layers: int, share_heads: bool) -> Pipeline:
    scorer = WindowAttentionScorer(window=window, kernel=1, pooling="none", aggregate="mean", group_reduce="mean")
    selector = ChunkSelector(chunk=chunk, recent=window, reuse_layers=reuse_layers, share_heads=share_heads)
    return parts(scorer, UniformBudget(), selector)


@register(
    "chunkkv",
    family=FAMILY,
    summary="Window attention summed into chunks of 10 contiguous tokens; whole chunks kept (the same for every KV "
    "head of a layer) plus the window.",
    paper=papers.CHUNKKV,
    preset="chunk size 10 (paper default), observation window w=8 (kvtrim's SnapKV preset, no pooling), chunk "
    "score = mean token score summed over the KV heads (kvpress ChunkKVPress), no layer reuse",
)
def chunkkv(window: int = SNAPKV.window, chunk: int = 10, reuse_layers: int = 1, share_heads: bool = True) -> Pipeline:
    """ChunkKV (Liu et al., arXiv 2502.00299): chunk-granular selection; ``reuse_layers`` > 1 shares indices."""
    return _chunkkv_parts(window, chunk, reuse_layers, share_heads)


@register(
    "chunkkv_reuse",
    family=FAMILY,
    summary="ChunkKV with layer-wise index reuse: each pair of layers keeps the chunks chosen by its first layer.",
    paper=papers.CHUNKKV,
    preset="as chunkkv with reuse_layers=2 (the paper's index-reuse setting of 2 layers per group)",
)
def chunkkv_reuse(
    window: int = SNAPKV.window, chunk: int = 10, reuse_layers: int = 2, share_heads: bool = True
) -> Pipeline:
    """ChunkKV (arXiv 2502.00299) with layer-wise index reuse (layers grouped by ``reuse_layers``)."""
    return _chunkkv_parts(window, chunk, reuse_layers, share_heads)


@register(
    "kvzip",
    family=FAMILY,
    summary="Query-agnostic: the model re-reads its context after a repeat instruction; an entry scores the "
    "largest attention the reconstruction pays it; one global threshold across layers and heads (stored ragged). "
    "Costs one extra forward pass over the prompt at compression.",
    paper=papers.KVZIP,
    preset="kvpress KVzipPress defaults: prompt 'Repeat the previous context exactly.' in the chat template, 4 "
    "sinks, max over the group and the reconstruction queries, non-layerwise (global) budgets; layerwise=True "
    "gives every layer the same budget; one reconstruction pass instead of 2K-token chunks",
)
def kvzip(
    prompt: str = "Repeat the previous context exactly.",
    n_sink: int = SINKS,
    layerwise: bool = False,
    chunk: int = 256,
    tokenizer: str | None = None,
) -> Pipeline:
    """KVzip (Kim et al., arXiv 2505.23416): context-reconstruction scores, global or per-layer budgets."""
    return parts(
        ReconstructionScorer(prompt=prompt, n_sink=n_sink, chunk=chunk, tokenizer=tokenizer),
        UniformBudget() if layerwise else GlobalThresholdBudget(),
        TopKSelector(sink=n_sink),
    )


@register(
    "kvzap",
    family=FAMILY,
    summary="KVzip's scores predicted by a small learned surrogate (per layer: linear or a 2-layer MLP) from the "
    "hidden state entering attention, computed as each token arrives: no attention weights, no extra pass. Needs "
    "the `kvzap` artifact.",
    paper=papers.KVZAP,
    preset="kvpress KVzapPress defaults: MLP surrogate, top-k per KV head (layerwise), no protected tokens; "
    "layerwise=False ranks every entry of every layer together as kvzip does; the surrogate is trained by "
    "`kvtrim calibrate kvzap` on log KVzip scores (the paper: log KVzip+ scores), docs/calibration.md",
)
def kvzap(model_type: str = "mlp", layerwise: bool = True, n_sink: int = 0, artifact: str | None = None) -> Pipeline:
    """KVzap (Jegou & Jeblick, arXiv 2601.07891): a learned surrogate of KVzip's scores (Kim et al., arXiv
    2505.23416) from hidden states; per-head top-k (``layerwise``) or one global threshold."""
    if not isinstance(layerwise, bool):
        raise InvalidParameterError(f"layerwise must be True or False, got {layerwise!r}")
    if isinstance(n_sink, bool) or not isinstance(n_sink, int) or n_sink < 0:
        raise InvalidParameterError(f"n_sink must be an integer >= 0 (protected first tokens), got {n_sink!r}")
    return parts(
        HiddenStateSurrogateScorer(model_type=model_type, artifact=artifact),
        UniformBudget() if layerwise else GlobalThresholdBudget(),
        TopKSelector(sink=n_sink),
    )


@register(
    "fastkvzip",
    family=FAMILY,
    summary="KVzip's scores predicted by a learned gate per layer (a token's gate key and queries from its hidden "
    "state against 16 learned sink keys, output in (0, 1)), computed as each token arrives; 4 sinks and the last "
    "2% of the context pinned; one global threshold across layers and heads. Needs the `fastkvzip` artifact.",
    paper=papers.FASTKVZIP,
    preset="kvpress FastKVzipPress defaults: non-layerwise (global) budgets, 4 sinks, recent window 2% of the context "
    "(4096 tokens from 32k on); gate width 16 with 16 sink keys, trained by `kvtrim calibrate fastkvzip` on kvtrim's "
    "kvzip scores (docs/calibration.md)",
)
def fastkvzip(
    layerwise: bool = False,
    n_sink: int = SINKS,
    window_ratio: float = 0.02,
    window: int = 4096,
    artifact: str | None = None,
) -> Pipeline:
    """Fast KVzip (Kim, Han & Yun, arXiv 2601.17668): gates distilled from KVzip's scores (Kim et al., arXiv
    2505.23416); one global threshold (or per-head top-k with ``layerwise``)."""
    if not isinstance(layerwise, bool):
        raise InvalidParameterError(f"layerwise must be True or False, got {layerwise!r}")
    scorer = GateScorer(artifact=artifact, n_sink=n_sink, window_ratio=window_ratio, window=window)
    return parts(scorer, UniformBudget() if layerwise else GlobalThresholdBudget(), TopKSelector())


@register(
    "restorekv",
    family=FAMILY,
    summary="KVzip's eviction plus K learned restore tokens: before eviction their embeddings run once over the "
    "whole cache with a low-rank adapter on the attention projections, and the keys and values they leave are "
    "appended to every KV head, in place of K context entries of the budget. Needs the `restorekv` artifact.",
    paper=papers.RESTOREKV,
    preset="kvpress RestoreKVPress: kvzip's defaults (4 sinks, global budgets), the artifact's restore tokens (8 "
    "by default, as the authors') entered at the last context position; embeddings and a rank-8 adapter on q/k/v/o "
    "trained by `kvtrim calibrate restorekv` (self-distillation from the full cache, docs/calibration.md)",
)
def restorekv(
    prompt: str = "Repeat the previous context exactly.",
    n_sink: int = SINKS,
    layerwise: bool = False,
    chunk: int = 256,
    tokenizer: str | None = None,
    artifact: str | None = None,
) -> Pipeline:
    """RestoreKV (arXiv 2608.01247): KVzip (Kim et al., arXiv 2505.23416) plus learned restore tokens.

    1. KVzip scores every context entry by re-reading the context (:class:`ReconstructionScorer`).
    2. Before anything is evicted, the ``K`` restore embeddings are fed through the model in one pass over the
       full cache, with a LoRA (``x·Aᵀ·Bᵀ`` added to q/k/v/o projections) active for that pass only
       (:class:`RestoreTokens`); every layer gets ``K`` restore keys and values per KV head.
    3. KVzip evicts with ``K`` fewer entries per (layer, KV head) than the budget, and the restore entries are
       appended: the cache holds what was asked for.
    The embeddings and the adapter are trained by self-distillation (KL of the compressed-cache model's next-token
    distribution against the full-cache model's on continuation tokens), ``kvtrim calibrate restorekv``.
    """
    pipe = kvzip(prompt=prompt, n_sink=n_sink, layerwise=layerwise, chunk=chunk, tokenizer=tokenizer)
    pipe.append = RestoreTokens(artifact=artifact)
    return pipe


@register(
    "curdkv",
    family=FAMILY,
    summary="Key × value leverage approximated by squared norms normalized in windows of 16 positions; 4 sinks "
    "kept. Attention-free.",
    paper=papers.CURDKV,
    preset="kvpress CURPress defaults: kind kv_product, window 16, 4 sinks, no random projection",
)
def curdkv(kind: str = "kv_product", window: int = 16, n_sink: int = SINKS) -> Pipeline:
    """CurDKV (Sengupta et al., arXiv 2509.15038): value-guided leverage approximation, top-k per KV head."""
    return parts(LocalLeverageScorer(kind=kind, window=window), UniformBudget(), TopKSelector(sink=n_sink))


@register(
    "leverage",
    family=FAMILY,
    summary="Exact statistical leverage of the centred pre-RoPE keys: the keys furthest outside the span of the "
    "others are kept. Attention-free.",
    paper=papers.COMPACTOR,
    preset="Compactor's leverage component (kvpress LeverageScorePress): no protected window; exact leverage instead "
    "of the 48-column Gaussian sketch (deterministic)",
)
def leverage() -> Pipeline:
    """Leverage scores of the keys (Chari & Van Durme, Compactor, arXiv 2507.08143), top-k per KV head."""
    return parts(KeyLeverageScorer(), UniformBudget(), TopKSelector())


@register(
    "noncausal_attention",
    family=FAMILY,
    summary="Attention each entry receives from the queries of its 256-token chunk, every query seeing its whole "
    "chunk (no causal mask), × ‖v‖, smoothed over 3 slots. Query-agnostic.",
    paper=papers.COMPACTOR,
    preset="Compactor's attention component (kvpress NonCausalAttnPress): chunk 256, no protected window; logits "
    "scaled by 1/√d (scaled=False: kvpress's raw q·k)",
)
def noncausal_attention(chunk: int = 256, scaled: bool = True) -> Pipeline:
    """Non-causal chunked attention (Chari & Van Durme, Compactor, arXiv 2507.08143), top-k per KV head."""
    return parts(ChunkAttentionScorer(chunk=chunk, scaled=scaled), UniformBudget(), TopKSelector())


@register(
    "compactor",
    family=FAMILY,
    summary="Compactor: z-scored key leverage × blending plus z-scored non-causal chunk attention; the first 8 and "
    "last 4 tokens kept. Query-agnostic.",
    paper=papers.COMPACTOR,
    preset="kvpress CompactorPress defaults: 8 + 4 protected tokens, chunk 256; blending 0.35 (kvpress's value when "
    "no ratio is set; kvpress uses the ratio when it is: pass blending=RATIO); exact leverage instead of a sketch",
)
def compactor(blending: float = 0.35, chunk: int = 256, sink_start: int = 8, sink_end: int = 4) -> Pipeline:
    """Compactor (Chari & Van Durme, arXiv 2507.08143): leverage and chunked attention blended, top-k per head."""
    scorer = LeverageAttentionScorer(blending=blending, chunk=chunk, sink_start=sink_start, sink_end=sink_end)
    return parts(scorer, UniformBudget(), TopKSelector(sink=sink_start, recent=sink_end))


def _plain_method(param: str, name: str, own: str, example: str, merges: bool = False) -> Pipeline:
    """The pipeline of registry method ``name`` whose parts a wrapper method reuses: another method, built from
    plain parts (no special pipeline kind, key-channel pruning, decoding-time schedule or key re-rotation of its own;
    no merge either unless the wrapper carries it over: ``merges``)."""
    if name == own or name not in method_names():
        raise InvalidParameterError(f"{param}={name!r} must name another registry method, e.g. {example!r}")
    inner = get_method(name)
    if (
        type(inner) is not Pipeline
        or inner.channels is not None
        or inner.schedule.continuous
        or inner.rerotate is not None
        or (inner.merge is not None and not merges)
    ):
        raise InvalidParameterError(
            f"{param}={name!r} is not built from plain parts (its pipeline kind, key-channel pruning, own schedule, "
            f"merge or key re-rotation would be lost); name a method like {example!r}"
        )
    return inner


@register(
    "dms",
    family=FAMILY,
    summary="Threshold eviction: entries scoring under a threshold leave once they are older than the last 128 "
    "tokens (per-head counts, stored ragged; capped by the ratio/budget). `dms@every:N` evicts while decoding.",
    paper=papers.DMS,
    preset="kvpress DMSPress: window 128, threshold set by the user for its scorer; the scorer is a registry "
    "method's (default knorm: a per-key score, so re-scoring at each compression equals scoring once); "
    "threshold -inf keeps everything the budget allows",
)
def dms(threshold: float = -math.inf, recent: int = 128, scorer: str = "knorm") -> Pipeline:
    """DMS's eviction rule (Łańcucki et al., arXiv 2506.05345) over the scores of the registry method ``scorer``."""
    inner = _plain_method("scorer", scorer, "dms", "knorm")
    return parts(inner.scorer, ScoreThresholdBudget(threshold=threshold, recent=recent), TopKSelector(recent=recent))


@register(
    "per_layer_ratio",
    family=FAMILY,
    summary="A registry method's scorer and selector with a user-given fraction removed per layer (the request's "
    "ratio is not used when `ratios` is given).",
    paper=f"kvpress PerLayerCompressionPress (no paper of its own); default parts: {papers.SNAPKV}",
    preset="kvpress PerLayerCompressionPress: `ratios` one per layer; `base` names the method whose scorer and "
    "selector run (default snapkv); no ratios: the request's ratio for every layer",
)
def per_layer_ratio(ratios: tuple[float, ...] = (), base: str = "snapkv") -> Pipeline:
    """Per-layer compression ratios around the parts of method ``base`` (SnapKV, Li et al., arXiv 2404.14469, by
    default)."""
    inner = _plain_method("base", base, "per_layer_ratio", "snapkv")
    return parts(inner.scorer, LayerRatioBudget(ratios=tuple(ratios)), inner.selector)


@register(
    "chunked",
    family=FAMILY,
    summary="Every chunk of 1024 positions keeps its own share of the budget, chosen by the scores of another "
    "registry method (default knorm): no part of the context is emptied.",
    paper=f"{papers.FINCH}; default scorer: {papers.KNORM}",
    preset="kvpress ChunkPress: chunk 1024; `base` names the method whose scorer runs (default knorm, a per-key "
    "score, so scoring the whole cache equals kvpress's scoring chunk by chunk)",
)
def chunked(chunk: int = 1024, base: str = "knorm") -> Pipeline:
    """Chunk-wise compression (FINCH's chunking, Corallo & Papotti, TACL 2024): a quota per chunk of positions;
    the default scorer is KNorm's (Devoto et al., arXiv 2406.11430)."""
    inner = _plain_method("base", base, "chunked", "knorm")
    return parts(inner.scorer, UniformBudget(), ChunkQuotaSelector(chunk=chunk))


@register(
    "block",
    family=FAMILY,
    summary="The context compressed block by block in one pass: the entries kept so far and the next 128 are "
    "scored together by another registry method's scorer (default keydiff) and the best keep their place.",
    paper=papers.BLOCK,
    preset="kvpress BlockPress: block 128; `base` names the method whose scorer runs (default keydiff, the paper's "
    "method); the first `budget` entries start the kept set; an attention scorer's window stays the prompt's last "
    "queries (kvpress: each step's last tokens)",
)
def block(block: int = 128, base: str = "keydiff") -> Pipeline:
    """Block-wise compression (KeyDiff's block prompt processing, Park et al., arXiv 2504.15364) over the scorer
    of the registry method ``base``."""
    inner = _plain_method("base", base, "block", "keydiff")
    if type(inner.scorer).prepare is not Scorer.prepare:
        raise InvalidParameterError(
            f"base={base!r} scores with quantities computed over the whole cache, which a block of candidates "
            "cannot reuse; name a method that scores one layer's entries, e.g. 'keydiff'"
        )
    return parts(inner.scorer, UniformBudget(), BlockIterativeSelector(scorer=inner.scorer, block=block))


@register(
    "simlayerkv",
    family=FAMILY,
    summary="Lazy layers: a layer whose last query pays more than 0.9 of its attention to the first 4 and last "
    "1024 tokens keeps only those; the others keep the request (all of it at ratio 0). Decided per row.",
    paper=papers.SIMLAYERKV,
    preset="threshold 0.9 (the paper's value for Llama-3; 0.65 Llama-2, 0.8 Mistral, 0.85 Qwen), 4 initial and "
    "1024 recent tokens, the last query only (kvpress's n_last=1); a lazy layer keeps 1024 recent tokens (kvpress: "
    "1024 − n_last)",
)
def simlayerkv(threshold: float = 0.9, n_initial: int = SINKS, n_recent: int = 1024, n_last: int = 1) -> Pipeline:
    """SimLayerKV (Zhang et al., arXiv 2410.13846): lazy layers keep their initial and recent tokens."""
    if isinstance(n_last, bool) or not isinstance(n_last, int) or n_last < 1:
        raise InvalidParameterError(f"n_last must be an integer >= 1 (last queries read), got {n_last!r}")
    scorer = WindowAttentionScorer(window=n_last, kernel=1, pooling="none", aggregate="mean", group_reduce="mean")
    budget = LazyLayerBudget(threshold=threshold, n_initial=n_initial, n_recent=n_recent)
    return parts(scorer, budget, TopKSelector(sink=n_initial, recent=n_recent))


@register(
    "capkv",
    family=FAMILY,
    summary="Leverage of the values weighted by exp(5·cos(key, query anchor)): entries a future query attends "
    "and whose value adds a direction the others lack; the anchor is the mean prompt query moved 512 positions "
    "ahead; 4 sinks kept. Query-agnostic.",
    paper=papers.CAPKV,
    preset="kvpress CapPress defaults: τ=5, 512 future positions, 4 sinks, ε=1e-6, keys and anchor unit-normalized, "
    "weights max-shifted, u_i = v_i",
)
def capkv(tau: float = 5.0, n_future: int = 512, n_sink: int = SINKS, eps: float = 1e-6) -> Pipeline:
    """CapKV (arXiv 2604.25975): capacity-aware eviction by query-weighted value leverage, top-k per KV head."""
    scorer = CapacityScorer(tau=tau, n_future=n_future, n_sink=n_sink, eps=eps)
    return parts(scorer, UniformBudget(), TopKSelector(sink=n_sink))


@register(
    "finch",
    family=FAMILY,
    summary="Attention the prompt's question pays to the context, each question token's row weighted by the "
    "number of entries it sees; the question's own entries kept. Needs the question in the prompt "
    "(question-aware) or `window=N`.",
    paper=papers.FINCH_PROMPT,
    preset="kvpress FinchPress defaults: the window is the question (kvpress: the tokens after a delimiter token), "
    "normalized scores, no chunks (`chunk=N`: each chunk of N positions keeps its share); no key re-rotation "
    "(kvtrim keeps true positions); question at most 1024 tokens (`max_question`)",
)
def finch(
    window: int | None = None, max_question: int = 1024, normalize: bool = True, chunk: int | None = None
) -> Pipeline:
    """FINCH (Corallo & Papotti, TACL 2024, doi 10.1162/tacl_a_00716, arXiv 2408.00167): prompt-guided selection
    by the question's attention, over the whole context or chunk by chunk."""
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise InvalidParameterError(f"chunk must be None (no chunks) or an integer >= 1, got {chunk!r}")
    scorer = QuestionAttentionScorer(window=window, max_question=max_question, normalize=normalize)
    selector = TopKSelector() if chunk is None else ChunkQuotaSelector(chunk=chunk)
    return parts(scorer, UniformBudget(), selector)


@register(
    "entropy_chunkkv",
    family=FAMILY,
    summary="ChunkKV with an entropy gate: a chunk of 10 whose window-attention score is high but rests on a few "
    "tokens (entropy under the median) keeps only its 4 best tokens, the freed budget buys further chunks; "
    "exactly the budget kept, the same positions for every KV head of a layer, plus the window.",
    paper=papers.CHUNKKV,
    preset="kvpress EntropyGatedChunkKVPress defaults: chunk 10, 4 tokens per spiky chunk, medians of the chunk "
    "scores and entropies as thresholds; ChunkKV's scorer as `chunkkv` (window w=8, no pooling), the window kept",
)
def entropy_chunkkv(window: int = SNAPKV.window, chunk: int = 10, spiky_keep: int = 4) -> Pipeline:
    """Entropy-gated ChunkKV (kvpress's extension of ChunkKV, Liu et al., arXiv 2502.00299): spiky chunks keep
    their best tokens only."""
    scorer = WindowAttentionScorer(window=window, kernel=1, pooling="none", aggregate="mean", group_reduce="mean")
    selector = EntropyGatedChunkSelector(chunk=chunk, spiky_keep=spiky_keep, recent=window)
    return parts(scorer, UniformBudget(), selector)


@register(
    "kvcompose",
    family=FAMILY,
    summary="The model re-reads its prompt; an entry scores the largest attention the re-read pays it plus its "
    "layer's head mean; each KV head keeps its own best entries, the same number in every head of a layer "
    "(composite tokens), the numbers set across layers at once. Query-agnostic. Costs one extra forward pass.",
    paper=papers.KVCOMPOSE,
    preset="kvpress KVComposePress defaults without task prompts: the context re-read as it is, max over the "
    "re-read queries, head mean added, structured (one count per layer), the first layer's composite scores "
    "raised to the largest layer's, at least 1 entry per layer; max over the GQA group (kvpress: mean)",
)
def kvcompose(
    structured: bool = True, head_mean: bool = True, first_layer_max: bool = True, chunk: int = 256
) -> Pipeline:
    """KVCompose (Akulov et al., arXiv 2509.05165): attention-guided composite tokens with layer budgets allocated
    globally; ``structured=False`` lets every (layer, head) keep its own count (stored ragged)."""
    if not isinstance(structured, bool):
        raise InvalidParameterError(f"structured must be True or False, got {structured!r}")
    scorer = RereadAttentionScorer(chunk=chunk, head_mean=head_mean)
    budget = CompositeLayerBudget(first_layer_max=first_layer_max) if structured else GlobalThresholdBudget()
    return parts(scorer, budget, TopKSelector())


@register(
    "merging",
    family=FAMILY,
    summary="Another registry method's selection (default knorm), and every evicted value folded into the kept "
    "entry of its head whose key is most similar (cosine), weighted by similarity and value norm; keys unchanged, "
    "the evicted entries freed.",
    paper=papers.MERGING,
    preset="kvpress MergingPress defaults: similarity threshold 0, every candidate merged (fraction 1); `base` "
    "names the method whose scorer, budget and selector run (default knorm)",
)
def merging(base: str = "knorm", threshold: float = 0.0, fraction: float = 1.0) -> Pipeline:
    """Merge on evict (kvpress MergingPress, after D2O, Wan et al., arXiv 2406.13035) around the parts of the
    registry method ``base`` (KNorm's by default)."""
    inner = _plain_method("base", base, "merging", "knorm")
    return parts(
        inner.scorer, inner.budget, inner.selector, merge=NearestKeyMerge(threshold=threshold, fraction=fraction)
    )


@register(
    "cam",
    family=FAMILY,
    summary="Cache merging: another registry method's selection (default h2o), and each evicted value added, "
    "divided by 32, to the 32 kept entries of its head that follow it, when a draw with probability "
    "min(1, its accumulated attention / their mean) says so; keys unchanged, the evicted entries freed. "
    "`cam@every:N` merges while decoding.",
    paper=papers.CAM,
    preset="kvpress CAMPress defaults: merge window 32; `base` names the method whose scorer, budget and selector "
    "run (default h2o: the accumulated attention CaM's paper evicts by); seeded draws (seed 0); every evicted entry "
    "is a merge candidate, per KV head; attention accumulated over the prompt and, with a schedule, the decoded "
    "tokens",
)
def cam(base: str = "h2o", window: int = 32, seed: int = 0) -> Pipeline:
    """CaM (Zhang et al., ICML 2024, openreview LCTmppB165): cache merging around the parts of the registry method
    ``base`` (H2O's accumulated attention, Zhang et al., arXiv 2306.14048, by default)."""
    inner = _plain_method("base", base, "cam", "h2o")
    return parts(inner.scorer, inner.budget, inner.selector, merge=NeighbourMerge(window=window, seed=seed))


@register(
    "key_rerotation",
    family=FAMILY,
    summary="Another registry method's selection (default snapkv), then the kept keys rotated to contiguous "
    "positions, as if the evicted tokens had never been there (the relative distances change).",
    paper=papers.KEY_REROTATION,
    preset="kvpress KeyRerotationPress: `base` names the method whose scorer, budget, selector and merge run "
    "(default snapkv, kvtrim's settings); the kept entries of a head are packed to end where the context ends "
    "(kvpress: 0 … n−1 with decoding at n, the same attention); per-head counts allowed",
)
def key_rerotation(base: str = "snapkv") -> Pipeline:
    """Key re-rotation (kvpress KeyRerotationPress; FINCH, Corallo & Papotti, TACL 2024, arXiv 2408.00167, and
    StreamingLLM's rolling cache, Xiao et al., arXiv 2309.17453) around the parts of the registry method ``base``
    (SnapKV's, Li et al., arXiv 2404.14469, by default)."""
    inner = _plain_method("base", base, "key_rerotation", "snapkv", merges=True)
    return parts(inner.scorer, inner.budget, inner.selector, merge=inner.merge, rerotate=KeyRerotation())


@register(
    "kvgrad",
    family=FAMILY,
    summary="Query-agnostic: KVzip's context reconstruction with a backward pass; an entry scores its largest "
    "attention from a reconstruction token × ‖v·W_O‖ × the gradient norm of Σ‖h_last‖² at that token's attention "
    "output; one global threshold across layers and heads (stored ragged). Costs a forward and a backward pass.",
    paper=papers.KVGRAD,
    preset="kvpress KVgradPress defaults: KVzip's repeat prompt in the chat template, 4 sinks, Φ = Σ‖h‖² of the last "
    "decoder layer, max over the group and the reconstruction queries, non-layerwise (global) budgets; one "
    "reconstruction pass instead of 512-token chunks",
)
def kvgrad(
    prompt: str = "Repeat the previous context exactly.",
    n_sink: int = SINKS,
    layerwise: bool = False,
    tokenizer: str | None = None,
) -> Pipeline:
    """KVgrad (kvpress KVgradPress, openreview cg1wTCJjjk): KVzip's reconstruction (Kim et al., arXiv 2505.23416)
    scored by input × gradient attribution."""
    return parts(
        GradientAttributionScorer(prompt=prompt, n_sink=n_sink, tokenizer=tokenizer),
        UniformBudget() if layerwise else GlobalThresholdBudget(),
        TopKSelector(sink=n_sink),
    )
