"""The selector interface and what a selection is."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..parts import Part

__all__ = ["Selection", "Selector"]


@dataclass(frozen=True)
class Selection:
    """Slots to keep per (row, KV head).

    Attributes:
        indices: ``[batch, kv_heads, k]`` slot indices, ascending (``k`` = the largest budget)
        keep_mask: ``[batch, kv_heads, k]`` False where a selected slot is beyond its head's budget or empty
        compressed_until: ``[batch]`` for recursive methods: positions below it are final and never re-scored
    """

    indices: torch.Tensor
    keep_mask: torch.Tensor
    compressed_until: torch.Tensor | None = None


class Selector(Part):
    """``select(view, scores, budgets) -> Selection``: which slots each (row, KV head) keeps.

    ``scores`` ``[batch, kv_heads, seq]`` (empty slots at ``-inf``), ``budgets`` ``[batch, kv_heads]``. Optional
    hooks (``bind``, ``check``, ``describe_compression``) are :class:`~kvtrim.parts.Part`'s.
    """

    _declares_interface = True

    def select(self, view, scores: torch.Tensor, budgets: torch.Tensor) -> Selection:
        """The slots each (row, KV head) of ``view`` keeps under ``budgets``."""
        raise NotImplementedError(f"{type(self).__name__} must define select(view, scores, budgets)")
