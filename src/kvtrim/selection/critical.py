"""Two-stage critical-entry selection (CriticalKV)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scoring.value_norm import projected_value_norms
from .base import Selector
from .topk import Selection, TopKSelector, protected_mask

_FORCED = 1e30


@dataclass
class CriticalSelector(Selector):
    """CriticalKV's perturbation-constrained selection, per KV head with budget ``b``.

    Stage 1 keeps the top ``⌊α·b⌋`` entries by attention score ``A`` (protected windows rank first, as kvpress
    gives window tokens the maximum score). Stage 2 fills the budget with the top entries by
    ``(A + ε)·‖v·W_O‖₁`` (value projected by each query head's slice of the output matrix, L1 over hidden,
    mean over the group); stage-1 entries are always kept.

    Args:
        alpha: stage-1 fraction (paper code: 0.5)
        eps: added to ``A`` in stage 2 (paper code: 1e-4)
        sink, recent: protected windows (always kept, counted in the budget)
    """

    runs_in_vllm = True  # the vLLM plugin passes the layer's attention module (its o_proj) in the view

    alpha: float = 0.5
    eps: float = 1e-4
    sink: int = 0
    recent: int | float = 0
    chunk: int = 256

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")

    def stage_scores(self, view, scores: torch.Tensor, budgets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(stage2_scores, stage1_mask)``, both ``[batch, kv_heads, seq]``; stage-1 entries are forced."""
        valid = view.positions >= 0
        prot = protected_mask(view.positions, view.context_lengths, budgets, self.sink, self.recent)
        attention = scores.masked_fill(~valid, float("-inf"))
        ranked = torch.where(prot, _FORCED + attention.clamp(-1e20, 1e20), attention)
        k1 = (budgets.double() * self.alpha).floor().long()  # [batch, kv_heads]
        stage1 = torch.zeros_like(valid)
        kmax = int(k1.max())
        if kmax > 0:
            top = ranked.topk(min(kmax, ranked.shape[-1]), dim=-1).indices
            take = torch.arange(top.shape[-1], device=top.device) < k1[..., None]
            take = take & torch.gather(valid, -1, top)
            stage1.scatter_(-1, top, take)
        norms = projected_value_norms(view.values, view.module.o_proj.weight, self.chunk)
        stage2 = (scores.clamp(min=0) + self.eps) * norms
        stage2 = stage2.masked_fill(stage1, _FORCED).masked_fill(~valid, float("-inf"))
        return stage2, stage1

    def select(self, view, scores: torch.Tensor, budgets: torch.Tensor) -> Selection:
        stage2, _ = self.stage_scores(view, scores, budgets)
        return TopKSelector(self.sink, self.recent).select_positions(
            view.positions, stage2, budgets, view.context_lengths
        )
