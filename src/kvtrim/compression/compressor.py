"""Running a pipeline over a cache: score every layer, allocate budgets, select, compact."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..budgets.base import BudgetRequest
from ..cache.channel_pruned import ChannelPrunedStore
from ..cache.quantized_ragged import QuantizedRaggedStore
from ..cache.ragged import RaggedStore
from ..errors import InvalidParameterError
from ..scoring.base import LayerView

if TYPE_CHECKING:
    from .pipeline import Pipeline
    from .target import CompressibleCache


@dataclass(frozen=True)
class BudgetSpec:
    """How much to keep: ``ratio`` (fraction of entries removed, in [0, 1)) or ``budget`` (entries kept per
    layer and KV head, > 0). Exactly one is set. A budget at or above the context length keeps everything."""

    ratio: float | None = None
    budget: int | None = None

    def __post_init__(self) -> None:
        if (self.ratio is None) == (self.budget is None):
            raise InvalidParameterError("give exactly one of ratio (fraction removed, in [0, 1)) or budget (> 0)")
        if self.ratio is not None:
            if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or math.isnan(self.ratio):
                raise InvalidParameterError(f"ratio must be a number in [0, 1), got {self.ratio!r}")
            if not 0.0 <= float(self.ratio) < 1.0:
                raise InvalidParameterError(f"ratio must be in [0, 1) (fraction of entries removed), got {self.ratio}")
        if self.budget is not None:
            if isinstance(self.budget, bool) or not isinstance(self.budget, int):
                raise InvalidParameterError(f"budget must be a positive integer, got {self.budget!r}")
            if self.budget <= 0:
                raise InvalidParameterError(
                    f"budget must be a positive integer (entries kept per layer and KV head), got {self.budget}"
                )

    def keep_count(self, context_length: int) -> int:
        """Entries to keep per layer and KV head for a row of ``context_length`` tokens."""
        if self.budget is not None:
            return min(self.budget, context_length)
        return max(1, min(context_length, int(round(context_length * (1.0 - float(self.ratio)), 6))))

    def describe(self) -> dict:
        return {"ratio": self.ratio, "budget": self.budget}


@dataclass
class CompressionReport:
    """What one compression did."""

    method: str
    context_lengths: list[int]
    keep: list[int]
    budgets: torch.Tensor | None  # [batch, layers, kv_heads]
    entries_before: int
    entries_after: int
    seconds: float
    skipped: bool = False
    metadata: dict = field(default_factory=dict)


def layer_views(
    cache: CompressibleCache,
    context: torch.Tensor,
    accumulate: tuple[str, ...] = (),
    logits: torch.Tensor | None = None,
    shared: dict | None = None,
) -> list[LayerView]:
    """What scorers see of every dense layer of ``cache`` (``context`` ``[batch]`` tokens seen per row); the
    views share one ``shared`` dict for cross-layer quantities."""
    shared = {} if shared is None else shared
    return [
        LayerView(
            layer_idx=layer.layer_idx,
            num_layers=len(cache.layers),
            keys=layer.store.keys,
            values=layer.store.values,
            positions=layer.store.positions,
            context_lengths=context,
            observation=layer.observation,
            stats={name: layer.store.stat(name) for name in accumulate},
            module=layer.module,
            scaling=float(getattr(layer.module, "scaling", layer.store.keys.shape[-1] ** -0.5)),
            logits=logits,
            compressed_until=layer.compressed_until,
            prompt_logprobs=cache.prompt_logprobs,
            prompt_ids=cache.prompt_ids,
            question_start=cache.question_start,
            shared=shared,
            replay=cache.replay,
        )
        for layer in cache.kv_layers
    ]


def compress_cache(
    cache: CompressibleCache, pipeline: Pipeline, spec: BudgetSpec, logits: torch.Tensor | None = None
) -> CompressionReport:
    """Compress every layer of ``cache`` in place with ``pipeline`` under ``spec``."""
    start = time.perf_counter()
    layers = cache.kv_layers
    if not layers:
        raise InvalidParameterError("the cache is empty: prefill a context before compressing")
    for layer in layers:  # re-compressing a ragged layer: score it through a padded dense copy
        if not layer.store.rescorable:
            raise InvalidParameterError(
                f"layer {layer.layer_idx} holds channel-pruned keys (ThinK): they cannot be scored again; "
                "compress a fresh cache instead"
            )
        layer.store = layer.store.to_dense()
        if pipeline.merge is not None and getattr(layer.store, "kv_quant", None) is not None:
            raise InvalidParameterError(
                f"method {pipeline.name!r} merges evicted values into kept entries, which quantized entries (kv_quant="
                f"{layer.store.kv_quant.name!r}) do not support yet; use kv_quant=None with it"
            )
        if pipeline.rerotate is not None and getattr(layer.store, "kv_quant", None) is not None:
            raise InvalidParameterError(
                f"method {pipeline.name!r} re-rotates kept keys, which quantized entries (kv_quant="
                f"{layer.store.kv_quant.name!r}) do not support yet; use kv_quant=None with it"
            )
    first = layers[0].store
    context = (first.positions.amax(dim=(1, 2)) + 1).clamp(min=0)  # [batch]
    keep = torch.tensor([spec.keep_count(int(t)) for t in context.tolist()], device=context.device)
    before = sum(layer.store.entries() for layer in layers)
    report = CompressionReport(
        method=pipeline.name,
        context_lengths=context.tolist(),
        keep=keep.tolist(),
        budgets=None,
        entries_before=before,
        entries_after=before,
        seconds=0.0,
    )
    if not pipeline.budget.keeps_below_request and bool((keep >= context).all()):
        report.skipped = True
        report.seconds = time.perf_counter() - start
        return report

    # "entry_format": how the scored entries are held (a KVQuant spec, None for the model's dtype); scores that
    # depend on the stored keys and are reused across compressions of one prefill must not cross formats
    quant = getattr(cache, "kv_quant", None)
    shared: dict = {"keep": keep, "entry_format": None if quant is None else quant.spec}
    views = layer_views(cache, context, pipeline.observation.slot_stats, logits, shared)
    pipeline.scorer.prepare(views)
    # Entries appended after eviction (RestoreKV's restore tokens) are computed over the whole cache now and take
    # their share of every (layer, KV head)'s budget.
    reserved = pipeline.append.reserve(views) if pipeline.append is not None else 0
    # Accumulated per-slot statistics live in dense stores only: a schedule that keeps accumulating after this
    # compression needs the padded dense layout.
    keep_dense = bool(pipeline.observation.slot_stats) and pipeline.schedule.continuous
    scores = []
    for view in views:
        s = pipeline.scorer.score(view).float()
        scores.append(s.masked_fill(~view.valid, float("-inf")))
        # This layer's scoring intermediates (window attention, [batch, q_heads, window, seq] in fp32, larger than
        # the layer's K/V) go before the next layer is scored; a selector that needs them again recomputes them.
        view.release_intermediates()
    request = BudgetRequest(
        keep=(keep - reserved).clamp(min=1) if reserved else keep,
        context_lengths=context,
        num_layers=len(views),
        kv_heads=views[0].kv_heads,
        positions=[v.positions for v in views],
        ratio=None if spec.ratio is None else float(spec.ratio),
        compressed_until=[v.compressed_until for v in views],
    )
    budgets = pipeline.budget.allocate(request, scores)
    budgets = torch.minimum(budgets, context.view(-1, 1, 1))
    del request
    # Layer by layer: gather the kept entries of one layer, then drop every reference to its old buffers (the
    # store's and the view's) before the next, so the peak is one layer's K/V above the cache, never a second cache.
    for i, layer in enumerate(layers):
        view, s = views[i], scores[i]
        views[i] = scores[i] = None
        sel = pipeline.selector.select(view, s, budgets[:, view.layer_idx])
        if reserved:  # appended to the uncompacted store and kept, so the compacted one holds no append slack
            sel = pipeline.append.append_to(view, layer.store, sel)
        if pipeline.merge is not None:  # the kept entries take their merged values before the evicted ones go
            layer.store.replace_values(pipeline.merge.merge(view, sel))
        if pipeline.rerotate is not None:  # the kept keys move to contiguous positions before the others go
            layer.store.replace_keys(*pipeline.rerotate.rerotate(view, sel))
        counts = sel.keep_mask.sum(-1)
        uniform = bool((counts == counts.max()).all())
        if sel.compressed_until is not None:
            layer.compressed_until = sel.compressed_until
        if keep_dense or pipeline.stores_dense(uniform):
            layer.store.keep(sel.indices, sel.keep_mask)
        elif getattr(layer.store, "kv_quant", None) is not None:  # per-head counts of quantized entries
            layer.store = QuantizedRaggedStore.from_selection(layer.store, sel.indices, sel.keep_mask)
        else:  # a different number of entries per head: store exactly that many
            layer.store = RaggedStore.from_selection(layer.store, sel.indices, sel.keep_mask)
        if pipeline.channels is not None:  # ThinK: the kept keys lose channels too
            kept = pipeline.channels.select(view, sel, spec.ratio)
            layer.store = ChannelPrunedStore.prune(layer.store, kept)
        del view, s, sel
    report.budgets = budgets + reserved if reserved else budgets  # what each (layer, KV head) holds now
    if pipeline.channels is not None:
        store = layers[0].store
        report.metadata["key_channels_kept"] = store.kept_channels
        report.metadata["key_head_dim"] = store.head_dim
    for part in pipeline.parts:
        report.metadata.update(part.describe_compression(shared))
    report.entries_after = sum(layer.store.entries() for layer in layers)
    report.seconds = time.perf_counter() - start
    return report
