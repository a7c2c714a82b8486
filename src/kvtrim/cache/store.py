"""The ``KVStore`` protocol: what every layer store (dense, ragged, channel-pruned) offers its callers.

The cache adapter, the compressor and the attention function call these methods instead of branching on the
layout: a new layout is a new class that implements them.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["KVStore"]


@runtime_checkable
class KVStore(Protocol):
    """The K/V entries of one layer of a cache, with their logical positions.

    Shapes: ``batch`` rows, ``kv_heads`` heads. Padded views (``keys``, ``values``, ``positions``, ``stat``)
    belong to dense stores (:class:`~kvtrim.cache.dense.DenseStore`); :meth:`to_dense` gives one.
    """

    layout: str
    """A name for reports (``"dense"``, ``"ragged"``); callers never branch on it."""

    @property
    def batch_size(self) -> int: ...

    @property
    def kv_heads(self) -> int: ...

    @property
    def is_empty(self) -> bool: ...

    @property
    def causal_prefill_ready(self) -> bool:
        """True when an unpadded chunk of consecutive positions appended now may use plain causal attention."""

    @property
    def rescorable(self) -> bool:
        """True when the entries can be scored and compressed again (False once key channels are pruned)."""

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, padded: bool) -> None:
        """Store ``[batch, kv_heads, q, head_dim]`` new entries at ``positions`` ``[batch, q]`` (``-1``: padding)."""

    def attend(
        self, query: torch.Tensor, query_positions: torch.Tensor, scaling: float, fresh_causal: bool = False
    ) -> torch.Tensor:
        """Attention of ``query`` ``[batch, q_heads, q, head_dim]``; returns ``[batch, q, q_heads, head_dim]``."""

    def latest_positions(self) -> torch.Tensor:
        """``[batch]`` the largest stored position per row (``-1`` for a row with nothing stored)."""

    def mark(self) -> Any:
        """The current end, for :meth:`truncate_to`."""

    def truncate_to(self, mark: Any) -> None: ...

    def drop_last(self, n: int) -> None:
        """Remove the last ``n`` appended token columns (assisted decoding's crop)."""

    def to_dense(self) -> Any:
        """A dense store with the same entries (itself when already dense)."""

    def copy(self) -> KVStore: ...

    def select_batch(self, index: torch.Tensor) -> None: ...

    def entries(self) -> int: ...

    def entries_per_head(self) -> torch.Tensor: ...

    def nbytes(self) -> int: ...

    def index_nbytes(self) -> int: ...
