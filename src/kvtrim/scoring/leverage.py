"""Leverage scores of the cached entries: how far a key (or value) sticks out of the span of the others.

The statistical leverage of row ``i`` of a matrix ``X`` ``[n, d]`` is ``h_i = x_iᵀ (XᵀX)⁺ x_i``, the diagonal of
the projection onto ``X``'s column space: ``0 ≤ h_i ≤ 1``, ``Σ h_i = rank X``, unchanged when ``X`` is multiplied
on the right by any invertible matrix; an outlier row has leverage near 1. Two uses: exact leverage of the centred
pre-RoPE keys (Compactor) and the squared row norms normalized inside short windows of positions, CurDKV's cheap
stand-in for the leverage of keys and values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import InvalidParameterError
from .base import LayerView, Scorer
from .observation import ObservationSpec
from .rope import cos_sin, rope_frequencies, rotate_half

KINDS = ("key", "value", "kv_avg", "kv_product")


def leverage_scores(x: torch.Tensor, valid: torch.Tensor, center: bool = True) -> torch.Tensor:
    """Exact leverage ``diag(X (XᵀX)⁺ Xᵀ)`` of the valid rows of each ``[seq, dim]`` matrix.

    Args:
        x: ``[batch, heads, seq, dim]``
        valid: ``[batch, heads, seq]`` rows that take part (the others score 0 and do not enter ``XᵀX``)
        center: subtract the mean of the valid rows first (leverage of the centred data)
    Returns:
        ``[batch, heads, seq]`` fp32 in [0, 1]; the valid scores of a head sum to the rank of its rows
    """
    weight = valid[..., None].to(torch.float64)
    rows = x.to(torch.float64) * weight
    if center:
        count = weight.sum(2, keepdim=True).clamp(min=1.0)
        rows = (rows - rows.sum(2, keepdim=True) / count) * weight
    gram = rows.transpose(-1, -2) @ rows  # [b, h, d, d]
    inverse = torch.linalg.pinv(gram, hermitian=True)
    scores = ((rows @ inverse) * rows).sum(-1)
    return scores.clamp(0.0, 1.0).to(torch.float32)


def _dense_groups(ids: torch.Tensor) -> torch.Tensor:
    """Consecutive equal ``ids`` ``[..., seq]`` → group indices 0, 1, … in ``[0, seq)`` (ids ascending per row)."""
    change = torch.ones_like(ids, dtype=torch.long)
    change[..., 1:] = (ids[..., 1:] != ids[..., :-1]).long()
    return change.cumsum(-1) - 1


def window_normalized_norms(x: torch.Tensor, positions: torch.Tensor, window: int) -> torch.Tensor:
    """``‖x_i‖² / Σ_j ‖x_j‖²`` over the entries ``j`` whose position shares ``i``'s window of ``window`` positions.

    Args:
        x: ``[batch, heads, seq, dim]`` entries stored in position order (every kvtrim store keeps them so)
        positions: ``[batch, heads, seq]`` logical positions, ``-1`` for empty slots (they score 0)
    Returns:
        ``[batch, heads, seq]`` fp32; the scores of each full window sum to 1
    """
    valid = positions >= 0
    sq = x.float().pow(2).sum(-1) * valid
    groups = _dense_groups(torch.where(valid, positions.div(window, rounding_mode="floor"), -1))
    totals = torch.zeros_like(sq).scatter_add_(-1, groups, sq)
    return torch.where(valid, sq / totals.gather(-1, groups).clamp(min=torch.finfo(torch.float32).tiny), 0.0)


def unrotate_keys(keys: torch.Tensor, positions: torch.Tensor, config) -> torch.Tensor:
    """Pre-RoPE keys ``[batch, kv_heads, seq, head_dim]`` fp32 from the stored (rotated) ones at ``positions``."""
    inv_freq, scale = rope_frequencies(config, keys.shape[-1], keys.device)
    cos, sin = cos_sin(positions.clamp(min=0), inv_freq)  # [b, h, s, d]
    k = keys.float()
    return (k * cos - rotate_half(k) * sin) / scale


@dataclass
class LocalLeverageScorer(Scorer):
    """CurDKV's approximate leverage (Sengupta et al., 2025, "Value-Guided KV Compression for LLMs via
    Approximated CUR Decomposition", arXiv 2509.15038; kvpress's CURPress without its random projection).

    The leverage of a row is approximated by its squared norm over the squared norms of the entries in its window
    of ``window`` positions (:func:`window_normalized_norms`), for keys and for values; ``kind`` combines them:
    ``"key"``, ``"value"``, ``"kv_avg"`` (mean) or ``"kv_product"`` (product, the paper's value-guided score).
    Rotary embeddings keep key norms, so the stored keys serve. Attention-free; the same in both modes.
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    uses_attention = False
    question_aware = False

    kind: str = "kv_product"
    window: int = 16
    observation: ObservationSpec = field(default_factory=ObservationSpec)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidParameterError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise InvalidParameterError(f"window must be an integer >= 1, got {self.window!r}")

    def score(self, view: LayerView) -> torch.Tensor:
        keys = window_normalized_norms(view.keys, view.positions, self.window)
        values = window_normalized_norms(view.values, view.positions, self.window)
        if self.kind == "key":
            return keys
        if self.kind == "value":
            return values
        if self.kind == "kv_avg":
            return (keys + values) / 2
        return keys * values


@dataclass
class KeyLeverageScorer(Scorer):
    """Exact statistical leverage of the centred pre-RoPE keys of each KV head (Chari & Van Durme, 2025,
    "Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate Leverage Scores", arXiv
    2507.08143; kvpress's LeverageScorePress).

    The paper and kvpress approximate the leverage with a Gaussian sketch of the keys (random, 48 columns);
    kvtrim computes it exactly (:func:`leverage_scores`, a ``head_dim × head_dim`` pseudo-inverse per head), which
    is deterministic and costs ``O(n·d²)``. Keys are un-rotated with the model's rotary frequencies
    (:func:`unrotate_keys`). Attention-free; the same in both modes.
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    uses_attention = False
    question_aware = False

    observation: ObservationSpec = field(default_factory=ObservationSpec)

    def score(self, view: LayerView) -> torch.Tensor:
        config = getattr(view.module, "config", None)
        if config is None:
            raise RuntimeError(f"layer {view.layer_idx}: leverage scores need the attention module's config")
        keys = unrotate_keys(view.keys, view.positions, config)
        return leverage_scores(keys, view.valid)
