"""The budget-allocator interface: how many entries each (row, layer, KV head) keeps."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..parts import Part


@dataclass(frozen=True)
class BudgetRequest:
    """What the user asked for, resolved per batch row.

    Attributes:
        keep: ``[batch]`` mean entries to keep per layer and KV head (already at most ``context_lengths``)
        context_lengths: ``[batch]`` real tokens in each row
        num_layers, kv_heads: cache geometry
        positions: per layer ``[batch, kv_heads, seq]`` logical positions of the stored slots (-1 = empty)
        ratio: the requested fraction removed, when the user gave a ratio (None for a budget)
        compressed_until: per layer ``[batch]`` first position not yet compressed by a recursive method, or None
    """

    keep: torch.Tensor
    context_lengths: torch.Tensor
    num_layers: int
    kv_heads: int
    positions: list[torch.Tensor] | None = None
    ratio: float | None = None
    compressed_until: list[torch.Tensor | None] | None = None


class BudgetAllocator(Part):
    """``allocate(request, scores) -> [batch, layers, kv_heads]`` entries kept (protected windows included).

    Optional hooks (``bind``, ``check``, ``describe_compression``) are :class:`~kvtrim.parts.Part`'s.
    ``keeps_below_request``: the allocator may keep fewer entries than requested even when the request keeps the
    whole context (a score threshold), so the compressor must not skip such a compression."""

    _declares_interface = True
    keeps_below_request: bool = False

    def allocate(self, request: BudgetRequest, scores: list[torch.Tensor]) -> torch.Tensor:
        """``[batch, layers, kv_heads]`` entries each (row, layer, KV head) keeps, given every layer's scores."""
        raise NotImplementedError(f"{type(self).__name__} must define allocate(request, scores)")
