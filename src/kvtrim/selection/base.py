"""The selector interface."""

from __future__ import annotations

from typing import Protocol

import torch

from .topk import Selection


class Selector(Protocol):
    """``select(view, scores, budgets) -> Selection``: which slots each (row, KV head) keeps.

    ``scores`` ``[batch, kv_heads, seq]`` (empty slots at ``-inf``), ``budgets`` ``[batch, kv_heads]``.
    """

    def select(self, view, scores: torch.Tensor, budgets: torch.Tensor) -> Selection: ...
