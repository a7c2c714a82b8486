"""Query-driven key-channel selection (ThinK): which channels of the stored keys each KV head keeps.

ThinK (Xu et al., "ThinK: Thinner Key Cache by Query-Driven Pruning", ICLR 2025, arXiv 2407.21018) prunes
channels of the key cache instead of tokens. Per head, channel ``i`` contributes ``Q[:, i] K[:, i]ᵀ`` to the
attention logits of the observation-window queries ``Q``; ThinK keeps the channels whose contribution has the
largest Frobenius norm, ``‖Q[:, i] K[:, i]ᵀ‖_F = ‖Q[:, i]‖₂ · ‖K[:, i]‖₂`` (a rank-one matrix). kvtrim scores
per KV head with the window queries of all query heads of its GQA group stacked (post-rotary queries and keys,
the vectors whose dot product the cache serves), over the keys the token selection kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import InvalidParameterError
from ..parts import Part
from ..scoring.base import LayerView
from ..scoring.observation import ObservationSpec
from .topk import Selection


def kept_slot_mask(selection: Selection, seq: int) -> torch.Tensor:
    """``[batch, kv_heads, seq]`` True for the slots a token selection keeps."""
    b, h, _ = selection.indices.shape
    mask = torch.zeros(b, h, seq, dtype=torch.bool, device=selection.indices.device)
    return mask.scatter_(2, selection.indices, selection.keep_mask)


def channel_scores(queries: torch.Tensor, query_positions: torch.Tensor, keys: torch.Tensor, kept: torch.Tensor):
    """ThinK's channel importance ``‖Q[:, i]‖₂² · ‖K[:, i]‖₂²`` per KV head (the square of the paper's norm).

    Args:
        queries: ``[batch, q_heads, w, head_dim]`` observation-window queries
        query_positions: ``[batch, w]`` (``-1``: padding, ignored)
        keys: ``[batch, kv_heads, seq, head_dim]``
        kept: ``[batch, kv_heads, seq]`` the key slots that count
    Returns:
        ``[batch, kv_heads, head_dim]`` fp32
    """
    b, hq, _, d = queries.shape
    hkv = keys.shape[1]
    q = queries.float() * (query_positions >= 0)[:, None, :, None]
    q_sq = q.square().sum(2).view(b, hkv, hq // hkv, d).sum(2)
    k_sq = (keys.float().square() * kept[..., None]).sum(2)
    return q_sq * k_sq


@dataclass
class QueryDrivenChannels(Part):
    """ThinK's key-channel pruning: per (sequence, KV head) keep the ``head_dim − ⌊λ·head_dim⌋`` channels with the
    largest ``‖Q_obs[:, i]‖ · ‖K[:, i]‖``.

    Args:
        window: observation-window queries that score the channels (the last ``window`` prompt tokens)
        fraction: λ, the fraction of key channels pruned, in [0, 1); ``None`` takes the request's ``ratio``
            (the ``think`` method alone, where the ratio is a channel fraction)
    """

    # capabilities (read by the method registry, kvtrim.methods.registry): the window queries pick the channels
    question_aware = True

    window: int = 8
    fraction: float | None = None
    observation: ObservationSpec = field(init=False)

    def __post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window <= 0:
            raise InvalidParameterError(f"window must be a positive integer, got {self.window!r}")
        if self.fraction is not None:
            bad = isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float))
            if bad or not 0.0 <= float(self.fraction) < 1.0:
                raise InvalidParameterError(
                    f"channel_ratio must be in [0, 1) (fraction of key channels pruned), got {self.fraction!r}"
                )
        self.observation = ObservationSpec(window=self.window)

    def check(self, ratio: float | None, budget: int | None) -> None:
        if self.fraction is None and ratio is None:
            raise InvalidParameterError(
                "think prunes key channels, not tokens: give ratio (fraction of key channels pruned, in [0, 1)); "
                "a budget of entries has no channel meaning (use think_snapkv to combine a token budget with "
                "channel pruning)"
            )

    def pruned_fraction(self, ratio: float | None) -> float:
        return float(self.fraction if self.fraction is not None else (ratio or 0.0))

    def select(self, view: LayerView, selection: Selection, ratio: float | None) -> torch.Tensor:
        """Kept channels ``[batch, kv_heads, d_kept]`` (ascending) of one layer after its token ``selection``."""
        d = view.keys.shape[-1]
        kept_dim = max(1, d - math.floor(self.pruned_fraction(ratio) * d))
        obs = view.observation
        if obs.queries is None:
            raise RuntimeError(f"layer {view.layer_idx}: ThinK needs observed queries but none were recorded")
        w = min(self.window, obs.window)
        kept = kept_slot_mask(selection, view.keys.shape[2]) & view.valid
        scores = channel_scores(obs.queries[:, :, -w:], obs.positions[:, -w:], view.keys, kept)
        return scores.topk(kept_dim, dim=-1).indices.sort(dim=-1).values
