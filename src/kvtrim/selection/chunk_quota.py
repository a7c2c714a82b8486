"""The same fraction kept in every chunk of positions (kvpress's ChunkPress, after FINCH's chunking)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidParameterError
from .base import Selection, Selector


def chunk_quota_mask(
    positions: torch.Tensor, scores: torch.Tensor, budgets: torch.Tensor, chunk: int
) -> torch.Tensor:
    """``[batch, kv_heads, seq]`` True for the slots kept when every chunk of ``chunk`` positions keeps its share.

    A head with budget ``B`` over ``n`` stored entries keeps, in a chunk holding ``c`` of them, its
    ``max(1, floor(c·B/n))`` best-scoring entries (``int(c·(1−ratio))`` for a ratio budget), so the total is at
    most ``B`` plus one per chunk that rounds up to 1, and each chunk is compressed on its own.

    Args:
        positions: ``[batch, kv_heads, seq]`` ascending per head, ``-1`` for empty slots
        scores: ``[batch, kv_heads, seq]`` higher = keep; budgets: ``[batch, kv_heads]``
    """
    valid = positions >= 0
    chunk_id = torch.where(valid, positions.div(chunk, rounding_mode="floor"), -1)
    change = torch.ones_like(chunk_id)
    change[..., 1:] = (chunk_id[..., 1:] != chunk_id[..., :-1]).long()
    groups = change.cumsum(-1) - 1  # [b, h, s] dense chunk index per slot
    counts = torch.zeros_like(groups).scatter_add_(-1, groups, valid.long())
    size = counts.gather(-1, groups)  # entries of the slot's chunk
    stored = valid.sum(-1, keepdim=True).clamp(min=1)
    quota = torch.div(size * budgets[..., None].long(), stored, rounding_mode="floor").clamp(min=1)
    # rank of each slot inside its chunk by descending score: sort by score, then (stably) by chunk
    key = scores.double().masked_fill(~valid, float("-inf"))
    by_score = key.argsort(dim=-1, descending=True, stable=True)
    by_chunk = groups.gather(-1, by_score).argsort(dim=-1, stable=True)
    order = by_score.gather(-1, by_chunk)  # slots grouped by chunk, best first inside each
    slots = torch.zeros_like(groups).scatter_add_(-1, groups, torch.ones_like(groups))  # padding included
    start = (slots.cumsum(-1) - slots).gather(-1, groups.gather(-1, order))
    rank_sorted = torch.arange(order.shape[-1], device=order.device).expand_as(order) - start
    rank = torch.empty_like(order).scatter_(-1, order, rank_sorted)
    return valid & (rank < quota)


@dataclass
class ChunkQuotaSelector(Selector):
    """Keep the best entries of every chunk of ``chunk`` positions separately, each chunk in proportion to its
    size (kvpress's ChunkPress; the chunking follows FINCH, Corallo & Papotti, 2024, TACL, "FINCH: Prompt-guided
    Key-Value Cache Compression"): no region of the context is emptied because another scores higher.
    """

    chunk: int = 1024

    def __post_init__(self) -> None:
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or self.chunk < 1:
            raise InvalidParameterError(f"chunk must be an integer >= 1, got {self.chunk!r}")

    def select(self, view, scores: torch.Tensor, budgets: torch.Tensor) -> Selection:
        keep = chunk_quota_mask(view.positions, scores, budgets, self.chunk)
        k = max(int(keep.sum(-1).max()), 1)
        order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices[..., :k]
        return Selection(indices=order, keep_mask=torch.gather(keep, -1, order))
