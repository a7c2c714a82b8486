"""KV storage whose keys keep only some of their channels (ThinK-style key-channel pruning).

A :class:`ChannelPrunedStore` wraps a :class:`~kvtrim.cache.dense.DenseStore` or
:class:`~kvtrim.cache.ragged.RaggedStore` whose key tensors hold ``d_kept < head_dim`` channels per (sequence,
KV head), together with the indices of those channels ``[batch, kv_heads, d_kept]``. Values keep their full
head dimension. Memory drops for real: the key buffers are ``d_kept`` wide.

With quantized entries (``kv_quant``) the inner store is a
:class:`~kvtrim.cache.quantized_dense.QuantizedDenseStore` or
:class:`~kvtrim.cache.quantized_ragged.QuantizedRaggedStore` whose keys hold ``d_kept`` channels: packed key codes
``ceil(d_kept·bits/8)`` bytes per entry and per-channel key scales and zero points over the kept channels only;
values stay quantized per token over the full head dimension. A key scale belongs to one channel of one group, so
pruning moves the kept channels' codes and scales unchanged (the pruned keys are exactly the quantized keys on
those channels), and keys appended later are quantized in groups over the kept channels.

Attention gathers each query head's channels to the kept channels of its KV head, so ``q[kept] · k[kept]`` is
the dot product with the pruned channels dropped (equal to ``q · k`` with those key channels zeroed); the scale
stays ``1/sqrt(head_dim)`` of the unpruned model. Tokens appended later (decoding, questions) are pruned to the
same channels before they are stored.
"""

from __future__ import annotations

import torch

from .dense import DenseStore
from .quant import KVQuant
from .quantized_dense import QuantizedDenseStore
from .quantized_ragged import QuantizedRaggedStore
from .ragged import RaggedStore

InnerStore = DenseStore | RaggedStore | QuantizedDenseStore | QuantizedRaggedStore


def gather_channels(x: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
    """``x`` ``[batch, heads, n, head_dim]`` restricted to ``channels`` ``[batch, heads, d_kept]`` →
    ``[batch, heads, n, d_kept]``."""
    return torch.gather(x, 3, channels[:, :, None, :].expand(-1, -1, x.shape[2], -1))


class ChannelPrunedStore:
    """A dense or ragged store, quantized or not, holding channel-pruned keys plus the kept channel indices.

    Attributes:
        inner: the store of ``(pruned keys [.., d_kept], values [.., head_dim], positions)``
        channels: ``[batch, kv_heads, d_kept]`` ascending kept key channels of every (sequence, KV head)
        head_dim: the unpruned key head dimension
    """

    def __init__(self, inner: InnerStore, channels: torch.Tensor, head_dim: int):
        self.inner = inner
        self.channels = channels
        self.head_dim = head_dim

    @classmethod
    def prune(cls, store: InnerStore, channels: torch.Tensor) -> ChannelPrunedStore:
        """Keep only ``channels`` ``[batch, kv_heads, d_kept]`` of ``store``'s keys (a new store; values, positions
        and slot statistics are shared with ``store``). Quantized keys keep their codes and per-channel scales."""
        if isinstance(store, ChannelPrunedStore):
            raise ValueError("the keys of this store are already channel-pruned")
        if isinstance(store, (QuantizedDenseStore, QuantizedRaggedStore)):
            return cls(store.with_key_channels(channels), channels, store.head_dim)
        b, h, dk = channels.shape
        if isinstance(store, DenseStore):
            keys = gather_channels(store.keys, channels).contiguous()
            inner = DenseStore(keys, store.values, store.positions, store.length)
            inner._stats = dict(store._stats)
            return cls(inner, channels, store.keys.shape[-1])
        # Ragged: every slot of row r = b * kv_heads + h keeps the channels of (b, h). Slot ownership comes from
        # the row bookkeeping, so append slack (owned, unfilled slots) is pruned too.
        slots = torch.arange(store._k.shape[0], device=channels.device)
        order = torch.argsort(store.start)
        owner = order[(torch.searchsorted(store.start[order], slots, right=True) - 1).clamp(min=0)]
        keys = torch.gather(store._k, 1, channels.reshape(b * h, dk)[owner]).contiguous()
        inner = RaggedStore(
            keys, store._v, store._pos, store.start, store.length, store.capacity, store.batch_size, store.kv_heads
        )
        inner._stats = dict(store._stats)
        return cls(inner, channels, store._k.shape[-1])

    # ------------------------------------------------------------------ the store protocol, delegated
    @property
    def layout(self) -> str:
        return self.inner.layout

    @property
    def kv_quant(self) -> KVQuant | None:
        """The entry format of the inner store (None: entries in the model's dtype)."""
        return self.inner.kv_quant if isinstance(self.inner, (QuantizedDenseStore, QuantizedRaggedStore)) else None

    @property
    def kept_channels(self) -> int:
        return self.channels.shape[-1]

    @property
    def keys(self) -> torch.Tensor:
        """The stored (pruned) keys ``[.., d_kept]``."""
        return self.inner.keys

    @property
    def values(self) -> torch.Tensor:
        return self.inner.values

    @property
    def positions(self) -> torch.Tensor:
        return self.inner.positions

    @property
    def length(self):
        return self.inner.length

    @property
    def batch_size(self) -> int:
        return self.inner.batch_size

    @property
    def kv_heads(self) -> int:
        return self.inner.kv_heads

    @property
    def is_empty(self) -> bool:
        return self.inner.is_empty

    def stat(self, name: str) -> torch.Tensor:
        return self.inner.stat(name)

    def row_max_positions(self) -> torch.Tensor:
        return self.inner.row_max_positions()

    def latest_positions(self) -> torch.Tensor:
        return self.inner.latest_positions()

    @property
    def causal_prefill_ready(self) -> bool:
        return self.inner.causal_prefill_ready

    rescorable = False  # the keys lost channels: scoring them again would compare different dot products

    def to_dense(self):
        raise ValueError("the keys of this store are channel-pruned: it has no dense form with full keys")

    def mark(self):
        return self.inner.mark()

    def drop_last(self, n: int) -> None:
        self.inner.drop_last(n)

    def truncate_to(self, mark) -> None:
        self.inner.truncate_to(mark)

    def entries(self) -> int:
        return self.inner.entries()

    def entries_per_head(self) -> torch.Tensor:
        return self.inner.entries_per_head()

    def nbytes(self) -> int:
        """Bytes of the (pruned) key and value buffers (packed codes, scales, zero points and full-precision window
        when quantized)."""
        return self.inner.nbytes()

    def index_nbytes(self) -> int:
        """Bookkeeping bytes: the inner store's plus the kept channel indices."""
        return self.inner.index_nbytes() + self.channels.untyped_storage().nbytes()

    def copy(self) -> ChannelPrunedStore:
        return ChannelPrunedStore(self.inner.copy(), self.channels.clone(), self.head_dim)

    def select_batch(self, index: torch.Tensor) -> None:
        self.inner.select_batch(index)
        self.channels = self.channels[index]

    # ------------------------------------------------------------------ appends and attention
    def append(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, padded: bool | None = None
    ) -> None:
        """Append new tokens with their keys pruned to the kept channels.

        Args:
            keys, values: ``[batch, kv_heads, q, head_dim]``; positions ``[batch, q]``
            padded: as the inner store's ``append`` (whether some tokens may be padding; None reads the device)
        """
        self.inner.append(gather_channels(keys, self.channels), values, positions, padded=padded)

    def query_channels(self, query: torch.Tensor) -> torch.Tensor:
        """``query`` ``[batch, q_heads, q, head_dim]`` restricted to its KV head's kept channels."""
        group = query.shape[1] // self.channels.shape[1]
        return gather_channels(query, self.channels.repeat_interleave(group, dim=1))

    def attend(
        self, query: torch.Tensor, query_positions: torch.Tensor, scaling: float, fresh_causal: bool = False
    ) -> torch.Tensor:
        """Attention of ``query`` ``[batch, q_heads, q, head_dim]`` over the pruned keys (scale unchanged).
        Returns ``[batch, q, q_heads, head_dim]``."""
        return self.inner.attend(self.query_channels(query), query_positions, scaling, fresh_causal)
