"""Top-k selection with protected attention-sink and recent windows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Selection, Selector

__all__ = ["Selection", "TopKSelector", "protected_mask"]

_PROTECTED = 1e30


def protected_mask(
    positions: torch.Tensor, context_lengths: torch.Tensor, budgets: torch.Tensor, sink: int, recent: int | float
) -> torch.Tensor:
    """``[batch, kv_heads, seq]`` True for the first ``sink`` and the last ``recent`` tokens of each row.

    ``recent`` as a float is a fraction of each head's budget (H2O's recent half).
    """
    valid = positions >= 0
    prot = valid & (positions < sink) if sink > 0 else torch.zeros_like(valid)
    if recent:
        n_recent = (budgets.double() * recent).floor().long() if isinstance(recent, float) else budgets * 0 + recent
        start = context_lengths.view(-1, 1) - n_recent  # [batch, kv_heads]
        prot = prot | (valid & (positions >= start[:, :, None]))
    return prot


@dataclass
class TopKSelector(Selector):
    """Keep each head's ``budget`` highest-scoring entries, protected windows first.

    Args:
        sink: always keep the first ``sink`` tokens (attention sinks)
        recent: always keep the last ``recent`` tokens (an int, or a float fraction of the budget)
    Empty slots are never selected over real tokens.
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    runs_in_vllm = True

    sink: int = 0
    recent: int | float = 0

    def select(self, view, scores: torch.Tensor, budgets: torch.Tensor) -> Selection:
        """Args: ``view`` (a :class:`~kvtrim.scoring.base.LayerView`), scores ``[batch, kv_heads, seq]``,
        budgets ``[batch, kv_heads]``."""
        return self.select_positions(view.positions, scores, budgets, view.context_lengths)

    def select_positions(
        self, positions: torch.Tensor, scores: torch.Tensor, budgets: torch.Tensor, context_lengths: torch.Tensor
    ) -> Selection:
        """Top-k given positions ``[batch, kv_heads, seq]`` and ``context_lengths`` ``[batch]``."""
        valid = positions >= 0
        key = scores.double().masked_fill(~valid, float("-inf"))
        prot = protected_mask(positions, context_lengths, budgets, self.sink, self.recent)
        # Protected entries outrank everything; among them the score still orders them.
        key = torch.where(prot, _PROTECTED + key.clamp(-1e20, 1e20), key)
        k = int(budgets.max().clamp(max=scores.shape[-1]))
        top = key.topk(k, dim=-1)
        rank = torch.arange(k, device=scores.device)
        keep = (rank < budgets[..., None]) & torch.isfinite(top.values)
        indices, order = top.indices.sort(dim=-1)
        return Selection(indices=indices, keep_mask=torch.gather(keep, -1, order))
