"""Merge on evict: each evicted entry's value is folded into the kept entry whose key is most like its own."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import InvalidParameterError
from ..parts import Part
from ..scoring.observation import ObservationSpec
from .base import Selection

_EPS = 1e-6
_ROWS = 256  # evicted candidates compared with the kept keys per step (bounds the similarity matrix)


def merge_evicted_values(
    keys: torch.Tensor,
    values: torch.Tensor,
    evicted: torch.Tensor,
    kept: torch.Tensor,
    threshold: float = 0.0,
    fraction: float = 1.0,
) -> torch.Tensor:
    """The values after folding every evicted entry into its nearest kept entry (cosine of the keys).

    Evicted entry ``e`` goes to the kept entry ``t`` of its head whose key is most similar; it merges when that
    similarity ``c`` is at least ``threshold`` and among the best ``fraction`` of the head's merges, with weight
    ``w = max(c, 0) · ‖v_e‖ / (‖v_e‖ + ‖v_t‖)``. A kept value receiving entries becomes
    ``(v_t + Σ w·v_e) / (1 + Σ w)``: a weighted average in which the kept value counts 1 and an evicted value
    counts more the more alike the keys and the larger its own norm. Keys, and values that receive nothing, are
    unchanged.

    Args:
        keys, values: ``[batch, kv_heads, seq, d]``
        evicted, kept: ``[batch, kv_heads, seq]`` disjoint masks of the slots leaving and staying
    Returns:
        ``[batch, kv_heads, seq, d]`` values in ``values``' dtype (evicted slots unchanged)
    """
    unit = torch.nn.functional.normalize(keys.float(), dim=-1, eps=_EPS)
    targets = unit.transpose(-1, -2)
    closed = ~kept[:, :, None, :]
    best_parts, target_parts = [], []
    for start in range(0, unit.shape[2], _ROWS):  # [b, h, rows, seq] similarities at a time, not [seq, seq]
        sim = (unit[:, :, start : start + _ROWS] @ targets).masked_fill(closed, float("-inf"))
        part = sim.max(dim=-1)
        best_parts.append(part.values)
        target_parts.append(part.indices)
    best, target = torch.cat(best_parts, -1), torch.cat(target_parts, -1)  # [b, h, s]: the nearest kept slot
    merges = evicted & torch.isfinite(best) & (best >= threshold)
    if fraction < 1.0:
        ranked = best.masked_fill(~merges, float("-inf"))
        n = merges.sum(-1, keepdim=True)
        take = torch.ceil(n * fraction).long()  # the best `fraction` of each head's merges
        order = ranked.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
        merges = merges & (order < take)
    v = values.float()
    norms = v.norm(dim=-1)
    target_norm = norms.gather(-1, target)
    weight = best.clamp(min=0.0).nan_to_num(0.0, 0.0, 0.0) * norms / (norms + target_norm + _EPS) * merges
    added = torch.zeros_like(v).scatter_add_(2, target[..., None].expand_as(v), weight[..., None] * v)
    mass = torch.zeros_like(norms).scatter_add_(2, target, weight)
    merged = (v + added) / (1.0 + mass[..., None])
    return torch.where((kept & (mass > 0))[..., None], merged, v).to(values.dtype)


def kept_slots(selection: Selection, seq: int) -> torch.Tensor:
    """``[batch, kv_heads, seq]`` True for the slots a selection keeps."""
    counts = torch.zeros(*selection.indices.shape[:2], seq, dtype=torch.long, device=selection.indices.device)
    return counts.scatter_add_(-1, selection.indices, selection.keep_mask.long()) > 0


class ValueMerge(Part):
    """``merge(view, selection) -> values``: folds the values of the entries ``selection`` evicts into the entries
    it keeps; runs between selection and compaction, and the store keeps the returned values.

    ``observation`` is what the merge reads while the prompt is prefilled (merged with the scorer's); none by
    default.
    """

    _declares_interface = True
    observation: ObservationSpec = ObservationSpec()

    def merge(self, view, selection: Selection) -> torch.Tensor:
        """``[batch, kv_heads, seq, d]`` the values of ``view`` after merging the slots ``selection`` evicts."""
        raise NotImplementedError(f"{type(self).__name__} must define merge(view, selection)")


@dataclass
class NearestKeyMerge(ValueMerge):
    """Merge on evict (D2O, Wan et al., 2024, "D2O: Dynamic Discriminative Operations for Efficient Long-Context
    Inference of Large Language Models", arXiv 2406.13035, whose evicted tokens join the most similar kept token;
    weighted as kvpress's MergingPress): see :func:`merge_evicted_values`. Runs between selection and compaction;
    the store then holds the merged values of the kept entries and frees the evicted ones.

    Args:
        threshold: least cosine similarity of the keys for a merge, in [0, 1]
        fraction: share of each head's candidate merges made (the most similar first), in (0, 1]
    """

    threshold: float = 0.0
    fraction: float = 1.0

    def __post_init__(self) -> None:
        t, f = self.threshold, self.fraction
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not 0.0 <= t <= 1.0:
            raise InvalidParameterError(f"threshold must be a number in [0, 1] (cosine similarity), got {t!r}")
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or not 0.0 < f <= 1.0:
            raise InvalidParameterError(f"fraction must be a number in (0, 1] (share of merges made), got {f!r}")

    def merge(self, view, selection: Selection) -> torch.Tensor:
        """``[batch, kv_heads, seq, d]`` the values of ``view`` after merging the slots ``selection`` evicts."""
        kept = kept_slots(selection, view.keys.shape[2]) & view.valid
        return merge_evicted_values(view.keys, view.values, view.valid & ~kept, kept, self.threshold, self.fraction)
