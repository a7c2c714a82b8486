"""What the compression layer needs of a cache (implemented by :class:`kvtrim.integration.cache.KVTrimCache`)."""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["CompressibleCache"]


class CompressibleCache(Protocol):
    """A cache the compressor and the schedules work on.

    ``layers`` each carry ``store`` (a :class:`kvtrim.cache.store.KVStore` or None), ``seen``, ``observation``,
    ``module`` and ``compressed_until``; ``kv_layers`` are those with a store.
    """

    layers: list
    budget: object
    tokens_since_compression: int
    prompt_logprobs: torch.Tensor | None
    prompt_ids: torch.Tensor | None
    question_start: torch.Tensor | None

    @property
    def kv_layers(self) -> list: ...

    def track_peak(self) -> None:
        """Record the bytes held now as a peak candidate."""

    def context_lengths(self) -> torch.Tensor | None:
        """``[batch]`` tokens seen per row, or None while empty."""

    def entries_per_layer_head(self) -> torch.Tensor:
        """``[batch, layers, kv_heads]`` entries held."""

    def replay(self, model, views, input_ids, attention_mask, position_ids, observation) -> dict:
        """Feed tokens through ``model`` over a scratch copy of the views' entries (see ``LayerView.replay``)."""
