"""Scoring, selecting and compacting one request's prompt entries in one layer of vLLM's paged cache.

The method scores the entries as attention sees them (an fp8 cache: ``code · k_scale`` / ``code · v_scale``,
:class:`~kvtrim.vllm.kv_layout.EntryFormat`); compaction moves the stored elements (fp8 bytes) unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..budgets.base import BudgetRequest
from ..compression.pipeline import Pipeline
from ..scoring.base import LayerView
from ..scoring.observation import LayerObservation
from ..scoring.squared_attention import squared_attention
from .folded_attention import folded_cache_write
from .kv_layout import BlockLayout
from .subpages import RequestSubPages


@dataclass(frozen=True)
class PendingEviction:
    """A request whose prompt finishes prefilling in the current step.

    Attributes:
        req_id: vLLM request id
        query_start, query_end: its rows in the step's flattened query tensor
        prompt_len: prompt tokens, all in the cache after this step (slots ``0 … prompt_len-1``)
        keep: slots the request keeps (the largest layer's count: it sizes the block list)
        blocks: ``[num_blocks]`` the request's block ids (group 0), in order
        layer_keep: ``[num_layers]`` entries each layer keeps per KV head (PyramidKV's schedule; None: every
            layer keeps ``keep``)
        head_budget: per-head methods: the mean entries per KV head ``B`` (each layer keeps ``kv_heads · B``
            in total); ``keep`` is then the request's slot count ``min(B + block_size − 1, prompt_len)``
        pages: per-head methods: the request's one-head sub-pages (of its first ``⌈keep/block_size⌉`` blocks)
        head_counts: ``[num_layers, kv_heads]`` per-head counts fixed before scoring (HeadKV), or None
        logical_len: tokens the request has seen after this step (0: ``prompt_len``, nothing compressed before)
        positions: ``[num_layers, kv_heads, k0]`` logical positions of the entries an earlier round kept in slots
            ``0 … k0−1`` (the slots after them hold the last ``prompt_len − k0`` tokens, in order), or None: slot
            ``i`` holds token ``i``
        observed: the window queries come from the worker's record of the request's recent queries (decoding
            rounds), not from this step's rows alone
        compressed_until: LagKV's family: the first logical position not compressed yet (earlier rounds'
            partitions are never scored again), or None: the sink size, nothing compressed before
        layer_total: per-head methods: most entries a layer keeps over its heads, which the block list was sized
            for (:meth:`~kvtrim.vllm.config.VLLMEvictionConfig.layer_total`); 0: ``kv_heads · head_budget``
        head_positions: per-head rounds after the first: the entries are read from ``pages`` (each head its own
            count); ``[layer][head]`` the logical positions of the entries the last round kept, which the head's
            sub-pages hold first, followed by the tokens since, in order. None: the entries lie in vLLM's uniform
            slots ``0 … prompt_len−1``
        head_metrics: KV-Compress's decoding-time metric (``@every:N``) at a round after the first: ``[layer][head]``
            the running metric of the entries the last round kept (in ``head_positions``' order), to which the
            squared attention of every query since that round is added (the step's rows between prefill chunks,
            the recorded ones while decoding: ``observed``), or None
        kept_metrics: filled with ``{layer: [head] metric of the kept entries}`` (the next round's ``head_metrics``)
            when a dict
    """

    req_id: str
    query_start: int
    query_end: int
    prompt_len: int
    keep: int
    blocks: torch.Tensor
    layer_keep: tuple[int, ...] | None = None
    head_budget: int = 0
    pages: RequestSubPages | None = None
    head_counts: np.ndarray | None = None
    logical_len: int = 0
    positions: torch.Tensor | None = None
    observed: bool = False
    compressed_until: int | None = None
    layer_total: int = 0
    head_positions: list[list[torch.Tensor]] | None = None
    head_metrics: list[list[torch.Tensor]] | None = None
    kept_metrics: dict | None = None

    def key_positions(self, layer_idx: int, kv_heads: int, device) -> torch.Tensor:
        """``[kv_heads, prompt_len]`` logical positions of the request's entries in this layer."""
        p, end = self.prompt_len, self.logical_len or self.prompt_len
        if self.positions is None:
            return torch.arange(end - p, end, device=device).view(1, p).expand(kv_heads, p)
        return _kept_then_fresh(self.positions[layer_idx].to(device), p, end)


def _kept_then_fresh(kept: torch.Tensor, count: int, end: int) -> torch.Tensor:
    """Logical positions of ``count`` entries per row: the ``[..., k]`` kept ones of an earlier round, then the
    tokens since, up to ``end``, in order; ``[..., count]``."""
    fresh = torch.arange(end - (count - kept.shape[-1]), end, device=kept.device)
    return torch.cat([kept, fresh.expand(*kept.shape[:-1], -1)], dim=-1)


def _subpaged_entries(
    layout: BlockLayout, kv_cache: torch.Tensor, pending: PendingEviction, layer_idx: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A per-head request's entries in this layer read from its one-head sub-pages, padded to the longest head:
    keys and values ``[width, kv_heads, d]`` as stored, logical positions ``[kv_heads, width]`` (``-1``: padding)."""
    pages, end = pending.pages, pending.logical_len
    lengths = torch.from_numpy(pages.lengths[layer_idx])
    kv_heads, width = lengths.numel(), int(lengths.max())
    slots = np.concatenate([pages.slots(layer_idx, h) for h in range(kv_heads)])
    k, v = layout.one_head().read_slots(kv_cache, torch.from_numpy(slots))  # [Σ lengths, 1, d], one gather
    head = torch.repeat_interleave(torch.arange(kv_heads), lengths).to(kv_cache.device)
    row = (torch.arange(lengths.sum()) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)).to(head.device)
    keys = k.new_zeros(width, kv_heads, k.shape[-1])
    values = v.new_zeros(width, kv_heads, v.shape[-1])
    keys[row, head], values[row, head] = k[:, 0], v[:, 0]
    positions = torch.full((kv_heads, width), -1, dtype=torch.long, device=kv_cache.device)
    for h in range(kv_heads):
        n = int(lengths[h])
        positions[h, :n] = _kept_then_fresh(pending.head_positions[layer_idx][h].to(kv_cache.device), n, end)
    return keys, values, positions


def _score_and_select(
    pipeline: Pipeline,
    layout: BlockLayout,
    kv_cache: torch.Tensor,
    query: torch.Tensor,
    pending: PendingEviction,
    layer_idx: int,
    num_layers: int,
    scaling: float,
    ratio: float | None,
    keep: int,
    module=None,
    budgets: torch.Tensor | None = None,
    scales: tuple[float, float] = (1.0, 1.0),
    score_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
):
    """Read the request's prompt in this layer, score it and select; ``(keys, values, selection, kept, positions,
    scores)``.

    ``keys``/``values``: ``[p, kv_heads, d]`` as stored (fp8: codes); ``kept``: ``[kv_heads]`` entries each head
    keeps; ``positions`` ``[kv_heads, p]`` their logical positions; ``scores`` ``[kv_heads, p]`` what the budget and
    selector ranked. ``budgets`` ``[kv_heads]``: counts fixed in advance (HeadKV) instead of the allocator's.
    ``scales``: the layer's ``(k_scale, v_scale)`` of an fp8 cache (the scorer sees ``code · scale``).
    ``score_reduce``: applied to the scorer's ``[1, kv_heads, p]`` scores before the budget (the mean over
    tensor-parallel ranks of a scorer that averages over a layer's KV heads, e.g. TOVA's, whose rank sees only its
    own heads).
    """
    p = pending.prompt_len
    end = pending.logical_len or p
    if pending.head_positions is not None:
        stored_keys, stored_values, key_positions = _subpaged_entries(layout, kv_cache, pending, layer_idx)
    else:
        stored_keys, stored_values = layout.read(kv_cache, pending.blocks, p)  # [p, kv_heads, d]
        key_positions = pending.key_positions(layer_idx, stored_keys.shape[1], stored_keys.device)
    keys = layout.entry.decode(stored_keys, scales[0], query.dtype)
    values = layout.entry.decode(stored_values, scales[1], query.dtype)
    kv_heads = keys.shape[1]
    device = keys.device
    window = pipeline.observation.window
    q = query if pending.observed else query[pending.query_start : pending.query_end]
    since = q  # KV-Compress's decoding-time metric: every query since the last round (its last rows)
    q = q[max(q.shape[0] - window, 0) :] if window > 0 else q[:0]
    qpos = torch.arange(end - q.shape[0], end, device=device).view(1, -1)
    positions = key_positions.unsqueeze(0)  # [1, kv_heads, p]
    done = None if pending.compressed_until is None else torch.tensor([pending.compressed_until], device=device)
    view = LayerView(
        layer_idx=layer_idx,
        num_layers=num_layers,
        keys=keys.transpose(0, 1).unsqueeze(0),
        values=values.transpose(0, 1).unsqueeze(0),
        positions=positions,
        context_lengths=torch.tensor([end], device=device),
        observation=LayerObservation(
            queries=q.transpose(0, 1).unsqueeze(0).to(keys.dtype) if window > 0 else None,
            positions=qpos if window > 0 else None,
        ),
        stats={},
        module=module,
        scaling=scaling,
        compressed_until=done,
    )
    if pending.head_metrics is None:
        scores = pipeline.scorer.score(view).float()
    else:
        scores = _running_metric(view, pending.head_metrics[layer_idx], since.to(keys.dtype), end)
    if score_reduce is not None:
        scores = score_reduce(scores)
    scores = scores.masked_fill(~view.valid, float("-inf"))  # padded heads' slots
    request = BudgetRequest(
        keep=torch.tensor([keep], device=device),
        context_lengths=view.context_lengths,
        num_layers=1,
        kv_heads=kv_heads,
        positions=[positions],
        ratio=ratio,
        compressed_until=[done],
    )
    # One layer at a time: PyramidBudget with num_layers=1 returns ``keep`` (this layer's pyramid count);
    # HeadAdaptiveBudget splits ``kv_heads · keep`` among this layer's heads.
    if budgets is None:
        budgets = pipeline.budget.allocate(request, [scores])[:, 0]  # [1, kv_heads]
    else:
        budgets = budgets.to(device).view(1, kv_heads)
    selection = pipeline.selector.select(view, scores, budgets)
    return stored_keys, stored_values, selection, selection.keep_mask[0].sum(-1), key_positions, scores[0]


def _running_metric(view: LayerView, kept: list[torch.Tensor], queries: torch.Tensor, end: int) -> torch.Tensor:
    """KV-Compress's metric at a round after the first, ``[1, kv_heads, width]``: each head's kept entries carry the
    metric of the last round (``kept[h]``, in slot order), the tokens since start at 0, and the query of every
    token since (the last ``n`` rows of ``queries`` ``[rows, q_heads, d]``, ``n`` = the tokens each head holds
    past its kept ones, up to position ``end``) adds its squared attention over the entries it saw, summed over its
    group, unpooled: what kvtrim's cache accumulates step by step (``attn_sq_sum``), computed here at once since
    nothing was evicted in between."""
    fresh = int((view.positions[0, 0] >= 0).sum()) - kept[0].numel()
    if queries.shape[0] < fresh:
        raise RuntimeError(f"kvtrim: {queries.shape[0]} queries recorded for the {fresh} tokens since the last round")
    decoded = queries[queries.shape[0] - fresh :]
    base = torch.zeros(view.positions.shape, dtype=torch.float32, device=view.keys.device)
    for h, metric in enumerate(kept):
        base[0, h, : metric.numel()] = metric.to(base.device)
    qpos = torch.arange(end - fresh, end, device=base.device).view(1, -1)
    queries = decoded.transpose(0, 1).unsqueeze(0)  # [1, q_heads, n, d]
    return base + squared_attention(queries, qpos, view.keys, view.positions, view.scaling, kernel=1)


def evict_layer(
    pipeline: Pipeline,
    layout: BlockLayout,
    kv_cache: torch.Tensor,
    query: torch.Tensor,
    pending: PendingEviction,
    layer_idx: int,
    num_layers: int,
    scaling: float,
    ratio: float | None,
    module=None,
    scales: tuple[float, float] = (1.0, 1.0),
    score_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Keep ``pending.layer_keep[layer_idx]`` entries per KV head of this layer, compacted into its first slots.

    Args:
        query: ``[num_tokens, q_heads, head_dim]`` the step's post-rotary queries (the request's last prompt
            queries are the observation window); with ``pending.observed``, the request's recorded recent queries
        module: the layer's attention module (``o_proj``: CriticalKV's projected value norms), or None
        scales: the layer's ``(k_scale, v_scale)`` (an fp8 cache; ignored otherwise)
        score_reduce: see :func:`_score_and_select` (the mean over tensor-parallel ranks, or None)
    Each KV head may keep different tokens (the count is what the block table fixes); kept entries stay in
    position order, keys keep the rotation of their original position, fp8 codes are moved as they are. Returns
    the kept entries' logical positions ``[kv_heads, keep]`` (what a later round of the same request scores with).
    """
    keep = pending.keep if pending.layer_keep is None else pending.layer_keep[layer_idx]
    keys, values, selection, kept, _, _ = _score_and_select(
        pipeline, layout, kv_cache, query, pending, layer_idx, num_layers, scaling, ratio, keep, module, None, scales,
        score_reduce,
    )  # fmt: skip
    kv_heads = keys.shape[1]
    if not bool((kept == keep).all()):
        raise RuntimeError(
            f"kvtrim: {pipeline.name} kept {kept.tolist()} entries per head in layer {layer_idx}, the scheduler "
            f"sized this layer for {keep}; refusing to continue with an inconsistent cache"
        )
    index = selection.indices[0][selection.keep_mask[0]].view(kv_heads, keep).transpose(0, 1)  # [keep, kv_heads]
    heads = torch.arange(kv_heads, device=keys.device).view(1, -1)
    layout.write(kv_cache, pending.blocks, keys[index, heads], values[index, heads])
    return pending.key_positions(layer_idx, kv_heads, keys.device)[heads, index].transpose(0, 1)


def evict_layer_heads(
    pipeline: Pipeline,
    layout: BlockLayout,
    kv_cache: torch.Tensor,
    query: torch.Tensor,
    pending: PendingEviction,
    layer_idx: int,
    num_layers: int,
    scaling: float,
    ratio: float | None,
    isa: str,
    module=None,
    scales: tuple[float, float] = (1.0, 1.0),
    kept_positions: dict | None = None,
    score_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[int]:
    """Per-head budgets: each KV head keeps its own count, written to its own one-head sub-pages.

    The method splits ``kv_heads · pending.head_budget`` entries among this layer's heads (AdaKV; KV-Compress with
    ``even_layer_evict``: ``pending.layer_total``, whole blocks of its ranking); each head's
    kept entries, in position order, go to the sub-pages ``pending.pages`` assigns it in this layer
    (:mod:`kvtrim.vllm.subpages`). Returns the per-head counts ``[kv_heads]``. An fp8 cache's kept bytes are moved
    into the sub-pages as they are (:meth:`~kvtrim.vllm.kv_layout.BlockLayout.one_head`), not encoded again.
    A later round (``pending.head_positions``) reads each head's entries from its sub-pages and re-places the kept
    ones in the sub-pages of the request's first ``⌈keep/block_size⌉`` blocks. ``kept_positions``: filled with
    ``{layer_idx: [kv_heads] kept logical positions}`` (what the next round reads with).
    """
    budget = pending.head_budget
    fixed = None if pending.head_counts is None else torch.from_numpy(pending.head_counts[layer_idx])
    keys, values, selection, kept, positions, scores = _score_and_select(
        pipeline, layout, kv_cache, query, pending, layer_idx, num_layers, scaling, ratio, budget, module, fixed,
        scales, score_reduce,
    )  # fmt: skip
    kv_heads = keys.shape[1]
    counts = kept.cpu().numpy()
    total = int(fixed.sum()) if fixed is not None else pending.layer_total or kv_heads * budget
    if int(counts.sum()) > total:
        raise RuntimeError(
            f"kvtrim: {pipeline.name} kept {counts.tolist()} entries per head in layer {layer_idx}, more than "
            f"{total} in total: the request's blocks were sized for that total"
        )
    if pending.head_positions is not None:  # entries read (copies) above: their sub-pages may be reused now
        pending.pages.restart_layer(layer_idx, -(-pending.keep // pending.pages.block_size))
    slots = pending.pages.place(layer_idx, counts)
    kept: list[torch.Tensor] = []
    metrics: list[torch.Tensor] = []
    rows, heads = [], []
    for h in range(kv_heads):
        index = selection.indices[0, h][selection.keep_mask[0, h]].sort().values
        kept.append(positions[h, index].cpu())
        if pending.kept_metrics is not None:
            metrics.append(scores[h, index].clone())
        if bool((kept[-1] < 0).any()):
            raise RuntimeError(f"kvtrim: {pipeline.name} kept a padding slot of head {h} in layer {layer_idx}")
        rows.append(index)
        heads.append(torch.full_like(index, h))
    index, head = torch.cat(rows), torch.cat(heads)
    head_slots = torch.from_numpy(np.concatenate(slots)).to(keys.device)  # every head's kept entries, in head order
    new_keys, new_values = keys[index, head].unsqueeze(1), values[index, head].unsqueeze(1)  # [Σ counts, 1, d]
    if index.numel() and layout.entry.fp8 is not None:  # fp8: move the stored bytes
        layout.one_head().write_slots(kv_cache, head_slots, new_keys, new_values)
    elif index.numel():  # vLLM's own cache write, one head per slot
        folded_cache_write(new_keys, new_values, kv_cache, head_slots.view(-1, 1), isa)
    if kept_positions is not None:
        kept_positions[layer_idx] = kept
    if pending.kept_metrics is not None:
        pending.kept_metrics[layer_idx] = metrics
    return counts.tolist()
