"""Cache merging (CaM): each evicted value is folded, with a probability read from the attention it received,
into the kept entries that follow it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import InvalidParameterError
from ..scoring.observation import ObservationSpec
from .base import Selection
from .merge import ValueMerge, kept_slots

_LAST = torch.iinfo(torch.long).max  # sort key of the slots that are not kept: after every kept position


def merge_probabilities(
    attention: torch.Tensor, positions: torch.Tensor, evicted: torch.Tensor, kept: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each evicted entry would merge and how likely it is to.

    The merge window of evicted entry ``e`` is the ``window`` kept entries of its head that come next in position
    order (fewer at the end of the head, none after its last kept entry). Its merge probability is
    ``clamp(A_e / mean(A over the window), 0, 1)``: an evicted entry that received as much attention as its
    neighbours merges for sure, one that received none never does.

    Args:
        attention: ``[batch, kv_heads, seq]`` attention each slot received (accumulated)
        positions: ``[batch, kv_heads, seq]`` logical positions
        evicted, kept: ``[batch, kv_heads, seq]`` disjoint masks of the slots leaving and staying
        window: kept entries per merge window (``m``), >= 1
    Returns:
        ``(probability, start, end, order)``: ``probability`` ``[batch, kv_heads, seq]`` (0 where a slot does not
        merge); ``start``, ``end`` the window of each slot as a half-open range of ranks among the head's kept
        entries in position order; ``order`` ``[batch, kv_heads, seq]`` the slot of each rank (kept slots first)
    """
    big = torch.full_like(positions, _LAST)
    sorted_positions, order = torch.where(kept, positions, big).sort(dim=-1, stable=True)
    n_kept = kept.sum(-1, keepdim=True)
    start = torch.searchsorted(sorted_positions, positions.contiguous(), right=True).clamp(max=n_kept)
    end = torch.minimum(start + window, n_kept)
    count = end - start
    ranked = (attention.float() * kept).gather(-1, order)  # the kept entries' attention in position order
    cum = torch.nn.functional.pad(ranked.cumsum(-1), (1, 0))  # [b, h, seq + 1]: cum[r] = sum of ranks < r
    mean = (cum.gather(-1, end) - cum.gather(-1, start)) / count.clamp(min=1)
    ratio = attention.float() / mean
    ratio = torch.where(mean > 0, ratio, (attention > 0).float())  # 0 / 0: no merge; x / 0: certain
    probability = ratio.clamp(0.0, 1.0) * (evicted & (count > 0))
    return probability, start, end, order


def merge_into_neighbours(
    values: torch.Tensor,
    kept: torch.Tensor,
    merged: torch.Tensor,
    start: torch.Tensor,
    end: torch.Tensor,
    order: torch.Tensor,
) -> torch.Tensor:
    """The values after adding ``v_e / |window_e|`` to every kept entry of the window of each merged ``e``.

    Args:
        values: ``[batch, kv_heads, seq, d]``
        kept, merged: ``[batch, kv_heads, seq]`` the slots staying and the evicted slots that merge
        start, end, order: from :func:`merge_probabilities`
    Returns:
        ``[batch, kv_heads, seq, d]`` in ``values``' dtype; slots that are not kept unchanged
    """
    v = values.float()
    count = (end - start).clamp(min=1)
    share = v * (merged.float() / count)[..., None]  # what each merged entry adds to each of its targets
    b, h, s, d = v.shape
    # A window is a run of consecutive ranks: add the share at its first rank, take it off after its last, and a
    # running sum over the ranks gives every kept entry what it receives (no [seq, window] expansion).
    delta = torch.zeros(b, h, s + 1, d, dtype=v.dtype, device=v.device)
    delta.scatter_add_(2, start[..., None].expand_as(share), share)
    delta.scatter_add_(2, end[..., None].expand_as(share), -share)
    received = delta[:, :, :s].cumsum(dim=2)  # [b, h, rank, d]
    added = torch.zeros_like(v).scatter_(2, order[..., None].expand_as(v), received)
    return torch.where(kept[..., None], v + added, v).to(values.dtype)


@dataclass
class NeighbourMerge(ValueMerge):
    """CaM's merge (Zhang et al., ICML 2024, "CaM: Cache Merging for Memory-efficient LLMs Inference",
    https://openreview.net/forum?id=LCTmppB165): an evicted entry's value is added, divided by the window's
    size, to the ``window`` kept entries of its head that follow it, when a Bernoulli draw with probability
    ``clamp(A_e / mean(A_window), 0, 1)`` says so (``A``: the attention each entry received, summed over the
    queries seen so far and the query heads of the group). Keys are unchanged. See :func:`merge_probabilities` and
    :func:`merge_into_neighbours`.

    Args:
        window: kept entries each evicted value is spread over (CaM's merge budget ``m``), >= 1
        seed: seed of the draws (each layer draws from ``seed + layer``), so a run can be repeated
    """

    window: int = 32
    seed: int = 0
    observation: ObservationSpec = field(init=False)

    def __post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise InvalidParameterError(f"window must be an integer >= 1 (kept entries per merge), got {self.window!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise InvalidParameterError(f"seed must be an integer >= 0, got {self.seed!r}")
        self.observation = ObservationSpec(accumulate=("attn_sum",))

    def merge(self, view, selection: Selection) -> torch.Tensor:
        """``[batch, kv_heads, seq, d]`` the values of ``view`` after CaM merges the slots ``selection`` evicts."""
        kept = kept_slots(selection, view.keys.shape[2]) & view.valid
        evicted = view.valid & ~kept
        p, start, end, order = merge_probabilities(view.stats["attn_sum"], view.positions, evicted, kept, self.window)
        generator = torch.Generator(device=p.device).manual_seed(self.seed + view.layer_idx)
        merged = torch.bernoulli(p, generator=generator) > 0
        return merge_into_neighbours(view.values, kept, merged, start, end, order)
