"""Per-partition top-k selection in the lag frame (LagKV)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scoring.lag_relative import layer_partitions
from .base import Selector
from .topk import Selection


@dataclass
class PartitionTopKSelector(Selector):
    """Keep every slot outside the partitions compressed now (sink, already compressed part, tail) and the top
    ``k`` of each compressed partition, with ``k`` = the head's budget beyond the fixed slots spread evenly over
    its partitions. Kept slots stay in position order. Reports the new ``compressed_until`` so the next round
    never re-scores what was compressed (the recursion of LagKV).
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    runs_in_vllm = True
    lag_partitions = True

    sink: int = 16
    lag: int = 128
    skip_layers: tuple[int, ...] = ()

    def select(self, view, scores: torch.Tensor, budgets: torch.Tensor) -> Selection:
        """Args: ``view`` (a LayerView), scores ``[batch, kv_heads, seq]``, budgets ``[batch, kv_heads]``."""
        valid = view.positions >= 0
        if view.layer_idx in self.skip_layers:
            return _keep(valid, view.compressed_until)
        layout = layer_partitions(view, self.sink, self.lag)
        compressible = layout.compressible
        parts = layout.compress.view(-1, 1)  # [batch, 1]
        fixed = (valid & ~compressible).sum(-1)  # [batch, kv_heads]
        k = torch.where(parts > 0, (budgets - fixed).clamp(min=0) // parts.clamp(min=1), 0).clamp(max=self.lag)
        keep = valid & ~compressible
        if int(parts.max()) > 0:
            per_part = layout.gather(scores.float().masked_fill(~compressible, float("-inf")).unsqueeze(-1))
            per_part = per_part.squeeze(-1)[:, :, : int(parts.max())]  # [b, h, P', L]
            order = per_part.argsort(dim=-1, descending=True, stable=True)
            rank = torch.empty_like(order).scatter_(
                -1, order, torch.arange(self.lag, device=order.device).expand_as(order)
            )
            slot_rank = layout.scatter_back(rank.float(), fill=float(self.lag))
            keep = keep | (compressible & (slot_rank < k[..., None]))
        selection = _keep(keep, layout.new_start)
        return selection


def _keep(keep: torch.Tensor, compressed_until: torch.Tensor | None) -> Selection:
    """A selection of the slots flagged in ``keep`` ``[batch, kv_heads, seq]``, ascending."""
    k = max(int(keep.sum(-1).max()), 1)
    order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices[..., :k]
    return Selection(indices=order, keep_mask=torch.gather(keep, -1, order), compressed_until=compressed_until)
