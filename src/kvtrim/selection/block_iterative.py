"""Block-wise iterative selection: the context is compressed block after block, re-scoring what is kept so far
together with each new block (KeyDiff's block prompt processing; kvpress's BlockPress)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..errors import InvalidParameterError
from ..scoring.base import Scorer
from .base import Selection, Selector


def best_of(scores: torch.Tensor, candidates: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``[batch, kv_heads, seq]`` True for the ``counts`` ``[batch, kv_heads]`` best-scoring ``candidates`` of each
    head (ties: the earlier slot)."""
    key = scores.double().masked_fill(~candidates, float("-inf"))
    order = key.argsort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, ranks)
    return candidates & (rank < counts[..., None])


@dataclass
class BlockIterativeSelector(Selector):
    """Keep ``B`` entries per head by compressing the context block by block (Park et al., 2025, "KeyDiff: Key
    Similarity-Based KV Cache Eviction for Long-Context LLM Inference in Resource-Constrained Environments",
    arXiv 2504.15364, block prompt processing).

    A head with budget ``B`` first holds its first ``B`` stored entries; then each following block of ``block``
    entries joins them, ``scorer`` scores the ``B + block`` candidates as if they were the whole cache (the
    others are hidden from it, their positions set to -1), and the best ``B`` stay. The result depends on the
    order of the context whenever the scorer looks at the set (KeyDiff's anchor is the mean of the candidates'
    keys); for a per-entry score (KNorm) it equals one top-k over the whole context.

    The scores the compressor passes in are not used: the scorer runs again on every block's candidates.
    """

    scorer: Scorer
    block: int = 128

    def __post_init__(self) -> None:
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise InvalidParameterError(f"block must be an integer >= 1, got {self.block!r}")
        if type(self.scorer).prepare is not Scorer.prepare:
            raise InvalidParameterError(
                f"scorer {type(self.scorer).__name__} computes cross-layer quantities over the whole cache "
                "(prepare), which a block of candidates cannot reuse; give a scorer of one layer's entries"
            )

    def bind(self, model) -> None:
        self.scorer.bind(model)

    def keep_mask(self, view, budgets: torch.Tensor) -> torch.Tensor:
        """``[batch, kv_heads, seq]`` True for the slots kept after the last block (``budgets`` ``[batch,
        kv_heads]``; stored slots ascending by position, ``-1`` for empty ones)."""
        valid = view.valid
        rank = valid.long().cumsum(-1) - 1  # [b, h, s] order of each stored entry in the context
        counts = budgets.long().to(rank.device)
        first = counts[..., None]
        kept = valid & (rank < first)
        stored = valid.sum(-1)
        # Blocks start after each head's own budget; past the longest head's last entry every block is empty.
        span = int((stored - counts).clamp(min=0).max())
        for start in range(0, span, self.block):
            block = valid & (rank >= first + start) & (rank < first + start + self.block)
            candidates = kept | block
            sub = replace(view, positions=view.positions.masked_fill(~candidates, -1), _cache={})
            scores = self.scorer.score(sub).float()
            kept = best_of(scores, candidates, counts)
        return kept

    def select(self, view, scores: torch.Tensor, budgets: torch.Tensor) -> Selection:
        keep = self.keep_mask(view, budgets)
        k = max(int(keep.sum(-1).max()), 1)
        order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices[..., :k]
        return Selection(indices=order, keep_mask=torch.gather(keep, -1, order))
