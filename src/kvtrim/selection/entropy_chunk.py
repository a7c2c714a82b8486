"""Chunk selection gated by the entropy of the scores inside each chunk (kvpress's EntropyGatedChunkKV)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import InvalidParameterError
from .base import Selection, Selector
from .chunk import selection_from_mask

_EPS = 1e-8


def normalized_entropy(scores: torch.Tensor) -> float:
    """Entropy of ``scores`` ``[n]`` read as a distribution, divided by ``log n`` (0 for one token).

    Negative scores are shifted up by the smallest one first, so the distribution is valid; ``[0, 1]``: 1 when
    every token scores the same, near 0 when one token holds all the mass.
    """
    n = scores.numel()
    if n < 2:
        return 0.0
    s = scores.double()
    s = s - s.min().clamp(max=0.0)
    p = s / (s.sum() + _EPS)
    h = -(p * (p + _EPS).log()).sum()
    return float((h / math.log(n)).clamp(0.0, 1.0))


def gated_chunk_positions(
    scores: torch.Tensor, positions: torch.Tensor, budget: int, chunk: int, spiky_keep: int
) -> torch.Tensor:
    """Positions kept among ``positions`` ``[n]`` (ascending) with token ``scores`` ``[n]`` under ``budget``.

    The positions are cut into chunks of ``chunk`` (``[0, c)``, ``[c, 2c)`` …). A chunk scores the mean of its
    tokens' scores and has the :func:`normalized_entropy` of them. A chunk at or above the median chunk score and
    below the median entropy (important but spiky: a few tokens carry it) keeps only its ``spiky_keep`` best
    tokens; any other chunk is kept whole. Chunks are taken best score first until the budget is spent (the last
    one cut to the budget by token score), and budget left over is filled with the best remaining tokens, so
    exactly ``min(budget, n)`` positions are kept.
    """
    n = positions.numel()
    if budget >= n:
        return positions
    if budget <= 0:
        return positions[:0]
    ids = torch.div(positions, chunk, rounding_mode="floor")
    starts = [0, *((ids[1:] != ids[:-1]).nonzero().flatten() + 1).tolist()]
    spans = list(zip(starts, [*starts[1:], n], strict=True))
    means = torch.stack([scores[a:b].double().mean() for a, b in spans])
    entropy = torch.tensor(
        [normalized_entropy(scores[a:b]) for a, b in spans], dtype=torch.float64, device=scores.device
    )
    spiky = ((means >= means.median()) & (entropy < entropy.median())).tolist()
    keep = torch.zeros(n, dtype=torch.bool, device=scores.device)
    left = budget
    for c in torch.argsort(means.cpu(), descending=True, stable=True).tolist():
        if left <= 0:
            break
        a, b = spans[c]
        take = min(b - a, left, spiky_keep if spiky[c] else b - a)
        keep[a + scores[a:b].topk(take).indices] = True
        left -= take
    if left > 0:  # spiky chunks left budget unspent: the best tokens not yet kept fill it
        rest = (~keep).nonzero().flatten()
        keep[rest[scores[rest].topk(min(left, rest.numel())).indices]] = True
    return positions[keep]


@dataclass
class EntropyGatedChunkSelector(Selector):
    """ChunkKV's chunk selection (Liu et al., 2025, "ChunkKV: Semantic-Preserving KV Cache Compression for
    Efficient Long-Context LLM Inference", arXiv 2502.00299) with kvpress's entropy gate: a chunk whose importance
    rests on a few tokens keeps only its ``spiky_keep`` best tokens and the budget it frees goes to further
    chunks (see :func:`gated_chunk_positions`).

    Token scores are summed over the KV heads of the layer, so every head keeps the same positions; the last
    ``recent`` tokens (the scorer's observation window) are kept first and the rest of the budget goes to chunks.
    Each head keeps exactly its budget (the smallest of the layer's heads' when they differ).

    Args:
        chunk: tokens per chunk (10)
        spiky_keep: tokens an important but spiky chunk keeps (4), below ``chunk``
        recent: protected recent window
    """

    chunk: int = 10
    spiky_keep: int = 4
    recent: int = 8

    def __post_init__(self) -> None:
        for name, low in (("chunk", 2), ("spiky_keep", 1), ("recent", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidParameterError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.spiky_keep >= self.chunk:
            raise InvalidParameterError(
                f"spiky_keep must be below chunk ({self.chunk}), got {self.spiky_keep}: a spiky chunk keeps fewer "
                "tokens than a whole one"
            )

    def select(self, view, scores: torch.Tensor, budgets: torch.Tensor) -> Selection:
        """Args: ``view`` (a :class:`~kvtrim.scoring.base.LayerView`), scores ``[batch, kv_heads, seq]``,
        budgets ``[batch, kv_heads]``."""
        positions = view.positions
        valid = positions >= 0
        width = int(positions.amax().clamp(min=0)) + 1
        slot = torch.where(valid, positions, torch.full_like(positions, width))  # empty slots: a spare column
        finite = torch.where(valid, scores.double().nan_to_num(0.0, 0.0, 0.0), torch.zeros_like(scores.double()))
        keep = torch.zeros_like(valid)
        for row in range(positions.shape[0]):
            by_pos = torch.zeros(width + 1, dtype=torch.float64, device=scores.device)
            by_pos.scatter_add_(0, slot[row].flatten(), finite[row].flatten())
            held = torch.zeros(width + 1, dtype=torch.bool, device=scores.device)
            held[slot[row].flatten()] = True
            held[width] = False
            pos = held.nonzero().flatten()
            recent = pos >= int(view.context_lengths[row]) - self.recent
            budget = int(budgets[row].min())
            window = pos[recent][-budget:] if budget > 0 else pos[:0]
            body = pos[~recent]
            chosen = gated_chunk_positions(by_pos[body], body, budget - window.numel(), self.chunk, self.spiky_keep)
            kept = torch.zeros(width + 1, dtype=torch.bool, device=scores.device)
            kept[torch.cat([window, chosen])] = True
            keep[row] = valid[row] & kept[slot[row]]
        return selection_from_mask(keep)
