"""Lag-relative scores (LagKV): how much a token's keys and values stand out from the *next* partition."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import LayerView, Scorer
from .observation import ObservationSpec
from .partitions import PartitionLayout, partition_layout

STATISTICS = ("lag_std", "local_std", "key_norm")


def layer_partitions(view: LayerView, sink: int, lag: int) -> PartitionLayout:
    """The lag frame of ``view`` (computed once per view and reused by the budget and the selector)."""
    key = ("partitions", sink, lag)
    if key not in view._cache:
        view._cache[key] = partition_layout(view.positions, view.context_lengths, view.compressed_until, sink, lag)
    return view._cache[key]


def _std_softmax(current: torch.Tensor, reference: torch.Tensor, eps: float) -> torch.Tensor:
    """``[…, L, d]`` tokens normalized per channel by the reference's min–max → softmax over tokens of the
    channel-wise standard deviation, ``[…, L]``."""
    lo = reference.amin(dim=-2, keepdim=True)
    hi = reference.amax(dim=-2, keepdim=True)
    normalized = (current - lo) / (hi - lo + eps)
    # Unbiased std over channels (torch's default estimator, as the authors' code), written out: on CPU it is
    # ~14x faster than Tensor.std over a short last dimension.
    centered = normalized - normalized.mean(dim=-1, keepdim=True)
    std = (centered.square().sum(dim=-1) / max(normalized.shape[-1] - 1, 1)).sqrt()
    return std.softmax(dim=-1)


@dataclass
class LagRelativeScorer(Scorer):
    """Attention-free per-KV-head scores inside the lag frame; only slots of partitions compressed now are scored
    (the rest get 0 and are kept by the partition selector).

    Args:
        sink, lag: the frame (see :mod:`kvtrim.scoring.partitions`)
        statistic: ``lag_std`` (LagKV: min–max statistics of the next partition), ``local_std`` (the partition's
            own statistics, the paper's LocalKV ablation) or ``key_norm`` (``softmax(−‖k‖)``, the L2-norm score
            in the same recursive frame)
        value_weight: γ, weight of the value score added to the key score (1.0: a plain sum)
        eps: added to the min–max range so constant channels give finite scores (decision 5 (docs/decisions.md);
            the authors' code has none)
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    uses_attention = False
    question_aware = False
    runs_in_vllm = True

    sink: int = 16
    lag: int = 128
    statistic: str = "lag_std"
    value_weight: float = 1.0
    eps: float = 1e-6
    observation: ObservationSpec = field(default_factory=ObservationSpec)

    def __post_init__(self) -> None:
        if self.statistic not in STATISTICS:
            raise ValueError(f"statistic must be one of {STATISTICS}, got {self.statistic!r}")

    def score(self, view: LayerView) -> torch.Tensor:
        """Returns ``[batch, kv_heads, seq]``."""
        layout = layer_partitions(view, self.sink, self.lag)
        if int(layout.compress.max()) == 0:
            return torch.zeros(view.positions.shape, dtype=torch.float32, device=view.positions.device)
        keys = layout.gather(view.keys.float())  # [b, h, P, L, d]
        if self.statistic == "key_norm":
            per_part = (-keys[:, :, :-1].norm(dim=-1)).softmax(dim=-1)
        else:
            values = layout.gather(view.values.float())
            per_part = self._side(keys) + self.value_weight * self._side(values)
        return layout.scatter_back(per_part)

    def _side(self, x: torch.Tensor) -> torch.Tensor:
        current = x[:, :, :-1]
        reference = x[:, :, 1:] if self.statistic == "lag_std" else current
        return _std_softmax(current, reference, self.eps)
