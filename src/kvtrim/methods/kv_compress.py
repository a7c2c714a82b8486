"""KV-Compress: squared-attention metric, blocks ranked across all layers and heads (per-head rates)."""

from __future__ import annotations

from ..budgets.global_blocks import GlobalBlockBudget
from ..compression.pipeline import Pipeline
from ..scoring.observation import ObservationSpec
from ..scoring.squared_attention import SquaredAttentionScorer
from ..selection.topk import TopKSelector
from . import papers
from .presets import KV_COMPRESS
from .registry import parts, register

FAMILY = "KV-Compress"

KVC_W32, KVC_W8, KVC_FULL = KV_COMPRESS["kvcompress"], KV_COMPRESS["kvc_w8"], KV_COMPRESS["kvc_full"]


class _SquaredAttentionPipeline(Pipeline):
    """A pipeline whose continuous schedules also accumulate decoding queries' squared attention per entry."""

    @property
    def observation(self) -> ObservationSpec:
        spec = self.scorer.observation
        if self.schedule.continuous:
            spec = spec.merge(ObservationSpec(accumulate=("attn_sq_sum",), chunk=spec.chunk))
        return spec


def _kvcompress_parts(
    window: int | None,
    protected_window: int,
    kernel: int,
    buffer: int,
    block_size: int,
    even_layer_evict: bool,
    head_groups: int,
) -> Pipeline:
    budget = GlobalBlockBudget(
        block_size=block_size, protected_window=protected_window, even_layers=even_layer_evict, head_groups=head_groups
    )
    return parts(
        SquaredAttentionScorer(window=window, kernel=kernel, buffer=buffer),
        budget,
        TopKSelector(recent=protected_window),
        kind=_SquaredAttentionPipeline,
    )


@register(
    "kvcompress",
    family=FAMILY,
    summary="Squared attention of the last w queries (max-pooled), blocks ranked across all layers and heads.",
    paper=papers.KV_COMPRESS,
    preset="KVC-w with w=32: L2-sum metric, max-pool k=7 per query head then sum over the group, protected window "
    "32, block size 16, budget M = per-head mean incl. the window rounded up to whole blocks; with a continuous "
    "schedule (kvcompress@every:64) decoding queries' squared attention is added to the metric; "
    "even_layer_evict=True ranks blocks within each layer (the authors' --even-layer-evict; runs in vLLM)",
)
def kvcompress(
    window: int = KVC_W32.window,
    protected_window: int = KVC_W32.protected_window,
    kernel: int = KVC_W32.kernel,
    buffer: int = KVC_W32.buffer,
    block_size: int = KVC_W32.block_size,
    even_layer_evict: bool = KVC_W32.even_layer_evict,
    head_groups: int = 1,
) -> Pipeline:
    """KV-Compress (Rehg, arXiv 2410.00161), KVC-w: variable compression rates per layer and KV head.

    The paged engine (:mod:`kvtrim.serve`) runs the same ranking on real paged storage; here the kept entries are
    stored ragged. Continual compression: use a schedule (``kvcompress@every:64``).

    ``even_layer_evict=True`` is the flag ``--even-layer-evict`` of the paper's code (vllm-kvcompress): blocks are
    ranked within each layer, so every layer keeps the same ``⌈M·kv_heads/block_size⌉`` blocks while its heads
    still keep different counts (rates vary per head, not per layer). Each layer's total is then fixed before
    scoring, which is what lets the method run inside vLLM (:mod:`kvtrim.vllm`); the paged engine
    (``kvtrim serve``) always ranks across layers.

    ``head_groups > 1`` ranks equal groups of consecutive KV heads separately, each down to its own heads' blocks
    (what tensor-parallel ranks can do, each holding one slice of the heads; the vLLM plugin with
    ``tensor_parallel_size`` needs a multiple of the rank count).
    """
    return _kvcompress_parts(window, protected_window, kernel, buffer, block_size, even_layer_evict, head_groups)


@register(
    "kvc_w8",
    family=FAMILY,
    summary="KV-Compress with an 8-query observation window and an 8-token protected window.",
    paper=papers.KV_COMPRESS,
    preset="KVC-w with w=8 (the authors' LongBench scripts): protected window 8, max-pool k=7, block size 16",
)
def kvc_w8(
    window: int = KVC_W8.window,
    protected_window: int = KVC_W8.protected_window,
    kernel: int = KVC_W8.kernel,
    buffer: int = KVC_W8.buffer,
    block_size: int = KVC_W8.block_size,
    even_layer_evict: bool = KVC_W8.even_layer_evict,
    head_groups: int = 1,
) -> Pipeline:
    """KV-Compress (Rehg, arXiv 2410.00161), the KVC-w preset with w = 8.

    ``even_layer_evict=True``: the paper's code flag ``--even-layer-evict``, blocks ranked within each layer (see
    :func:`kvcompress`); ``head_groups`` as there.
    """
    return _kvcompress_parts(window, protected_window, kernel, buffer, block_size, even_layer_evict, head_groups)


@register(
    "kvc_full",
    family=FAMILY,
    summary="KV-Compress with squared attention summed over every prompt query (10 nearest keys excluded), no pooling.",
    paper=papers.KV_COMPRESS,
    preset="KVC-full: all prompt queries, v=10 nearest keys excluded per query, no max-pool, protected window 32, "
    "block size 16",
)
def kvc_full(
    protected_window: int = KVC_FULL.protected_window,
    buffer: int = KVC_FULL.buffer,
    kernel: int = KVC_FULL.kernel,
    block_size: int = KVC_FULL.block_size,
    even_layer_evict: bool = KVC_FULL.even_layer_evict,
    head_groups: int = 1,
) -> Pipeline:
    """KV-Compress (Rehg, arXiv 2410.00161), the KVC-full preset (metric over all prompt queries).

    ``even_layer_evict=True``: the paper's code flag ``--even-layer-evict``, blocks ranked within each layer (see
    :func:`kvcompress`); ``head_groups`` as there.
    """
    return _kvcompress_parts(
        KVC_FULL.window, protected_window, kernel, buffer, block_size, even_layer_evict, head_groups
    )
