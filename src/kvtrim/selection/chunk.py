"""Selection of whole contiguous chunks of tokens, with layer-wise index reuse (ChunkKV)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidParameterError
from .base import Selector
from .topk import Selection

_REFERENCE = "chunkkv_reference"  # shared-dict key: kept positions of the layer group's reference layer


def chunk_keep_mask(
    positions: torch.Tensor,
    scores: torch.Tensor,
    budgets: torch.Tensor,
    context_lengths: torch.Tensor,
    chunk: int,
    recent: int,
    share_heads: bool,
) -> torch.Tensor:
    """``[batch, kv_heads, seq]`` True for the kept slots: the last ``recent`` tokens, plus the best whole chunks.

    Tokens before the recent window are cut into chunks by position (``[0, c)``, ``[c, 2c)`` …, the last one
    possibly shorter). A chunk scores the mean of its tokens' scores (summed over the KV heads when
    ``share_heads``, so every head keeps the same chunks). Chunks are taken best first while their tokens fit in
    ``budget − recent``; a chunk that does not fit ends the selection, so no head ever exceeds its budget.
    """
    valid = positions >= 0
    start = (context_lengths.view(-1, 1, 1) - recent).clamp(min=0)  # [b, 1, 1]
    window = valid & (positions >= start)
    body = valid & ~window
    n_chunks = int(positions.amax().clamp(min=0)) // chunk + 2  # the last bucket collects the other slots
    cid = torch.where(body, positions // chunk, torch.full_like(positions, n_chunks - 1))  # spare bucket last
    finite = torch.where(body, scores.float().nan_to_num(0.0, 0.0, 0.0), torch.zeros_like(scores, dtype=torch.float32))
    shape = (*positions.shape[:2], n_chunks)
    total = torch.zeros(shape, device=scores.device).scatter_add_(-1, cid, finite)
    size = torch.zeros(shape, device=scores.device).scatter_add_(-1, cid, body.float())
    if share_heads:
        total = total.sum(1, keepdim=True).expand(shape)
        size_rank = size.amax(1, keepdim=True).expand(shape)
    else:
        size_rank = size
    rank_key = torch.where(size_rank > 0, total / size_rank.clamp(min=1.0), torch.full_like(total, float("-inf")))
    order = rank_key.argsort(dim=-1, descending=True, stable=True)  # earlier chunk first on ties
    fits = size.gather(-1, order).cumsum(-1) <= (budgets - window.sum(-1)).clamp(min=0)[..., None]
    fits = fits & torch.isfinite(rank_key.gather(-1, order))
    kept_chunks = torch.zeros(shape, dtype=torch.bool, device=scores.device).scatter_(-1, order, fits)
    return window | (body & kept_chunks.gather(-1, cid))


def selection_from_mask(keep: torch.Tensor) -> Selection:
    """A :class:`Selection` holding exactly the True slots of ``keep`` ``[batch, kv_heads, seq]``."""
    counts = keep.sum(-1)
    k = max(1, int(counts.max()))
    order = (~keep).to(torch.int8).argsort(dim=-1, stable=True)[..., :k]  # kept slots first, in slot order
    mask = torch.arange(k, device=keep.device) < counts[..., None]
    indices, perm = order.sort(dim=-1)
    return Selection(indices=indices, keep_mask=mask.gather(-1, perm))


@dataclass
class ChunkSelector(Selector):
    """ChunkKV selection (Liu et al., 2025, "ChunkKV: Semantic-Preserving KV Cache Compression for Efficient
    Long-Context LLM Inference", arXiv 2502.00299).

    Keeps whole chunks of ``chunk`` contiguous tokens ranked by their mean token score (see
    :func:`chunk_keep_mask`) plus the last ``recent`` tokens (the observation window). Layer-wise index reuse:
    layers are grouped by ``reuse_layers``; the first layer of each group selects, the others keep the same
    positions (the paper's training-free reuse; ``reuse_layers=1`` selects in every layer). A head may keep fewer
    entries than its budget (up to ``chunk − 1`` fewer): only whole chunks are kept.

    Args:
        chunk: tokens per chunk (10, the paper's default)
        recent: protected recent window (the observation window of the scorer)
        reuse_layers: layers sharing one selection (1 = none)
        share_heads: the KV heads of a layer keep the same chunks (scores summed over heads)
    """

    chunk: int = 10
    recent: int = 8
    reuse_layers: int = 1
    share_heads: bool = True

    def __post_init__(self) -> None:
        for name, low in (("chunk", 1), ("recent", 0), ("reuse_layers", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidParameterError(f"{name} must be an integer >= {low}, got {value!r}")

    def select(self, view, scores: torch.Tensor, budgets: torch.Tensor) -> Selection:
        """Args: ``view`` (a :class:`~kvtrim.scoring.base.LayerView`), scores ``[batch, kv_heads, seq]``,
        budgets ``[batch, kv_heads]``."""
        positions = view.positions
        reference = view.shared.get(_REFERENCE) if view.layer_idx % self.reuse_layers else None
        if reference is None:
            keep = chunk_keep_mask(
                positions, scores, budgets, view.context_lengths, self.chunk, self.recent, self.share_heads
            )
            if self.reuse_layers > 1:  # kept positions, indexed by position, for the next layers of the group
                width = int(positions.amax().clamp(min=0)) + 1
                slot = torch.where(positions >= 0, positions, torch.full_like(positions, width))  # empty: spare column
                by_pos = torch.zeros((*positions.shape[:2], width + 1), dtype=torch.bool, device=positions.device)
                view.shared[_REFERENCE] = by_pos.scatter_(-1, slot, keep)[..., :width]
        else:
            width = reference.shape[-1]
            inside = (positions >= 0) & (positions < width)
            keep = inside & reference.gather(-1, positions.clamp(min=0, max=width - 1))
        return selection_from_mask(keep)
