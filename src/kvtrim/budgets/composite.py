"""Layer budgets from composite tokens allocated across all layers at once (KVCompose)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidParameterError
from .base import BudgetAllocator, BudgetRequest


def composite_scores(scores: torch.Tensor) -> torch.Tensor:
    """``[batch, seq]`` the score of each composite token of one layer: its ``r``-th composite token joins the
    ``r``-th best entry of every KV head and scores their mean (``-inf`` past the entries of the head holding
    fewest).

    Args:
        scores: ``[batch, kv_heads, seq]`` entry scores, ``-inf`` for empty slots
    """
    return scores.float().sort(dim=-1, descending=True).values.mean(1)


@dataclass
class CompositeLayerBudget(BudgetAllocator):
    """KVCompose's global allocation ("KVCompose: Efficient Structured KV Cache Compression with Composite
    Tokens", arXiv 2509.05165): every layer keeps the same number of entries in each of its KV heads (each head its
    own best entries: the ``r``-th of every head form composite token ``r``), and the number varies by layer.

    Per row, the composite tokens of all layers (:func:`composite_scores`) compete for ``keep · layers`` places;
    a layer keeps as many as it wins, at least ``floor``. With ``first_layer_max`` the first layer's composite
    scores are raised to the largest of any layer at each rank (kvpress's rule: the first layer is never the one
    squeezed). Scores must be comparable across layers (attention probabilities).
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    varies_by = "layer"

    floor: int = 1
    first_layer_max: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.floor, bool) or not isinstance(self.floor, int) or self.floor < 1:
            raise InvalidParameterError(
                f"floor must be an integer >= 1 (entries every layer keeps), got {self.floor!r}"
            )
        if not isinstance(self.first_layer_max, bool):
            raise InvalidParameterError(f"first_layer_max must be True or False, got {self.first_layer_max!r}")

    def allocate(self, request: BudgetRequest, scores: list[torch.Tensor]) -> torch.Tensor:
        b, layers, heads = len(request.keep), request.num_layers, request.kv_heads
        width = max(s.shape[-1] for s in scores)
        ninf = float("-inf")
        comp = torch.stack(
            [torch.nn.functional.pad(composite_scores(s), (0, width - s.shape[-1]), value=ninf) for s in scores], 1
        )  # [b, layers, width]
        held = torch.isfinite(comp).sum(-1)  # composite tokens each layer has
        if self.first_layer_max and layers > 1:
            comp[:, 0] = torch.where(torch.isfinite(comp[:, 0]), comp.amax(1), comp[:, 0])
        flat = comp.reshape(b, -1)
        total = request.keep.to(flat.device) * layers
        top = flat.topk(int(total.max().clamp(max=flat.shape[-1])), dim=-1)
        chosen = (torch.arange(top.indices.shape[-1], device=flat.device) < total[:, None]) & torch.isfinite(top.values)
        counts = torch.zeros(b, layers, dtype=torch.long, device=flat.device)
        counts.scatter_add_(1, top.indices // width, chosen.long())
        counts = torch.minimum(counts.clamp(min=self.floor), held)
        return counts[..., None].expand(b, layers, heads).to(request.keep.device)
