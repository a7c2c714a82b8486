"""Key re-rotation: after eviction, the kept keys are rotated to contiguous positions, as if the evicted tokens had
never been there (kvpress's KeyRerotationPress; the rolling cache of StreamingLLM and FINCH do the same)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..parts import Part
from ..scoring.rope import cos_sin, rope_frequencies, rotate_half
from .base import Selection
from .merge import kept_slots

_LAST = torch.iinfo(torch.long).max  # sort key of the slots that are not kept: after every kept position


def rotate_keys(keys: torch.Tensor, shift: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotary keys moved by ``shift`` positions: a key rotated for position ``p`` becomes the key rotated for
    ``p + shift`` (``R(p + s) = R(s) R(p)``; the attention scaling of the embedding is already in ``keys``).

    Args:
        keys: ``[batch, kv_heads, seq, head_dim]`` post-rotary keys
        shift: ``[batch, kv_heads, seq]`` integer shifts (0 leaves a key unchanged)
        inv_freq: ``[head_dim // 2]`` the model's rotary frequencies
    Returns:
        ``[batch, kv_heads, seq, head_dim]`` in ``keys``' dtype
    """
    cos, sin = cos_sin(shift, inv_freq)
    k = keys.float()
    return (k * cos + rotate_half(k) * sin).to(keys.dtype)


def contiguous_positions(positions: torch.Tensor, kept: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
    """The positions the kept entries of each head take when they are packed next to each other and end where the
    context ends: the ``r``-th of a head's ``n`` kept entries (position order) goes to ``context − n + r``.

    This is kvpress's layout (kept entries at ``0 … n−1``, decoding continuing at ``n``) moved by ``context − n``
    positions, which rotary attention cannot tell apart (it sees only differences of positions), so new tokens keep
    the positions the model gives them. A kept entry never moves back (``context − n + r`` is at least its own
    position). Slots that are not kept keep their position.

    Args:
        positions: ``[batch, kv_heads, seq]`` logical positions (``-1``: empty)
        kept: ``[batch, kv_heads, seq]`` the slots staying
        context: ``[batch]`` tokens seen per row
    Returns:
        ``[batch, kv_heads, seq]`` long
    """
    order = torch.where(kept, positions, torch.full_like(positions, _LAST)).argsort(dim=-1, stable=True)
    ranks = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, ranks)  # rank of each slot among the head's kept ones
    first = context.view(-1, 1, 1) - kept.sum(-1, keepdim=True)
    return torch.where(kept, first + rank, positions)


@dataclass
class KeyRerotation(Part):
    """Re-rotates the kept keys of a layer to contiguous positions before compaction (kvpress KeyRerotationPress;
    used by FINCH, Corallo & Papotti, TACL 2024, arXiv 2408.00167, and by the rolling cache of StreamingLLM, Xiao
    et al., ICLR 2024, arXiv 2309.17453): see :func:`contiguous_positions` and :func:`rotate_keys`. The store then
    holds each kept key rotated for, and recorded at, its new position."""

    def rerotate(self, view, selection: Selection) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, positions)`` of ``view`` (``[batch, kv_heads, seq, d]``, ``[batch, kv_heads, seq]``) with the
        slots ``selection`` keeps moved to contiguous positions."""
        config = getattr(view.module, "config", None)
        if config is None:
            raise RuntimeError(f"layer {view.layer_idx}: key re-rotation needs the attention module's config")
        kept = kept_slots(selection, view.keys.shape[2]) & view.valid
        new = contiguous_positions(view.positions, kept, view.context_lengths)
        inv_freq, _ = rope_frequencies(config, view.keys.shape[-1], view.keys.device)
        return rotate_keys(view.keys, new - view.positions, inv_freq), new
